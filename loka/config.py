"""Frozen configuration dataclasses shared by every part of LoKA.

Each field carries its meaning in a comment-docstring beneath it (torchtitan style), so
that ``help(ProbeConfig)`` and the generated API reference say what a knob does.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Tuple


class ValueEnum(str, enum.Enum):
    """A string-valued enum that prints, formats and serializes as its value (``fwd``, not
    ``Role.FWD``) and compares equal to it."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class Role(ValueEnum):
    """The three GEMMs of a Linear ``y = x Wᵀ``.

    ``fwd``   : ``x (M, K) @ Wᵀ (K, N) -> y (M, N)``
    ``dgrad`` : ``dy (M, N) @ W (N, K) -> dx (M, K)``
    ``wgrad`` : ``dyᵀ (N, M) @ x (M, K) -> dW (N, K)``
    """

    FWD = "fwd"
    DGRAD = "dgrad"
    WGRAD = "wgrad"

    @classmethod
    def parse(cls, value: "Role | str") -> "Role":
        if isinstance(value, Role):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown role {value!r}; expected one of {[r.value for r in cls]}"
            ) from None


ROLES: Tuple[Role, ...] = (Role.FWD, Role.DGRAD, Role.WGRAD)
"""the three roles, in the order tables and plans list them"""
GRAD_ROLES = frozenset({Role.DGRAD, Role.WGRAD})
"""the roles of the backward pass (they need gradients to be observed)"""

BASELINE = "bf16"
"""the kernel every FP8 choice is measured against and falls back to"""
REFERENCE_KERNEL = "fp32"
"""the high-precision kernel errors are measured against; never a dispatch candidate"""


def role_shape(role: Role | str, m: int, k: int, n: int) -> Tuple[int, int, int]:
    """(M, K, N) of the GEMM ``a (M, K) @ b (K, N)`` a role runs, for a Linear of
    ``in_features=k``, ``out_features=n`` applied to ``m`` rows."""
    role = Role.parse(role)
    if role is Role.FWD:
        return (m, k, n)
    if role is Role.DGRAD:
        return (m, n, k)
    return (n, m, k)


@dataclass(frozen=True)
class LinearConfig:
    """Which registered kernel runs each GEMM role of one ``loka.Linear``."""

    fwd: str = "bf16"
    """kernel name for the forward GEMM ``x @ Wᵀ``"""
    dgrad: str = "bf16"
    """kernel name for the input gradient ``dy @ W``"""
    wgrad: str = "bf16"
    """kernel name for the weight gradient ``dyᵀ @ x``"""

    def kernel(self, role: Role | str) -> str:
        return getattr(self, Role.parse(role).value)

    @classmethod
    def uniform(cls, name: str) -> "LinearConfig":
        return cls(fwd=name, dgrad=name, wgrad=name)

    def to_dict(self) -> dict:
        return {"fwd": self.fwd, "dgrad": self.dgrad, "wgrad": self.wgrad}


