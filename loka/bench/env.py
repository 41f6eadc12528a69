"""Where a run happened: versions, device, commit and a digest of the code that ran."""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import platform
import subprocess

import torch

from ..kernels import capabilities as caps

__all__ = ["environment", "source_digest", "default_out", "PACKAGE_ROOT"]

PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""the ``loka`` package directory whose sources :func:`source_digest` hashes"""


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "device": str(device), "date": _dt.datetime.now(_dt.timezone.utc).isoformat()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    for mod in ("triton", "torchao"):
        if caps.module_available(mod):
            env[mod] = getattr(__import__(mod), "__version__", "?")
    env["commit"] = os.environ.get("LOKA_COMMIT", "")
    try:
        env["commit"] = env["commit"] or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
            cwd=PACKAGE_ROOT).stdout.strip() or "unknown"
    except Exception:  # noqa: BLE001 - not a git checkout
        env["commit"] = "unknown"
    env["source_sha1"] = source_digest()
    return env


def source_digest() -> str:
    """SHA-1 over the package's Python sources (paths and contents): names the code that
    ran even where the checkout's git metadata is missing or stale (a copied tree)."""
    h = hashlib.sha1()
    for dirpath, dirnames, files in os.walk(PACKAGE_ROOT):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, name)
            h.update(os.path.relpath(path, PACKAGE_ROOT).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


def default_out(env: dict) -> str:
    """``bench/results/<date>-<gpu>-<commit>.json``."""
    gpu = env.get("gpu", "cpu").replace(" ", "-").replace("/", "-")
    date = env["date"][:10]
    return os.path.join("bench", "results", f"{date}-{gpu}-{env.get('commit', 'unknown')}.json")
