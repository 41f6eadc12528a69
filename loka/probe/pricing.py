"""What a compiled step pays for an FP8 kernel at one site-role: the step-aware price.

The Probe times each FP8 kernel twice at a site-role's shape: the whole call
(``time_us``: both operands quantized by passes of their own, as the kernel runs alone)
and the GEMM alone with both operands quantized beforehand (``time_us_gemm``). The
difference is what the quantizations cost as separate passes; the forward's timing with
the weight quantized beforehand (``time_us_weight_q``) splits it between the two
operands, other roles split it by operand size (both passes are memory-bound reads of
the same dtype).

In a compiled step, an operand that Inductor's own code produces (``pointwise`` in
:mod:`loka.probe.producers`) does not take a pass of its own when the kernel's
quantization is PyTorch that Inductor compiles (the Probe timed the kernel under
``torch.compile``): its amax, scale and cast fuse into the producing kernel, which then
also writes the FP8 copy. That fused cost is priced as the share of the separate passes'
memory traffic that remains (per element, bf16 operands):

* rowwise (and blockwise): the separate pass reads 2 bytes and writes 1; fused, the
  producer writes 1 more: ``1/3`` of the pass;
* tensorwise: separately, one pass reads 2 bytes for the global amax and a second reads
  2 and writes 1; fused, the amax rides in the producer and only the cast pass remains
  (reads 2, writes 1): ``3/5``.

Rowwise scales of the weight gradient's operands run along the token dimension (a
column amax of x and dy), which a row-at-a-time producer cannot finish: those keep their
pass. Weights keep theirs too (they come from the optimizer, not from the step's ops).

A norm over blocks of the row (``blocked``) takes a tensorwise quantization but not a
rowwise or blockwise one: a tensor's amax is a reduction over every block, which the
norm's kernel carries beside its block statistics, and the cast kernel recomputes the
norm from its input (x read twice, no high-precision copy written); a row's amax reduces
over a range the norm's blocks do not match, so Inductor writes the statistics, reduces
the row in kernels of its own and casts, reading x three times (the CUDA code of
``bench/blockwise_fusion.py``'s regions, and its H100 timings:
``bench/results/2026-12-05-h100-blockwise-fusion/``). ``blocked`` is therefore fusible for
tensorwise kernels (priced like ``pointwise``) and a pass of its own for the others. That
holds for 256-feature blocks (the evaluation set's); over 128-feature blocks Inductor
reduces the row's amax from per-block partials in the norm's kernel, and the rowwise
price is a pass too many (``tests/test_stepcode.py`` checks both in generated code).
Operands of other kinds (a GEMM's output, an embedding, the model's input) pay the pass
as timed.

Serving (:func:`serve_time_us`) quantizes the weight once, when the plan is applied: the
forward timed that way (``time_us_weight_q``) less the GEMM alone is x's quantization,
priced by x's producer as above, except that a fused tensorwise quantization keeps
``1/5`` of its pass (:data:`SERVE_FUSED_SHARE`): a serving forward keeps no
high-precision copy of x for a backward, so the cast kernel that recomputes the producer
(reads 2 bytes, writes 1) replaces the producer's own bf16 write (2 bytes), one byte left of
the separate passes' five. Where other ops read x too (the report's
``producers['x_users']`` is 'shared': a residual, another Linear), that bf16 copy is
written anyway and the training share applies. The four Wukong-shaped regions of
``bench/blockwise_fusion.py`` (a block norm, perhaps a Hard Swish, then the GEMM; H100)
kept 0.13-0.6 of it, 0.32 on average, against a timed separate pass.

Static input scales (:func:`serve_static_time_us`; ``loka.plan(..., inference=True,
static_scales=True)``): a serving forward whose activation scale is fixed beforehand (the
Probe's observed input amax) needs no amax pass, only a cast. Where x's producer is code
Inductor makes (any fusible kind, ``blocked`` and ``assembled`` included: a cast is
elementwise, and a concatenation or gather that Inductor generates writes it as it
assembles x; ``bench/step_code.py`` shows it for the DLRM's interaction output and the
DCNv2's input concatenation: no kernel and no byte more than bf16's; and the copy a
Linear makes of a strided x, ``producers['x_layout']`` 'copied', such as the
evaluation-set Wukong's projections of a transposed x, which bf16 writes too: that
copy is written in FP8 instead, whoever else reads x, so nothing is left of the pass) the cast
writes the FP8 copy in the producer's kernel instead of its bf16 one, and nothing is left
of the separate passes when x has no other reader (a shared x is written in bf16 all the
same: its FP8 copy is one byte more, :data:`STATIC_SHARED_SHARE` of the passes); elsewhere
the cast is a pass of its own, reading 2 bytes and writing 1 (:data:`STATIC_PASS_SHARE`).

These shares are a model from byte counts, not a measurement: the evaluation harness
records the prediction beside every measured step so that the gap is known.
"""

from __future__ import annotations

from typing import Mapping, Optional, Tuple

