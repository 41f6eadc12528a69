"""The whole of LoKA on one small model, end to end: what ``loka demo`` runs.

1. Train Wukong (``small``) on the synthetic CTR stream with the Probe attached.
2. Measure every kernel at every GEMM site and role (``report.json``).
3. Plan under the error budget (``plan.json``).
4. Branch: both arms resume from the same checkpoint (weights, optimizer state, RNG,
   data position) and train the same number of steps on the same stream; the LoKA arm has
   the plan applied. Both are evaluated on the same held-out batches.
5. Print NE, AUC, the per-site decisions and (on a GPU) speed side by side; write
   ``report.html``, ``summary.md`` and ``curves.json``.

On the CPU the Probe measures the emulated kernels and torch's CPU ``_scaled_mm``; CPU
wall-clock says nothing about FP8 speed on a GPU, so the plan is made on error alone
(``loka.plan(..., assume_fast=True)``), and the output says so.

:class:`DemoConfig` (``demo.config``) says what to train, probe and compare; :func:`run`
(``demo.runner``) does it; the command line's options for them are in ``loka.cli``.
``config`` is imported with the package, ``runner`` on first use of ``run``: it builds
models, and importing the models loads torch.compile's machinery (``loka.mods.fused``), which
takes seconds that ``loka --help`` should not pay (it reads DemoConfig's defaults).
"""

import importlib

from .config import CPU_KERNELS, QUICK_KERNELS, DemoConfig

__all__ = ["DemoConfig", "CPU_KERNELS", "QUICK_KERNELS", "run"]


def __getattr__(name):
    if name == "run":
        return importlib.import_module(f"{__name__}.runner").run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
