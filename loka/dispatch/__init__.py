"""Dispatch: plans, ``loka.Linear`` and applying plans to models."""

from .linear import Linear

__all__ = ["Linear"]
