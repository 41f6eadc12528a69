"""Shape Mods: pad Linear feature dims to GEMM-friendly multiples, and merge sibling
Linears that read the same input into one larger GEMM. Both keep the function unchanged.

Padding is hidden inside :class:`PaddedLinear`: callers still pass ``(..., in_features)``
and receive ``(..., out_features)``; inside, the input is zero-padded to ``in_padded``,
the inner ``nn.Linear`` (the GEMM that Probe and Dispatch see) runs at the aligned shape,
and the output is sliced back. The padded weight rows/columns start at zero and stay zero
under training: padded input columns are zero, so their weight gradients are zero; padded
output rows are sliced away, so theirs are zero too; Adam(W) turns a zero gradient from a
zero state into a zero update, and decoupled weight decay of zero is zero.

Sibling detection needs the dataflow, which only the model knows: a module that owns
siblings implements ``_loka_merge_siblings(when=None) -> list[ModuleChange]`` (see the
Wukong layer), which merges unless ``when(siblings)`` says no, and :func:`merge_siblings`
calls every such hook. :func:`merge_pays` makes a ``when`` that decides by timing the
siblings' GEMMs apart and merged (the Probe's timing: CUDA graphs on GPUs).
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..timing import time_fn
from ._swap import ModuleChange, describe, iter_modules
from .no_bias import FINAL_ATTR


def _round_up(x: int, multiple: int) -> int:
    return int(math.ceil(x / multiple)) * multiple


def _linear_like(weight: torch.Tensor, bias) -> nn.Linear:
    """An ``nn.Linear`` around the given tensors (built on meta: nothing allocated twice)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight)
    if bias is not None:
        lin.bias = nn.Parameter(bias)
    return lin


