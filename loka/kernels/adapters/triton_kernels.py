"""Triton kernels (being written)."""
