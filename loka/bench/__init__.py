"""The benchmark harness behind ``loka bench`` and ``bench/run_all.py``.

One process, one device, every variant side by side: bf16, bf16 + CUDA graphs, bf16 +
Mods, torchao's float8 recipes (all eligible Linears and torchao's auto filter, with and
without Mods) and LoKA (Probe -> plan -> apply, with Mods), for the training step and the
inference forward. Ratios are only meaningful within one run: the baselines are always
re-measured beside LoKA. Each finished variant is written to the JSON at once, so a crash
or a time-out loses nothing that was measured.

Timing: the median of per-step CUDA-event times (a full step: forward, BCE loss, backward,
optimizer) after warm-up (:func:`loka.timing.time_steps`); on the CPU, wall-clock medians
(a smoke test, not a result).

One job per module, each importing only those before it: ``variants`` (the row names,
parsed once into :class:`Variant`), ``config`` (:class:`BenchConfig`), ``args`` (the
options of ``loka bench``), ``env`` (where a run happened), ``models`` (a row's model and
batch), ``steps`` (the timed step, CUDA graphs, peak memory), ``baselines`` (torchao's
recipes), ``plans`` (LoKA's plans: probed, loaded, tuned, searched, static scales, uniform
yardsticks), ``profiling`` (GPU time by kernel class), ``plots``, ``rows`` (one row),
``runner`` (a run, a batch-size sweep) and ``cli`` (the harness as a command).

What the command line's parser needs (variants, config, args) is imported with the
package; the rest on first use of one of its names, because building the models loads
torch.compile's machinery, which takes seconds that ``loka --help`` should not pay.
"""

import importlib

from .variants import (FASTEST, INFER_VARIANTS, MODIFIERS, RATIO_REFS, TORCHAO_RECIPES,
                       TRAIN_VARIANTS, Base, Variant, VariantError, parse_variants)
from .config import PROBE_KERNELS, BenchConfig
from .args import add_arguments, config_from_args, named_plans

_LAZY = {
    "env": ("environment", "source_digest"),
    "models": ("build_model", "make_batch", "cast_batch", "set_pooling", "count_fp8"),
    "steps": ("GraphedStep", "GraphedForward", "peak_memory_gb"),
    "plans": ("SEARCH_CANDIDATES", "probe_and_plan", "static_scales", "uniform_plan"),
    "profiling": ("kernel_class", "op_breakdown", "profile_breakdown"),
    "plots": ("plot", "plot_panels", "plot_sweep"),
    "rows": ("prepare_train", "run_train_variant", "run_infer_variant"),
    "runner": ("checks", "run", "run_sweep", "table"),
    "cli": ("run_from_args", "main"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}

__all__ = ["Variant", "VariantError", "Base", "MODIFIERS", "parse_variants", "TORCHAO_RECIPES",
           "FASTEST", "TRAIN_VARIANTS", "INFER_VARIANTS", "RATIO_REFS", "BenchConfig",
           "PROBE_KERNELS", "add_arguments", "config_from_args", "named_plans", *_WHERE]


def __getattr__(name):
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