from ..config import Role
from ..kernels.registry import Kernel, Scaling
from .producers import FUSIBLE, STATIC_FUSIBLE
from .report import KernelResult

__all__ = ["FUSED_SHARE", "SERVE_FUSED_SHARE", "FUSIBLE_BY_SCALING", "OPERAND_SOURCES",
           "STATIC_SHARED_SHARE", "STATIC_PASS_SHARE", "can_fuse", "split_quantization",
           "step_time_us", "serve_time_us", "serve_static_time_us", "static_cast_fuses",
           "splits_gemm", "price"]

FUSED_SHARE = {Scaling.ROWWISE: 1 / 3, Scaling.BLOCKWISE: 1 / 3, Scaling.TENSORWISE: 3 / 5}
"""share of a separate quantization pass's traffic left when it fuses into its producer"""

SERVE_FUSED_SHARE = {**FUSED_SHARE, Scaling.TENSORWISE: 1 / 5}
"""the same in a serving forward, where no high-precision copy of x is kept (module
docstring)"""

FUSIBLE_BY_SCALING = {Scaling.TENSORWISE: FUSIBLE + ("blocked",)}
"""producer kinds whose quantization fuses, by the kernel's scaling where they differ
from :data:`~loka.probe.producers.FUSIBLE` (module docstring)"""

STATIC_SHARED_SHARE = {Scaling.TENSORWISE: 1 / 5, Scaling.ROWWISE: 1 / 3,
                       Scaling.BLOCKWISE: 1 / 3}
"""a static cast fused into the producer of a shared x: one byte written per element, of
the separate passes' five (tensorwise: amax read, cast read and write) or three (rowwise,
blockwise: one pass that reads and writes)"""
STATIC_PASS_SHARE = {Scaling.TENSORWISE: 3 / 5, Scaling.ROWWISE: 1.0, Scaling.BLOCKWISE: 1.0}
"""a static cast as a pass of its own (reads 2 bytes, writes 1), of the separate passes"""

OPERAND_SOURCES = {Role.FWD: ("x", "weight"), Role.DGRAD: ("dy", "weight"),
                   Role.WGRAD: ("dy", "x")}
"""where each role's a and b operands come from (fwd: x @ Wᵀ; dgrad: dy @ W; wgrad:
dyᵀ @ x)"""


def split_quantization(role: Role, shape: Tuple[int, int, int], time_us: float,
                       time_us_gemm: float, time_us_weight_q: Optional[float] = None
                       ) -> Tuple[float, float]:
    """(a's, b's) quantization time in microseconds: ``time_us - time_us_gemm``, split by
    the forward's weight-quantized timing where there is one, else by operand size."""
    quant = max(time_us - time_us_gemm, 0.0)
    if role is Role.FWD and time_us_weight_q is not None:
        qb = min(max(time_us - time_us_weight_q, 0.0), quant)
        return quant - qb, qb
    m, k, n = shape
    a, b = m * k, k * n
    qa = quant * a / (a + b) if a + b else 0.0
    return qa, quant - qa


def _fused_share(kernel: Kernel, role: Role, source: str, serve: bool = False) -> float:
    if source == "weight":
        return 1.0
    if role is Role.WGRAD and kernel.scaling is not Scaling.TENSORWISE:
        return 1.0  # column amaxes: the producer cannot finish them
    return (SERVE_FUSED_SHARE if serve else FUSED_SHARE).get(kernel.scaling, 1.0)


def _fuses(kernel: Kernel, role: Role, source: str, producers: Mapping[str, str],
           compiled: bool) -> bool:
    """Whether the quantization of the operand from ``source`` fuses into its producer."""
    return (compiled and producers.get(source) in FUSIBLE_BY_SCALING.get(kernel.scaling, FUSIBLE)
            and _fused_share(kernel, role, source) < 1.0)


def can_fuse(kernel: Kernel, role: Role, producers: Mapping[str, str], compiled: bool
             ) -> bool:
    """Whether any operand's quantization at this site-role would fuse into its producer
    in a compiled step (else the step pays the timed call, and the Probe need not split
    it)."""
    return any(_fuses(kernel, role, source, producers, compiled)
               for source in OPERAND_SOURCES[role])


def step_time_us(kernel: Kernel, role: Role, shape: Tuple[int, int, int], *,
                 time_us: Optional[float], time_us_gemm: Optional[float],
                 time_us_weight_q: Optional[float] = None,
                 producers: Mapping[str, str] = {}, compiled: bool = False
                 ) -> Optional[float]:
    """The step-aware time of ``kernel`` at one site-role (module docstring): the timed
    call less what fusing each operand's quantization into its producer saves (never more
    than the timed call; equal to it where nothing fuses), or None when the timings needed
    are missing.

    Args:
        kernel: the FP8 kernel.
        role, shape: the role and its GEMM's (M, K, N).
        time_us, time_us_gemm, time_us_weight_q: the Probe's timings (see
            :class:`~loka.probe.report.KernelResult`).
        producers: the site's operand producers ('x', 'dy' -> kind).
        compiled: the kernel was timed under ``torch.compile`` (its quantization is code
            Inductor can fuse into a producer).
    """
    if time_us is None or time_us_gemm is None:
        return None
    qa, qb = split_quantization(role, shape, time_us, time_us_gemm, time_us_weight_q)
    total = time_us
    for q, source in zip((qa, qb), OPERAND_SOURCES[role]):
        if _fuses(kernel, role, source, producers, compiled):
            total -= q * (1.0 - _fused_share(kernel, role, source))
    return total