@dataclass(frozen=True)
class ProbeConfig:
    """How the Probe learns statistics and measures kernels."""

    every_n_steps: int = 100
    """update online statistics on every N-th training step (the first step always)"""
    max_full_cov_dim: int = 1024
    """feature dims up to this keep a full covariance; larger ones use ``block_size`` blocks"""
    block_size: int = 256
    """block size of the block-diagonal covariance used above ``max_full_cov_dim``"""
    max_rows_per_update: int = 1024
    """rows of a captured activation/gradient used per statistics update (a random subset;
    a statistics step's GPU work scales with it; ``bench/bench_probe.py --rows-per-update``
    measures it)"""
    weight_ema: float = 0.9
    """exponential moving-average factor of the matrix-normal weight model"""
    num_samples: int = 16
    """synthetic (A, B) pairs drawn per site and role. Each pair holds ``sample_rows`` rows
    (up to 4096): 16 pairs are 65536 rows per site and role, where the paper draws 50-100
    samples per layer"""
    sample_rows: Optional[int] = None
    """rows M of each synthetic sample; None: the site's observed row count, capped at 4096"""
    source: str = "learned"
    """'learned' (sample from statistics), 'captured' (use real captured tensors)"""
    compare_naive: bool = False
    """also measure every kernel on N(0, 1) inputs, for the learned-vs-naive comparison
    (a diagnostic: it costs as much as the errors themselves)"""
    kernels: Optional[Tuple[str, ...]] = None
    """restrict measurement to these kernel names; None: on a GPU the default set
    (:data:`loka.kernels.registry.PROBE_DEFAULT`, those available), on the CPU every
    available kernel"""
    all_kernels: bool = False
    """with ``kernels`` None, measure every available kernel on a GPU too (23 on an H200,
    about 4x the Probe's time of the default set)"""
    roles: Tuple[Role, ...] = ROLES
    """roles to measure"""
    head_sites: int = 3
    """of this many sites nearest the loss (the last to run in the observed forward, never
    more than a quarter of the sites: ``loka.probe.report.nearest_the_loss``), measure the
    forward only: a training plan keeps them on the baseline in every role
    (``DispatchConfig.head_sites``, the same default) and a serving plan runs forwards
    only, so their gradient roles' errors and timings would serve no plan. A plan made
    with a smaller ``head_sites`` from such a report keeps those roles on the baseline,
    untimed. 0 measures every role of every site."""
    max_error: float = 0.2
    """budget on MERE's upper 95% bound used for the report's ``safe`` flag"""
    min_speedup: float = 1.05
    """speedup over the bf16 baseline above which a kernel is flagged ``fast``"""
    bootstrap: int = 1000
    """bootstrap resamples for the confidence intervals"""
    timing: bool = True
    """measure speed (CUDA graphs on GPU, wall-clock on CPU); False: errors only"""
    timing_rows: Optional[int] = None
    """M used for timing; None: the observed token count of the site"""
    seed: int = 0
    """seed of the sampler and the bootstrap"""
    module_filter: Optional[str] = None
    """regular expression: only Linears whose fully qualified name matches are probed"""
    weight_source: str = "model"
    """synthetic weights for source='learned': 'model' draws fresh W ~ MN(0, U, V) from the
    matrix-normal model, 'mean' uses the EMA of the weight snapshots as it is"""
    timing_warmup: int = 10
    """untimed calls before each timing"""
    timing_iters: int = 50
    """timed repetitions (CUDA-graph replays on GPU) whose median is reported, at most"""
    timing_budget_ms: Optional[float] = 100.0
    """time budget of one timing after its warm-up: slow calls get fewer repetitions (never
    below 5); None: always ``timing_iters``"""
    progress: bool = True
    """show a progress bar over sites while ``report()`` measures"""
    graph_updates: bool = True
    """on CUDA, replay each statistics update as a CUDA graph (captured at the second
    update of a shape; eager where capture fails): removes the host work of a statistics
    step (its GPU work stays) and holds the graphs' temporaries in one memory pool;
    no effect on the CPU"""
    naive_samples: int = 16
    """N(0, 1) samples per site and role for ``naive_mere`` (its spread is small)"""
    timing_compile: str = "auto"
    """how kernels whose quantization is plain PyTorch (``cublas-*``, ``torchao-*``) are
    timed: 'on' under ``torch.compile`` (Inductor fuses their quantization into one or two
    kernels, as it does inside a compiled model), 'off' eagerly (one kernel per op),
    'auto' compiled on CUDA and eager elsewhere. Kernels with their own quantization
    kernels (Triton, FBGEMM) and the baseline are always timed as they are"""
    skip_emulated_twins: bool = True
    """on GPUs, skip an emulated kernel where the real kernel it emulates runs too (same
    quantization numerics, no speed to offer; saves measurement time); ignored on the CPU
    and when ``kernels`` is given"""
    twin_errors: bool = True
    """a kernel whose output equals a measured kernel's bit for bit (``Kernel.same_bits_as``:
    LoKA's Triton quantizers with cuBLAS's GEMM, against PyTorch's quantizers with the same
    GEMM) runs on the first sample only, beside that kernel, and where the outputs are
    equal takes its error samples (the report's ``errors_from`` names it; where they are
    not, it samples its own, ``meta['twin_mismatches']``); False: every kernel samples
    its own"""
    time_unsafe: bool = False
    """also time kernels whose error is over ``max_error`` at a site and role (False: they
    are no candidates there, and timing, the Probe's largest cost, is skipped; a plan made
    later with a looser budget then finds no speed for them and keeps the baseline)"""
    roofline_prune: bool = True
    """on a GPU whose peak rates are known (``loka.kernels.roofline.PEAKS``), do not time an
    FP8 kernel that could not beat the measured baseline by ``min_speedup`` even at those
    peaks (the kernel's ``not_timed`` says so)"""
    autotune_configs: Optional[int] = 4
    """while timing, LoKA's Triton kernels try at most this many autotuning configs per new
    shape (the largest tiles that fit it; the choice is kept for the process); None: all"""
    cold_cache: bool = False
    """on CUDA, time every kernel (the baseline too) with the L2 cache evicted before each
    call (``loka.timing.time_fn(flush_l2=True)``): operands come from memory, as in a step
    where other work ran between their producer and the GEMM; False: the operands stay in
    L2 between calls, which favours memory-bound quantization passes"""
    precompile_workers: Optional[int] = None
    """child processes that compile the timing pass's compiled calls while the errors are
    sampled (:mod:`loka.probe.precompile`; the report's ``meta['precompile']`` says what
    they did); None: half the CPU cores, at most 8, on CUDA, and none on the CPU; 0: none"""
    tune_ahead: bool = True
    """while the precompile children (on CUDA by default) are still compiling after the
    errors are sampled, LoKA's Triton kernels autotune at the shapes they will be timed at (their
    configs chosen then; every timing still starts after the children are done); False:
    they autotune when first timed"""
    autotune_from: Optional[str] = None
    """a Probe report of an earlier run (best: on the same GPU type) whose Triton
    autotuning choices (``meta['autotuned']``) are loaded before timing: shapes it tuned
    are not tuned again (``meta['autotune_seeded']`` says how many were loaded)"""

    def __post_init__(self) -> None:
        if self.every_n_steps < 1:
            raise ValueError("ProbeConfig.every_n_steps must be >= 1")
        if self.num_samples < 2 or self.naive_samples < 2:
            raise ValueError("ProbeConfig.num_samples and naive_samples must be >= 2 "
                             "(a CI needs two samples)")
        if self.source not in ("learned", "captured"):
            raise ValueError("ProbeConfig.source must be 'learned' or 'captured'")
        if not 0.0 <= self.weight_ema < 1.0:
            raise ValueError("ProbeConfig.weight_ema must be in [0, 1)")
        if self.timing_compile not in ("auto", "on", "off"):
            raise ValueError("ProbeConfig.timing_compile must be 'auto', 'on' or 'off'")
        if self.weight_source not in ("model", "mean"):
            raise ValueError("ProbeConfig.weight_source must be 'model' or 'mean'")
        if self.timing_budget_ms is not None and self.timing_budget_ms <= 0:
            raise ValueError("ProbeConfig.timing_budget_ms must be positive or None")
        if self.bootstrap < 0 or self.timing_warmup < 0 or self.timing_iters < 1:
            raise ValueError("ProbeConfig needs bootstrap >= 0, timing_warmup >= 0, timing_iters >= 1")
        if self.max_full_cov_dim < 1 or self.block_size < 1 or self.max_rows_per_update < 1:
            raise ValueError("ProbeConfig.max_full_cov_dim, block_size and max_rows_per_update "
                             "must be >= 1")
        if self.sample_rows is not None and self.sample_rows < 1:
            raise ValueError("ProbeConfig.sample_rows must be >= 1 or None")
        if self.timing_rows is not None and self.timing_rows < 1:
            raise ValueError("ProbeConfig.timing_rows must be >= 1 or None")
        if isinstance(self.head_sites, bool) or not isinstance(self.head_sites, int) \
                or self.head_sites < 0:
            raise ValueError(f"ProbeConfig.head_sites must be an integer >= 0, "
                             f"got {self.head_sites!r}")
        if self.precompile_workers is not None and self.precompile_workers < 0:
            raise ValueError("ProbeConfig.precompile_workers must be >= 0 or None")
        if self.autotune_configs is not None and self.autotune_configs < 1:
            raise ValueError("ProbeConfig.autotune_configs must be >= 1 or None")
        object.__setattr__(self, "roles", tuple(Role.parse(r) for r in self.roles))