class PaddedLinear(nn.Module):
    """A Linear whose GEMM runs at padded (aligned) feature dims; same function.

    Args:
        linear: the ``nn.Linear`` to pad (its values are copied; ``_loka_final`` is kept).
        multiple: pad ``in_features`` and ``out_features`` up to multiples of this.

    Shapes:
        x: (..., in_features) -> (..., out_features); the inner ``self.linear`` is
        ``(in_padded -> out_padded)``.
    """

    def __init__(self, linear: nn.Linear, multiple: int) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"PaddedLinear wraps an nn.Linear, got {type(linear).__name__}")
        if multiple < 1:
            raise ValueError(f"pad multiple must be positive, got {multiple}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        in_p, out_p = _round_up(self.in_features, multiple), _round_up(self.out_features, multiple)
        w = linear.weight.detach()
        weight = F.pad(w, (0, in_p - self.in_features, 0, out_p - self.out_features))
        bias = None if linear.bias is None else F.pad(linear.bias.detach(),
                                                      (0, out_p - self.out_features))
        self.linear = _linear_like(weight, bias)
        if getattr(linear, FINAL_ATTR, False):
            setattr(self.linear, FINAL_ATTR, True)

    @property
    def in_padded(self) -> int:
        return self.linear.in_features

    @property
    def out_padded(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x (..., in_features). Returns: (..., out_features)."""
        if self.in_padded != self.in_features:
            x = F.pad(x, (0, self.in_padded - self.in_features))
        y = self.linear(x)
        return y if self.out_padded == self.out_features else y[..., : self.out_features]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"padded=({self.in_padded}, {self.out_padded})")


def pad_linears(model: nn.Module, multiple: int) -> List[ModuleChange]:
    """Wrap every ``nn.Linear`` with a feature dim that is not a multiple of ``multiple``
    in a :class:`PaddedLinear`, in place. Returns the changes."""
    if multiple < 1:
        raise ValueError(f"pad multiple must be positive, got {multiple}")
    changes = []
    for fqn, m in iter_modules(model):
        if type(m) is not nn.Linear or (m.in_features % multiple == 0
                                        and m.out_features % multiple == 0):
            continue
        if fqn == "":
            raise ValueError("cannot pad a bare nn.Linear in place; wrap it in a module")
        new = PaddedLinear(m, multiple)
        model.set_submodule(fqn, new)
        changes.append(ModuleChange(fqn, describe(m), describe(new)))
    return changes


class MergedLinear(nn.Module):
    """Sibling Linears that read the same input, run as one GEMM; the output is split.

    Args:
        linears: ``nn.Linear`` s with equal ``in_features``, all with or all without bias.

    Shapes:
        x: (..., in_features) -> tuple of (..., out_i), one per sibling, in order.
    """

    def __init__(self, linears: Sequence[nn.Linear]) -> None:
        super().__init__()
        linears = list(linears)
        if len(linears) < 2:
            raise ValueError("MergedLinear needs at least two Linears")
        if any(type(m) is not nn.Linear for m in linears):
            raise TypeError("MergedLinear merges plain nn.Linear modules "
                            "(merge siblings before padding or other swaps)")
        if len({m.in_features for m in linears}) != 1:
            raise ValueError(f"siblings read different widths: {[m.in_features for m in linears]}")
        if len({m.bias is None for m in linears}) != 1:
            raise ValueError("siblings must all have a bias or all have none")
        if any(getattr(m, FINAL_ATTR, False) for m in linears):
            raise ValueError("a final (logit) Linear cannot be merged")
        self.split_sizes: Tuple[int, ...] = tuple(m.out_features for m in linears)
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = None if linears[0].bias is None else torch.cat([m.bias.detach() for m in linears])
        self.linear = _linear_like(weight, bias)

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """Args: x (..., in_features). Returns: tuple of (..., out_i)."""
        return self.linear(x).split(self.split_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.linear.in_features}, split_sizes={self.split_sizes}"


def merge_siblings(model: nn.Module, when: Optional[Callable[[Sequence[nn.Linear]], bool]] = None
                   ) -> List[ModuleChange]:
    """Call every submodule's ``_loka_merge_siblings`` hook (idempotent); returns the
    changes with fully qualified names.

    Args:
        model: the model, changed in place.
        when: ``when(siblings) -> bool`` decides for each group of siblings (None: merge
            every group); e.g. :func:`merge_pays`.
    """
    changes = []
    for fqn, m in iter_modules(model):
        hook = getattr(m, "_loka_merge_siblings", None)
        if callable(hook):
            for c in hook(when):
                name = f"{fqn}.{c.fqn}" if fqn and c.fqn else (fqn or c.fqn)
                changes.append(ModuleChange(name, c.old, c.new))
    return changes


def _role_gemms(k: int, outs: Sequence[int], m: int, role: str, device, dtype):
    """(apart, merged): closures running the siblings' GEMMs of ``role`` one by one and as
    one GEMM, on random operands of the layouts ``nn.Linear`` uses."""
    g = torch.Generator(device=device).manual_seed(0)
    n = sum(outs)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=g)
    ws = list(w.split(list(outs)))
    x = torch.randn(m, k, device=device, dtype=dtype, generator=g)
    dy = torch.randn(m, n, device=device, dtype=dtype, generator=g)
    dys = [t.contiguous() for t in dy.split(list(outs), dim=1)]
    if role == "fwd":
        return (lambda: [torch.mm(x, wi.t()) for wi in ws]), (lambda: torch.mm(x, w.t()))
    if role == "dgrad":  # the input gradients of the siblings add up
        return ((lambda: sum(torch.mm(d, wi) for d, wi in zip(dys, ws))),
                (lambda: torch.mm(dy, w)))
    if role == "wgrad":
        return (lambda: [torch.mm(d.t(), x) for d in dys]), (lambda: torch.mm(dy.t(), x))
    raise ValueError(f"role must be 'fwd', 'dgrad' or 'wgrad', got {role!r}")


def observed_rows(model: nn.Module, run: Callable[[], object]) -> Dict[nn.Module, int]:
    """Rows M each ``nn.Linear`` of ``model`` sees in one call of ``run()`` (e.g. a
    forward on a real batch): ``{linear: rows}``, for :func:`merge_pays`'s ``tokens``."""
    rows: Dict[nn.Module, int] = {}

    def hook(mod, args):
        if args and isinstance(args[0], torch.Tensor):
            rows[mod] = max(rows.get(mod, 0), args[0].numel() // max(mod.in_features, 1))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return rows


def merge_pays(tokens: "int | Callable[[Sequence[nn.Linear]], int]", *,
               device: "torch.device | str | None" = None,
               dtype: torch.dtype = torch.bfloat16, min_speedup: float = 1.0,
               roles: Sequence[str] = ("fwd", "dgrad", "wgrad"),
               timer: Optional[Callable[[Callable[[], object]], float]] = None,
               record: Optional[List[Dict]] = None) -> Callable[[Sequence[nn.Linear]], bool]:
    """A ``when`` for :func:`merge_siblings` that merges only where it pays: the siblings'
    GEMMs of ``roles`` are timed apart and merged at ``tokens`` rows, and a group is merged
    when the merged GEMMs take at most ``1 / min_speedup`` of the time apart.

    Args:
        tokens: rows M of the siblings' input per step (e.g. batch x 256 for Wukong's n-axis
            Linears over (B, d, n)), or ``tokens(siblings) -> M`` (with
            :func:`observed_rows`: ``lambda sib: rows[sib[0]]``).
        device, dtype: where and in what precision to time (default: the siblings'
            device, bf16).
        min_speedup: the merged GEMMs must be this much faster.
        roles: the GEMM roles timed (training: all three; serving: ``("fwd",)``).
        timer: ``timer(fn) -> microseconds`` (default: :func:`loka.timing.time_fn`'s
            median: CUDA graphs on GPUs, wall clock on the CPU, where it says little).
        record: a list that receives one dict per decision (shapes, times, verdict).

    Returns:
        ``when(siblings) -> bool``.
    """
    if (not callable(tokens) and tokens < 1) or not (min_speedup > 0 and math.isfinite(min_speedup)):
        raise ValueError(f"merge_pays needs tokens >= 1 and a finite min_speedup > 0, "
                         f"got {tokens}, {min_speedup}")
    if not roles:
        raise ValueError("merge_pays needs at least one role to time")

    def when(siblings: Sequence[nn.Linear]) -> bool:
        dev = torch.device(device) if device is not None else siblings[0].weight.device
        time = timer or (lambda fn: time_fn(fn, dev, warmup=3, iters=20, budget_ms=50.0).median_us)
        k, outs = siblings[0].in_features, [m.out_features for m in siblings]
        m_rows = int(tokens(siblings)) if callable(tokens) else int(tokens)
        if m_rows < 1:
            raise ValueError(f"merge_pays: {m_rows} rows for siblings of width {k}")
        apart = merged = 0.0
        times = {}
        with torch.no_grad():
            for role in roles:
                run_apart, run_merged = _role_gemms(k, outs, m_rows, role, dev, dtype)
                t_apart, t_merged = float(time(run_apart)), float(time(run_merged))
                times[role] = {"apart_us": t_apart, "merged_us": t_merged}
                apart, merged = apart + t_apart, merged + t_merged
        verdict = merged * min_speedup <= apart
        if record is not None:
            record.append({"in_features": k, "out_features": outs, "tokens": m_rows,
                           "device": str(dev), "roles": times, "apart_us": apart,
                           "merged_us": merged, "merge": verdict})
        return verdict

    return when