def serve_time_us(kernel: Kernel, *, time_us_weight_q: Optional[float],
                  time_us_gemm: Optional[float], producers: Mapping[str, str] = {},
                  compiled: bool = False) -> Optional[float]:
    """What a compiled serving forward pays for ``kernel`` at one site (module docstring):
    the forward timed with its weight quantized beforehand, less what fusing x's
    quantization into its producer saves; None where x's quantization does not fuse (the
    step pays ``time_us_weight_q``) or a timing is missing."""
    if (time_us_weight_q is None or time_us_gemm is None
            or not _fuses(kernel, Role.FWD, "x", producers, compiled)):
        return None
    qa = max(time_us_weight_q - time_us_gemm, 0.0)
    # a shared x is written in bf16 for its other readers: the cast replaces no write
    alone = producers.get("x_users") != "shared"
    return time_us_weight_q - qa * (1.0 - _fused_share(kernel, Role.FWD, "x", serve=alone))


def static_cast_fuses(producers: Mapping[str, str]) -> bool:
    """Whether a static cast of x (elementwise: no amax) fuses into x's producer, for a
    kernel whose quantizer Inductor compiles: any producer that is Inductor's code,
    ``blocked`` and ``assembled`` included, or the copy the Linear makes of a strided x
    (``x_layout`` 'copied'; module docstring)."""
    return producers.get("x") in STATIC_FUSIBLE or producers.get("x_layout") == "copied"


def splits_gemm(kernel: Kernel, role: Role, producers: Mapping[str, str],
                compiled: bool) -> bool:
    """Whether the Probe times ``kernel``'s GEMM alone at this site-role
    (``time_us_gemm``), which the step-aware prices need: some operand's quantization fuses
    into its producer (:func:`can_fuse`), or the role is a forward whose x takes a static
    cast in its producer (:func:`static_cast_fuses`; the static serving price)."""
    if not (compiled and kernel.is_fp8 and kernel.quantize_a is not None
            and kernel.quantize_b is not None):
        return False
    return (can_fuse(kernel, role, producers, compiled)
            or (role is Role.FWD and static_cast_fuses(producers)))


def serve_static_time_us(kernel: Kernel, *, time_us_weight_q: Optional[float],
                         time_us_gemm: Optional[float], producers: Mapping[str, str] = {},
                         compiled: bool = False) -> Optional[float]:
    """What a compiled serving forward pays for ``kernel`` at one site with a static input
    scale (module docstring): the GEMM alone plus what is left of x's quantization, a cast
    fused into its producer or a pass of its own; None where a timing is missing."""
    if time_us_weight_q is None or time_us_gemm is None:
        return None
    qa = max(time_us_weight_q - time_us_gemm, 0.0)
    fusible = compiled and static_cast_fuses(producers)
    if fusible:
        # a copy the step makes anyway (x_layout 'copied') is written in FP8 instead
        share = (STATIC_SHARED_SHARE.get(kernel.scaling, 1.0)
                 if producers.get("x_users") == "shared"
                 and producers.get("x_layout") != "copied" else 0.0)
    else:
        share = STATIC_PASS_SHARE.get(kernel.scaling, 1.0)
    return time_us_gemm + qa * share


def price(kr: KernelResult, kernel: Kernel, role: Role, shape: Tuple[int, int, int],
          producers: Mapping[str, str], baseline_us: Optional[float]) -> None:
    """Set ``kr``'s step-aware prices from its own timings: ``step_us`` and
    ``step_speedup`` where an operand's quantization fuses into its producer
    (:func:`can_fuse`), and for the forward ``serve_us`` and ``serve_speedup`` where x's
    does; None elsewhere. The Probe prices each kernel it times this way, and a report
    made earlier can be priced again with other producers (``bench/reprice.py``)."""
    compiled = kr.timing.endswith("+compiled")
    kr.step_us = (step_time_us(kernel, role, shape, time_us=kr.time_us,
                               time_us_gemm=kr.time_us_gemm,
                               time_us_weight_q=kr.time_us_weight_q, producers=producers,
                               compiled=compiled)
                  if can_fuse(kernel, role, producers, compiled) else None)
    kr.serve_us = (serve_time_us(kernel, time_us_weight_q=kr.time_us_weight_q,
                                 time_us_gemm=kr.time_us_gemm, producers=producers,
                                 compiled=compiled)
                   if role is Role.FWD else None)
    kr.step_speedup, kr.serve_speedup = (
        baseline_us / t if baseline_us is not None and t and t > 0 else None
        for t in (kr.step_us, kr.serve_us))