@dataclass(frozen=True)
class DispatchConfig:
    """How a plan is chosen from a report (the arguments of ``loka.plan``)."""

    max_error: float = 0.2
    """global budget on the error metric's upper confidence bound"""
    min_speedup: float = 1.05
    """a kernel must beat the bf16 baseline by this factor to be chosen"""
    metric: str = "mere"
    """error metric the budget applies to: 'mere', 'relfro' or 'neg_sqnr' (-SQNR dB)"""
    role_budgets: Mapping[str, float] = field(default_factory=dict)
    """per-role budget overriding ``max_error``, e.g. {'wgrad': 0.1}"""
    site_budgets: Mapping[str, float] = field(default_factory=dict)
    """per-site budget by regular expression on the site name, overriding both"""
    baseline: str = "bf16"
    """kernel used where no FP8 kernel qualifies"""
    head_sites: int = 3
    """the sites nearest the loss, this many, stay on the baseline in every role: the last
    to run in the Probe's forward order (``SiteReport.order``). In a paired NE check of
    Wukong ``paper`` from a trained checkpoint, the top MLP's three Linears held 6 of the
    9 costliest FP8 site-roles (bench/BENCHMARKS.md, "NE budget"). 0 keeps none back."""

    def __post_init__(self) -> None:
        if self.metric not in ("mere", "relfro", "neg_sqnr"):
            raise ValueError(f"unknown metric {self.metric!r}")
        if isinstance(self.head_sites, bool) or not isinstance(self.head_sites, int) \
                or self.head_sites < 0:
            raise ValueError(f"head_sites must be an integer >= 0, got {self.head_sites!r}")
        if self.min_speedup <= 0:
            raise ValueError("min_speedup must be positive")
        for r in self.role_budgets:
            Role.parse(r)


