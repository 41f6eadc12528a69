"""The one registry of GEMM kernels.

A kernel computes ``a (M, K) @ b (K, N)`` and does its own quantization: the Probe
enumerates kernels, the Dispatch picks one per site and role, ``loka.Linear`` calls it.
Adding a kernel library means adding one module that calls :func:`register`.

Operands may arrive already quantized (a :class:`~loka.numerics.QTensor`, e.g. from a
fused norm→quantize producer or a weight quantized once); a kernel whose ``quantize_a``
/ ``quantize_b`` produced it uses it as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Optional, Tuple, Union

import torch

from ..config import ROLES, Role, ValueEnum
from ..numerics import QTensor
from . import capabilities as caps
from .recipes import check_gemm_operands

Operand = Union[torch.Tensor, QTensor]
GemmFn = Callable[[Operand, Operand, torch.dtype], torch.Tensor]


class Scaling(ValueEnum):
    """How a kernel scales its FP8 operands (``NONE``: a high-precision kernel).

    The values are :class:`~loka.numerics.Granularity`'s, so a kernel's scaling converts
    to one with ``as_granularity(kernel.scaling)`` and compares equal to its name."""

    NONE = "none"
    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    BLOCKWISE = "blockwise"
    MX = "mx"


class Library(ValueEnum):
    """Who implements a kernel. ``CUSTOM``: a kernel registered from outside LoKA."""

    TORCH = "torch"
    EMULATED = "emulated"
    CUBLAS = "cublas"
    TRITON = "triton"
    TORCHAO = "torchao"
    FBGEMM = "fbgemm"
    CUSTOM = "custom"


@dataclass(frozen=True)
class Capability:
    """A predicate's answer: ``ok`` or the reason it is not."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


YES = Capability(True)


