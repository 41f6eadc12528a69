"""Helpers several test files share."""

import pytest

from loka.kernels import registry


def need_kernel(name: str, device: str = "cpu") -> None:
    """Skip the calling test where kernel ``name`` cannot run on ``device``, with the
    registry's reason: e.g. the rowwise ``cublas-*`` kernels on the CPU of a torch build
    whose CPU ``_scaled_mm`` takes per-tensor scales only (torch 2.11's)."""
    ok = registry.get(name).device_ok(device)
    if not ok:
        pytest.skip(f"{name} on {device}: {ok.reason}")
