"""What one benchmark run measures: :class:`BenchConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from .variants import INFER_VARIANTS, TRAIN_VARIANTS, Variant

__all__ = ["BenchConfig", "PROBE_KERNELS"]

PROBE_KERNELS = ("bf16", "cublas-rowwise", "cublas-tensorwise", "cublas-rowwise-fastacc",
                 "triton-rowwise", "triton-rowwise-cublas", "triton-rowwise-cublas-fastacc",
                 "triton-tensorwise-cublas", "fbgemm-rowwise",
                 "emulated-rowwise-e4m3", "emulated-tensorwise-e4m3")
"""the Probe's default shortlist in the benchmark (kernels absent on a device are skipped)"""


def _variants(names) -> List[Variant]:
    return [v if isinstance(v, Variant) else Variant.parse(v) for v in names]


@dataclass
class BenchConfig:
    model: str = "wukong"
    """reference model name (loka.models)"""
    preset: str = "paper"
    """model preset: tiny (CPU smoke), small, paper (GPU)"""
    device: str = "cuda"
    batch_size: Optional[int] = None
    """None: the preset's default batch size"""
    steps: int = 30
    """timed steps per variant"""
    warmup: int = 5
    """untimed steps (compilation happens here)"""
    compile: bool = True
    """torch.compile the model (all variants alike)"""
    train_variants: List[Variant] = field(default_factory=lambda: _variants(TRAIN_VARIANTS))
    """training rows, in order (names are parsed into :class:`Variant` on construction)"""
    infer_variants: List[Variant] = field(default_factory=lambda: _variants(INFER_VARIANTS))
    """inference rows, in order (names are parsed likewise)"""
    max_error: float = 0.2
    min_speedup: float = 1.05
    probe_steps: int = 3
    probe_samples: int = 16
    probe_kernels: Optional[Tuple[str, ...]] = PROBE_KERNELS
    """kernels the LoKA variants' Probe measures (None: every available kernel, on a GPU too
    (``ProbeConfig.all_kernels``); the
    default is a shortlist of one kernel per library and scaling, which keeps the Probe
    short on the paper preset)"""
    plan: Optional[str] = None
    """a plan JSON to apply in the LoKA variants instead of probing (the plan of an
    earlier run: ``<out>.plan.json``)"""
    tune_trials: int = 10
    """whole-step timings a ``+tuned`` variant may spend (each one compiles the model)"""
    search_trials: int = 24
    """whole-step timings a ``+search`` variant may spend"""
    plans: Dict[str, str] = field(default_factory=dict)
    """named plan JSONs for the variants ``loka@<name>...`` (several plans side by side in
    one run); a ``+merge`` variant reads ``<stem>.merge.plan.json`` beside the file"""
    profile: Tuple[str, ...] = ()
    """variants whose timed step is also profiled (torch.profiler, CUDA only): GPU time
    per kernel class goes into the row's ``profile``; ``train:<variant>`` (or a bare name)
    names a training variant, ``infer:<variant>`` an inference one; a name that is not
    among the run's variants is refused"""
    profile_ops: bool = False
    """profiles also attribute GPU time to the operator and stack frame that launched it
    (``profile['by_op_us']``; meaningful for variants without CUDA graphs)"""
    table_rows: Optional[int] = 1000
    """cap on embedding-table rows, so that the optimizer update of huge tables does not
    drown the dense part the benchmark is about (None: the preset's tables)"""
    fused_embeddings: bool = True
    """stack all embedding tables into one (loka.models.fused_embedding) in every variant"""
    out: Optional[str] = None
    plot: bool = True
    seed: int = 0

    def __post_init__(self):
        self.train_variants = _variants(self.train_variants)
        self.infer_variants = _variants(self.infer_variants)

    def to_dict(self) -> dict:
        """The configuration as results record it (variants by name)."""
        d = dict(self.__dict__)
        d["train_variants"] = [v.name for v in self.train_variants]
        d["infer_variants"] = [v.name for v in self.infer_variants]
        return d

    def profiled(self, mode: str, variant: Variant) -> bool:
        """Whether ``--profile`` names this row (a bare name is a training variant)."""
        keys = {f"{mode}:{variant.name}"} | ({variant.name} if mode == "train" else set())
        return bool(keys & set(self.profile))

    def check_profile(self) -> None:
        """Every ``--profile`` entry names a variant of the run (a typo would profile nothing)."""
        known = {v.name for v in self.train_variants} | {
            f"train:{v.name}" for v in self.train_variants} | {
            f"infer:{v.name}" for v in self.infer_variants}
        unknown = [p for p in self.profile if p not in known]
        if unknown:
            raise ValueError(f"--profile names no variant of this run: {unknown} (training "
                             f"variants as train:<name> or <name>, inference ones as infer:<name>)")