@dataclass(frozen=True)
class ModsConfig:
    """Model adaptations ("Mods") that make a model FP8-friendly and cheaper."""

    no_bias: bool = False
    """drop the bias of every Linear except the final (logit) layer"""
    blocknorm: Optional[int] = None
    """replace LayerNorm/SwishNorm with parameter-free BlockNorm of this block size (e.g. 256)"""
    hardswish: bool = False
    """replace Swish/SiLU (and the Swish of SwishNorm) with Hard Swish"""
    fuse_norm_quant: bool = False
    """norm -> activation -> FP8 quantization in one kernel wherever they feed a
    ``loka.Linear`` that takes an FP8 input (``linear(y, x_q=q)``, no second quantization
    pass): in the reference models' MLPs and at Wukong's FM and top MLP inputs. Not a
    module swap (the same function); another model puts
    ``loka.mods.fused.FusedNormActQuant`` in front of its Linear. It pays in eager
    execution (Wukong serving with CUDA graphs: 1.20x on an H200); under ``torch.compile``
    Inductor fuses the unfused composition itself, and the switch measured 1.00x there
    (docs/mods.md)"""
    pad_to: Optional[int] = None
    """pad Linear feature dims to a multiple of this (16 for FP8 GEMMs); None: no padding"""
    merge_siblings: bool = False
    """merge sibling Linears that read the same input into one GEMM"""
    token_major: bool = False
    """compute Linears over the token axis (Wukong's FM projection, LCB and residual) as
    ``W @ X`` on the (B, n, d) layout the layer holds, instead of a Linear on ``Xᵀ``: no
    transposed copy of X goes into the GEMM, and the norm that follows reads contiguous
    rows. The same function (up to the GEMMs' summation order); a Linear a plan or a Mod
    has swapped (``loka.Linear``, padding) keeps the transposed path. The Probe does not see
    these Linears (they are not called as modules), so a plan it makes keeps them in bf16"""

    def __post_init__(self) -> None:
        if self.blocknorm is not None and self.blocknorm < 1:
            raise ValueError("ModsConfig.blocknorm must be a positive block size or None")
        if self.pad_to is not None and self.pad_to < 1:
            raise ValueError("ModsConfig.pad_to must be positive or None")

    @classmethod
    def paper(cls) -> "ModsConfig":
        """The paper's Mods: No Bias, BlockNorm(256), Hard Swish."""
        return cls(no_bias=True, blocknorm=256, hardswish=True)

    @property
    def any(self) -> bool:
        return any(
            (self.no_bias, self.blocknorm is not None, self.hardswish,
             self.fuse_norm_quant, self.pad_to is not None, self.merge_siblings,
             self.token_major)
        )


def config_to_dict(cfg: Any) -> dict:
    """A JSON-ready dict of a config dataclass (enums as their values)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, enum.Enum):
            v = v.value
        elif isinstance(v, tuple):
            v = [x.value if isinstance(x, enum.Enum) else x for x in v]
        elif isinstance(v, Mapping):
            v = dict(v)
        out[f.name] = v
    return out
