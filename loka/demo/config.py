"""What the demo trains, probes and compares: :class:`DemoConfig`, and the kernels it probes
where no list is given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

__all__ = ["DemoConfig", "CPU_KERNELS", "QUICK_KERNELS"]

CPU_KERNELS = ("bf16", "emulated-tensorwise-e4m3", "emulated-rowwise-e4m3",
               "emulated-blockwise-e4m3", "emulated-rowwise-e5m2", "cublas-tensorwise",
               "cublas-rowwise")
"""kernels probed on the CPU: one per recipe (the emulated twins of the GPU kernels and
torch's CPU ``_scaled_mm``), which keeps the CPU demo short"""
QUICK_KERNELS = ("bf16", "emulated-tensorwise-e4m3", "emulated-rowwise-e4m3", "cublas-rowwise")


@dataclass(frozen=True)
class DemoConfig:
    """What the demo trains, probes and compares."""

    model: str = "wukong"
    """reference model (loka.models)"""
    preset: str = "small"
    """model preset; ``--quick`` uses tiny"""
    batch_size: Optional[int] = None
    """examples per step (None: the preset's, 512 for small)"""
    probe_steps: int = 200
    """steps trained with the Probe attached, shared by both arms"""
    steps: int = 200
    """steps each arm trains after the branch"""
    eval_every: int = 0
    """evaluate both arms every this many steps; 0: eight times over the run"""
    eval_steps: int = 16
    """held-out batches per evaluation (the same batches for both arms)"""
    lr: float = 1e-3
    max_error: float = 0.2
    """the plan's budget on MERE's upper 95% bound"""
    min_speedup: float = 1.05
    """the plan's speed threshold (GPU only; the CPU plans on error alone)"""
    num_samples: int = 8
    """synthetic operand pairs per site and role"""
    sample_rows: int = 256
    """rows of each synthetic operand"""
    bootstrap: int = 200
    kernels: Optional[Tuple[str, ...]] = None
    """kernels to probe; None: :data:`CPU_KERNELS` on the CPU, every available one on a GPU"""
    seed: int = 0
    out: str = "loka-demo"
    progress: bool = True

    @classmethod
    def quick(cls, **overrides) -> "DemoConfig":
        """Tiny preset, few steps: a smoke run of every stage (CI)."""
        base = dict(preset="tiny", batch_size=256, probe_steps=30, steps=30,
                    eval_steps=4, lr=3e-3, num_samples=4, sample_rows=64, bootstrap=50,
                    kernels=QUICK_KERNELS)
        base.update(overrides)
        return cls(**base)

    def __post_init__(self) -> None:
        for name in ("probe_steps", "steps", "eval_steps", "num_samples", "sample_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"DemoConfig.{name} must be >= 1")
        if self.eval_every < 0 or self.max_error < 0 or self.min_speedup <= 0:
            raise ValueError("DemoConfig needs eval_every >= 0, max_error >= 0, min_speedup > 0")