@dataclass(frozen=True)
class Kernel:
    """One registered GEMM kernel."""

    name: str
    """unique name, e.g. 'bf16', 'emulated-rowwise-e4m3', 'cublas-rowwise'"""
    fn: GemmFn
    """``fn(a, b, out_dtype) -> (M, N)``; quantizes its own operands"""
    library: Library
    """who implements it (a :class:`Library` or its name)"""
    formats: Tuple[str, str] = ("bf16", "bf16")
    """number formats of operand a and operand b"""
    scaling: Scaling = Scaling.NONE
    """how it scales FP8 operands (a :class:`Scaling` or its name; ``NONE``: not FP8)"""
    roles: FrozenSet[Role] = frozenset(ROLES)
    """roles this kernel may serve"""
    devices: Tuple[str, ...] = ("cpu", "cuda")
    """device types it runs on"""
    min_capability: Optional[Tuple[int, int]] = None
    """minimum CUDA compute capability (None: any, or not CUDA)"""
    max_capability: Optional[Tuple[int, int]] = None
    """maximum CUDA compute capability (exclusive upper bound, for arch-specific kernels)"""
    vendor: str = "any"
    """'nvidia', 'amd' or 'any': which GPU vendor's hardware the format targets"""
    align: int = 1
    """K and N must be multiples of this (M is free); see ``pads``"""
    pads: bool = False
    """pads misaligned K/N internally instead of refusing them"""
    requires: Optional[Callable[[torch.device], Capability]] = None
    """extra device-level check (library present, torch build supports the recipe)"""
    quantize_a: Optional[Callable[[torch.Tensor], QTensor]] = None
    """quantizes an a operand the way ``fn`` would (for producers that quantize ahead)"""
    quantize_b: Optional[Callable[[torch.Tensor], QTensor]] = None
    """quantizes a b operand the way ``fn`` would (weights quantized once)"""
    quantize_dual: Optional[Callable[[torch.Tensor], Tuple[QTensor, QTensor]]] = None
    """rowwise kernels with a two-layout quantizer: ``t (R, C) -> (quantize_a(t),
    quantize_a(tᵀ))`` in one call, the same bits as the two (the layouts a Linear's kernels
    need of its input and of its output gradient); None: make the two calls"""
    emulates: Optional[str] = None
    """for an emulated kernel: the name of the real kernel whose numerics it reproduces"""
    fast_accum: bool = False
    """uses reduced-precision (fast) tensor-core accumulation"""
    quantizes_as: Optional[str] = None
    """the name of a kernel whose quantization of both operands is this one's, the same
    PyTorch code (only the GEMM differs, e.g. in fast accumulation): the Probe derives this
    kernel's compiled call from that one's and the two GEMMs, without a compile of its own"""
    same_bits_as: Optional[str] = None
    """the name of a kernel whose output this one's equals bit for bit on every operand
    (quantizers bit-exact with that kernel's, the same GEMM call): where the Probe measures
    both it samples that kernel's errors once (``ProbeConfig.twin_errors``)"""
    static_gemm: Optional[Callable[..., torch.Tensor]] = None
    """the serving forward with a static input scale, ``(x2d (M, K), w (K, N) FP8 as
    ``quantize_b`` made it, x_table, w_scale, out_dtype) -> y (M, N)``: the cast of x by
    its scale table (a ``loka.Linear``'s ``_xs_table``) and the GEMM, the same bits as
    ``fn`` on ``quantize(x, scale=...)``, in as little Python as possible (what compiled
    code guards per call). None: ``loka.Linear`` takes its general path"""
    description: str = ""

    def __post_init__(self) -> None:
        for name, kind in (("library", Library), ("scaling", Scaling)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                raise ValueError(f"kernel {self.name!r}: unknown {name} {value!r}; expected one "
                                 f"of {[v.value for v in kind]}") from None

    @property
    def is_fp8(self) -> bool:
        return self.scaling is not Scaling.NONE

    @property
    def is_emulated(self) -> bool:
        return self.library is Library.EMULATED

    def padded_tokens(self, tokens: int) -> int:
        """The token count (rows of x and dy) as this kernel's weight-gradient GEMM sees it:
        ``loka.Linear`` pads that reduction to a multiple of :attr:`align` with zero rows,
        and the Probe and the planner judge the kernel at the padded count too."""
        return -(-max(int(tokens), 1) // self.align) * self.align

    def device_ok(self, device: "torch.device | str") -> Capability:
        """Can this kernel run on ``device`` at all (any shape)?"""
        device = torch.device(device)
        if device.type not in self.devices:
            return Capability(False, f"runs on {'/'.join(self.devices)}, not {device.type}")
        if self.vendor == "amd" and device.type == "cuda" and not caps.is_rocm():
            return Capability(False, "AMD-only format (fnuz); this is an NVIDIA GPU")
        if self.vendor == "nvidia" and caps.is_rocm():
            return Capability(False, "NVIDIA-only kernel; this is a ROCm GPU")
        cc = caps.cuda_capability(device)
        if self.min_capability is not None and device.type == "cuda":
            if cc is None or cc < self.min_capability:
                need = ".".join(map(str, self.min_capability))
                return Capability(False, f"needs compute capability >= {need}, have {cc}")
        if self.max_capability is not None and cc is not None and cc >= self.max_capability:
            return Capability(False, f"built for compute capability < {self.max_capability}")
        if self.requires is not None:
            return self.requires(device)
        return YES

    def supports(self, device: "torch.device | str", m: int, k: int, n: int,
                 role: "Role | str | None" = None) -> Capability:
        """Can this kernel run ``(M, K) @ (K, N)`` on ``device`` (for ``role``)?"""
        if role is not None and Role.parse(role) not in self.roles:
            return Capability(False, f"does not serve role {Role.parse(role)}")
        ok = self.device_ok(device)
        return self.fits(m, k, n) if ok else ok

    def fits(self, m: int, k: int, n: int, role: "Role | str | None" = None) -> Capability:
        """Does ``(M, K) @ (K, N)`` (for ``role``) meet this kernel's shape rules, whatever
        the device? (:meth:`supports` is this and the device.)"""
        if role is not None and Role.parse(role) not in self.roles:
            return Capability(False, f"does not serve role {Role.parse(role)}")
        if min(m, k, n) <= 0:
            return Capability(False, f"empty GEMM {m}x{k}x{n}")
        if not self.pads and (k % self.align or n % self.align):
            return Capability(False, f"K={k} and N={n} must be multiples of {self.align}")
        return YES

    def __call__(self, a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
        """``a (M, K) @ b (K, N)`` in ``out_dtype``. An empty GEMM (M, K or N zero) is
        answered here, for every kernel: (M, N) zeros, the empty sum when K = 0; libraries
        and quantizers need not handle it."""
        if a.shape[0] == 0 or a.shape[1] == 0 or b.shape[1] == 0:
            check_gemm_operands(a, b, out_dtype)
            return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
        return self.fn(a, b, out_dtype)


_REGISTRY: Dict[str, Kernel] = {}
_LOADERS: List[Callable[[], None]] = []
"""registrations deferred until a kernel is first looked up (optional libraries whose
import is slow or loads torch.compile's machinery: ``import loka`` should not pay it)"""


def add_loader(load: Callable[[], None]) -> None:
    """Run ``load`` (which registers kernels) before the registry is next read."""
    _LOADERS.append(load)


def _load() -> None:
    while _LOADERS:
        _LOADERS.pop(0)()


def register(kernel: Kernel, *, override: bool = False) -> Kernel:
    """Add a kernel; re-registering a name is an error unless ``override``."""
    if kernel.name in _REGISTRY and not override:
        raise ValueError(f"kernel {kernel.name!r} is already registered")
    _REGISTRY[kernel.name] = kernel
    return kernel


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def get(name: str) -> Kernel:
    """The kernel registered under ``name`` (KeyError listing the known names)."""
    if name not in _REGISTRY:
        _load()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"no kernel named {name!r}; registered: {sorted(_REGISTRY)}") from None


NOT_REGISTERED = "not registered in this installation"
""":func:`why_not_runnable`'s answer for a name no kernel has"""


def why_not_runnable(name: str, device: "torch.device | str") -> Optional[str]:
    """Why the kernel ``name`` cannot run on ``device`` at all (:data:`NOT_REGISTERED`, or
    its :meth:`Kernel.device_ok` reason); None where it can. One answer for every part that
    is handed kernel names: the Probe's configured kernels and the plan's."""
    try:
        ok = get(name).device_ok(device)
    except KeyError:
        return NOT_REGISTERED
    return None if ok else ok.reason


def all_kernels() -> List[Kernel]:
    _load()
    return list(_REGISTRY.values())


PROBE_DEFAULT = ("bf16", "cublas-rowwise", "cublas-rowwise-fastacc", "cublas-tensorwise",
                 "cublas-tensorwise-fastacc", "triton-rowwise-cublas-fastacc",
                 "triton-tensorwise-cublas-fastacc")
"""the kernels a Probe measures on a GPU by default (``ProbeConfig.kernels`` None): the two
quantization families Inductor fuses into producers (cuBLAS rowwise and tensorwise, their
fast-accumulation twins derived from them, not compiled again) and the two whose
quantization is LoKA's own Triton kernels. The rest (torchao's, which quantize as cuBLAS's
do; blockwise; LoKA's own Triton GEMMs; e5m2; FBGEMM) came out slower in the plans of the
evaluation set and cost the Probe most of its time (``ProbeConfig.all_kernels`` measures
them)"""


def available(device: "torch.device | str" = "cpu", shape: Optional[Tuple[int, int, int]] = None,
              role: "Role | str | None" = None, fp8_only: bool = False,
              names: Optional[Iterable[str]] = None) -> List[Kernel]:
    """Registered kernels that can run on ``device`` (and ``shape`` (M, K, N), ``role``)."""
    wanted = set(names) if names is not None else None
    out = []
    for kern in all_kernels():
        if wanted is not None and kern.name not in wanted:
            continue
        if fp8_only and not kern.is_fp8:
            continue
        ok = kern.supports(device, *shape, role=role) if shape else kern.device_ok(device)
        if ok and (role is None or Role.parse(role) in kern.roles):
            out.append(kern)
    return out


SCALED_MM_LIBRARIES = (Library.CUBLAS, Library.TORCHAO)
"""libraries whose FP8 kernels call ``torch._scaled_mm`` (torchao's Float8 GEMM does too)"""


def slow_cpu_kernels(kernels: Iterable[Kernel]) -> Tuple[List[str], Optional[float]]:
    """The names of ``kernels`` (registered kernels, on the CPU) that call torch's CPU
    ``_scaled_mm`` (libraries cuBLAS and torchao), and its slowdown against a float32
    matmul, where that is at least :data:`~loka.kernels.capabilities.SLOW_CPU_FP8` on this
    host; ``([], None)`` otherwise (none of them, or a fast ``_scaled_mm``; the slowdown is
    only measured where one of them is there)."""
    names = [k.name for k in kernels if k.library in SCALED_MM_LIBRARIES]
    if not names:
        return [], None
    slow = caps.cpu_scaled_mm_slowdown()
    if slow is None or slow < caps.SLOW_CPU_FP8:
        return [], None
    return names, slow


def unavailable(device: "torch.device | str" = "cpu") -> Dict[str, str]:
    """name -> reason, for every registered kernel that cannot run on ``device``."""
    return {k.name: k.device_ok(device).reason for k in all_kernels() if not k.device_ok(device)}
