"""What Inductor generates for a compiled step on a CUDA GPU, read from its code.

Two parts:

- :func:`inventory` parses Inductor's CUDA wrapper code (the ``call`` function of an
  ``output_code`` module) into one :class:`Launch` per kernel: Inductor's Triton kernels,
  user Triton kernels (LoKA's), and library calls (``mm``, ``bmm``, ``addmm``,
  ``_scaled_mm``), each with the bytes it moves and, for GEMMs, its FLOPs: the sizes of
  the tensors passed, each capped, for Inductor's kernels, at the kernel's iteration size
  (a sliced input moves its slice only; the estimate Inductor itself uses for
  ``kernel_num_gb``, applied the same way to every kernel).
- :func:`cuda_step_code` compiles one training step (forward and backward) or one
  serving forward and returns that code. With the model on a CUDA device it is the real
  compilation. Without a GPU it traces on the CPU and lowers each graph again for a
  *simulated* Hopper device (``torch.cuda`` queries answered by :data:`H200`, Triton's
  driver replaced by one that names the target): the kernels, their fusion and their
  bytes are Inductor's choices for that GPU, nothing runs on it.

Why: a planned model's step pays for every pass its FP8 operands take (amax, casts,
transposes, recomputed producers), and the Probe's per-GEMM timings do not see them.
Counting them in the generated code shows where the step's bytes go before a GPU is
lent, and compares plans by what the compiler makes of them.

Limits: the CPU route answers device queries for one Hopper GPU (:data:`H200`) and uses
this machine's torch: a different torch release on the GPU machine may fuse differently.
It patches private parts of ``torch.cuda``, ``torch._inductor`` and Triton for the
duration of the call; kernels are never compiled to binaries.

Length: reading the code and generating it without a GPU share one launch model (what a
kernel is passed, what Inductor names it); apart, each half would restate the other's
conventions, and every caller uses both.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import re
import types
from collections import Counter
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import torch
from torch import nn

from .profiling import QUANTIZE_KERNELS

__all__ = ["Launch", "H200", "inventory", "summarize", "rates", "output_code",
           "cuda_step_code", "fake_cuda"]

H200 = types.SimpleNamespace(
    name="NVIDIA H200 (simulated)", major=9, minor=0, multi_processor_count=132,
    total_memory=141 * 2**30, warp_size=32, max_threads_per_multi_processor=2048,
    L2_cache_size=60 * 2**20, regs_per_multiprocessor=65536, regs_per_block=65536,
    shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472,
    shared_memory_per_block=49152, gcnArchName="", is_integrated=False,
    max_threads_per_block=1024, clock_rate=1980000, memory_clock_rate=2619000,
    memory_bus_width=6144, uuid="00000000-0000-0000-0000-000000000000")
"""The device properties the CPU route reports (an H200's, as torch reports them)"""

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1,
                "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
                "float8_e8m0fnu": 1, "complex64": 8, "complex128": 16, "int64": 8, "int32": 4,
                "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
                "bool": 1}
_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"}
_TUPLE = r"\(([^()]*)\)"


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a compiled graph.

    ``kind``: ``gemm_bf16`` (a library GEMM in high precision), ``gemm_fp8``
    (``_scaled_mm`` or a user Triton GEMM), ``quantize`` (LoKA's Triton quantizers),
    ``inductor`` (a kernel Inductor generated: norms, activations, fused casts) or
    ``other`` (any other user kernel)."""

    kind: str
    name: str
    bytes_read: float
    bytes_written: float
    flops: float = 0.0
    shapes: Tuple[Tuple[int, ...], ...] = ()
    programs: Optional[int] = None
    """an Inductor reduction's independent reductions (its ``xnumel``): 1 means one
    program reduces everything, on one multiprocessor, whatever its byte count"""

    @property
    def bytes(self) -> float:
        return self.bytes_read + self.bytes_written


def _ints(text: str) -> List[int]:
    return [int(v) for v in text.replace(" ", "").split(",") if v]


def _extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements a (shape, stride) view spans in its storage."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride))


def _split_args(text: str) -> List[str]:
    out, depth, cur = [], 0, []
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _gemm_flops(op: str, shapes: List[Optional[List[int]]]) -> float:
    """2·M·K·N (times the batch) from the operands' shapes by position; 0 when an operand
    was not resolved."""
    try:
        if op == "mm" or op == "_scaled_mm":
            (m, k), n = shapes[0], shapes[1][1]
            return 2.0 * m * k * n
        if op == "addmm":
            (m, k), n = shapes[1], shapes[2][1]
            return 2.0 * m * k * n
        if op in ("bmm", "baddbmm"):
            a, b = (shapes[0], shapes[1]) if op == "bmm" else (shapes[1], shapes[2])
            return 2.0 * a[0] * a[1] * a[2] * b[2]
    except (IndexError, ValueError, TypeError):  # TypeError: an unresolved operand (None)
        pass
    return 0.0


def inventory(code: str) -> List[Launch]:
    """The kernel launches of one Inductor CUDA wrapper module, in launch order.

    Raises ValueError for code that is not a CUDA wrapper (no ``call`` function)."""
    # the wrapper's call() follows every kernel's source (kernels carry benchmark harnesses
    # with call() functions of their own)
    calls = list(re.finditer(r"^\s*def call\(", code, re.M))
    if not calls:
        raise ValueError("not Inductor wrapper code: it has no call() function")
    start = calls[-1].start()
    params: Dict[str, List[str]] = {}
    for m in re.finditer(r"^def (\w+)\(([^)]*)\):", code, re.M):
        params[m.group(1)] = [a.split(":")[0].strip() for a in m.group(2).split(",")]
    # the wrapper's variable for a kernel -> the kernel's own name (what a profiler shows):
    # user kernels get a suffix (rowwise_quant_kernel_0 = async_compile.triton('rowwise_quant_kernel', ...))
    compiled = dict(re.findall(r"^(\w+) = async_compile\.triton\('(\w+)'", code, re.M))
    # buffer name -> (shape, stride, element bytes or None when unknown)
    buffers: Dict[str, Tuple[List[int], List[int], Optional[int]]] = {}
    for m in re.finditer(r"(\w+) = rand_strided\(" + _TUPLE + ", " + _TUPLE
                         + r", device='[^']*', dtype=torch\.(\w+)\)", code):
        buffers[m.group(1)] = (_ints(m.group(2)), _ints(m.group(3)),
                               _DTYPE_BYTES.get(m.group(4)))
    for m in re.finditer(r"assert_size_stride\((\w+), " + _TUPLE + ", " + _TUPLE, code):
        old = buffers.get(m.group(1))
        buffers[m.group(1)] = (_ints(m.group(2)), _ints(m.group(3)), old[2] if old else None)

    def size_of(arg: str) -> Optional[Tuple[int, int, Tuple[int, ...]]]:
        """(elements, bytes per element, shape) of a tensor argument; None for others."""
        arg = arg.strip()
        if arg.startswith("out="):
            arg = arg[4:]
        if arg.startswith("aten.view.dtype("):
            return size_of(_split_args(arg[len("aten.view.dtype("):-1])[0])
        m = re.match(r"reinterpret_tensor\((\w+), " + _TUPLE + ", " + _TUPLE, arg)
        if m:
            base = buffers.get(m.group(1))
            shape = _ints(m.group(2))
            return _extent(shape, _ints(m.group(3))), (base[2] if base else None) or 2, tuple(shape)
        if arg in buffers:
            shape, stride, elem = buffers[arg]
            return _extent(shape, stride), elem or 2, tuple(shape)
        return None

    launches: List[Launch] = []
    for line in code[start:].splitlines():
        s = line.strip()
        m = re.match(r"(\w+) = empty_strided_cuda\(" + _TUPLE + ", " + _TUPLE
                     + r", torch\.(\w+)\)", s)
        if m:
            buffers[m.group(1)] = (_ints(m.group(2)), _ints(m.group(3)),
                                   _DTYPE_BYTES.get(m.group(4)))
            continue
        m = re.match(r"(\w+) = (\w+); del \2\b", s)
        if m and m.group(2) in buffers:  # a buffer reused under another name
            buffers[m.group(1)] = buffers[m.group(2)]
            continue
        m = re.match(r"(\w+) = reinterpret_tensor\((\w+), " + _TUPLE + ", " + _TUPLE, s)
        if m:
            elem = buffers.get(m.group(2), ([], [], None))[2]
            buffers[m.group(1)] = (_ints(m.group(3)), _ints(m.group(4)), elem)
            continue
        m = re.match(r"(\w+)\.run\((.*)\)$", s)
        if m:
            name, args = compiled.get(m.group(1), m.group(1)), _split_args(m.group(2))
            names = params.get(name, [])
            inductors = name.startswith(("triton_poi", "triton_red", "triton_per"))
            # an Inductor kernel iterates over its *numel parameters' product: an argument it
            # reads or writes through a slice moves at most that many elements
            numel = programs = None
            if name.startswith(("triton_red", "triton_per")):
                programs = next((int(a) for p, a in zip(names, args)
                                 if p == "xnumel" and re.fullmatch(r"\d+", a)), None)
            if inductors:
                sizes = [int(a) for p, a in zip(names, args)
                         if p.endswith("numel") and re.fullmatch(r"\d+", a)]
                if sizes:
                    numel = 1
                    for v in sizes:
                        numel *= v
            read = written = 0.0
            shapes = []
            for i, a in enumerate(args):
                got = size_of(a)
                if got is None:
                    continue
                elems, elem_bytes, shape = got
                nbytes = float(min(elems, numel) if numel is not None else elems) * elem_bytes
                shapes.append(shape)
                role = names[i] if i < len(names) else ""
                if role.startswith("in_out_ptr"):
                    read, written = read + nbytes, written + nbytes
                elif role.startswith("out_ptr"):
                    written += nbytes
                else:
                    read += nbytes
            if inductors:
                kind = "inductor"
            elif name.startswith("triton_tem"):  # Inductor's GEMM templates (max-autotune)
                kind = "gemm_fp8" if "scaled_mm" in name else "gemm_bf16"
            elif name.startswith(QUANTIZE_KERNELS):
                kind = "quantize"
            elif "gemm" in name:
                kind = "gemm_fp8"
            else:
                kind = "other"
            launches.append(Launch(kind, name, read, written, 0.0, tuple(shapes), programs))
            continue
        m = re.match(r"extern_kernels\.(\w+)\((.*)\)$", s)
        if m and m.group(1) in _GEMMS:
            op, args = m.group(1), _split_args(m.group(2))
            read = written = 0.0
            shapes: List[Optional[List[int]]] = []  # by position: None where not resolved
            for a in args:
                if "=" in a and not a.startswith("out="):
                    continue  # keyword scalars: alpha, out_dtype, use_fast_accum
                got = size_of(a)
                shapes.append(None if got is None else list(got[2]))
                if got is None:
                    continue
                if a.startswith("out="):
                    written += got[0] * got[1]
                else:
                    read += got[0] * got[1]
            launches.append(Launch("gemm_fp8" if op == "_scaled_mm" else "gemm_bf16", op, read,
                                   written, _gemm_flops(op, shapes),
                                   tuple(tuple(x) for x in shapes if x is not None)))
    return launches


def inductor_options(items: Sequence[str]) -> Dict[str, object]:
    """``["KEY=VALUE", ...]`` -> ``{KEY: value}`` for ``torch._inductor.config.patch``:
    each KEY an option of ``torch._inductor.config``, each VALUE JSON (``3``, ``true``);
    ValueError naming the item otherwise."""
    from torch._inductor import config as inductor_config
    known = inductor_config.get_config_copy()  # its options (not its os or patch)
    out: Dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise ValueError(f"{item!r}: expected KEY=VALUE with KEY an option of "
                             "torch._inductor.config")
        try:
            out[key] = json.loads(value)
        except ValueError:
            raise ValueError(f"{item!r}: VALUE must be JSON (a number, true, ...)") from None
    return out


SERIAL_BYTES = 2 ** 20
"""a one-program reduction moving more than this is flagged (``serial_mbytes``)"""


def summarize(launches: Sequence[Launch]) -> dict:
    """Launches, bytes (MB) and GEMM GFLOPs by kind, and the totals: what a plan adds to
    or removes from a step, compared side by side with another's summary.
    ``serial_mbytes``: bytes of reductions one program does alone (``Launch.programs`` 1,
    over :data:`SERIAL_BYTES`): few bytes can still be a slow kernel, so a variant whose
    bytes fall by serializing a reduction is not faster."""
    count, mbytes, gflops = Counter(), Counter(), Counter()
    serial = 0.0
    for launch in launches:
        count[launch.kind] += 1
        mbytes[launch.kind] += launch.bytes / 1e6
        gflops[launch.kind] += launch.flops / 1e9
        if launch.programs == 1 and launch.bytes > SERIAL_BYTES:
            serial += launch.bytes / 1e6
    non_gemm = sum(v for k, v in mbytes.items() if not k.startswith("gemm"))
    return {"launches": dict(count), "mbytes": {k: round(v, 1) for k, v in mbytes.items()},
            "gemm_gflops": {k: round(v, 1) for k, v in gflops.items() if k.startswith("gemm")},
            "total_launches": sum(count.values()), "non_gemm_mbytes": round(non_gemm, 1),
            "serial_mbytes": round(serial, 1)}


def rates(kernel_ms: Dict[str, float], launches: Sequence[Launch]) -> dict:
    """How fast each kernel moved its bytes: ``kernel_ms`` (a profile's GPU milliseconds per
    step by kernel name) joined by name with the launches of one step's code.

    Returns ``{"kernels": [[name, kind, MB, ms, GB/s], ...]`` (largest time first; kernels
    of the code the profile did not see, or the reverse, are left out), ``"by_kind":
    {kind: {"mbytes", "ms", "gbs"}}`` over the joined kernels, and ``"unmatched_ms"``, the
    profile's time in kernels the code does not name (cuBLAS, the optimizer)."""
    per_name: Dict[str, List] = {}
    for launch in launches:
        entry = per_name.setdefault(launch.name, [launch.kind, 0.0])
        entry[1] += launch.bytes / 1e6
    rows, by_kind = [], {}
    unmatched = 0.0
    for name, ms in kernel_ms.items():
        if name not in per_name:
            unmatched += ms
            continue
        kind, mbytes = per_name[name]
        gbs = mbytes / ms if ms > 0 else None  # MB per ms is GB per s
        rows.append([name, kind, round(mbytes, 3), round(ms, 5),
                     None if gbs is None else round(gbs, 1)])
        agg = by_kind.setdefault(kind, {"mbytes": 0.0, "ms": 0.0})
        agg["mbytes"] += mbytes
        agg["ms"] += ms
    for agg in by_kind.values():
        agg["gbs"] = round(agg["mbytes"] / agg["ms"], 1) if agg["ms"] > 0 else None
        agg["mbytes"], agg["ms"] = round(agg["mbytes"], 1), round(agg["ms"], 4)
    rows.sort(key=lambda r: -r[3])
    return {"kernels": rows, "by_kind": by_kind, "unmatched_ms": round(unmatched, 4)}


@contextlib.contextmanager
def output_code() -> Iterator[List[str]]:
    """Collect the wrapper code of every graph Inductor compiles inside the block (real
    compilations: CUDA wrapper code on a GPU, C++ kernels' wrapper on the CPU)."""
    from torch._inductor.graph import GraphLowering
    codes: List[str] = []
    saved = GraphLowering.save_output_code
    GraphLowering.save_output_code = codes.append
    try:
        yield codes
    finally:
        GraphLowering.save_output_code = saved


# --------------------------------------------------------------------- the CPU route

class _FakeTritonDriver:
    """Enough of a Triton driver for Inductor to analyse user kernels (it compiles them
    to Triton IR for the target) on a machine without a GPU driver."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cuda", 0)

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def fake_cuda(props=H200) -> Iterator[List[str]]:
    """Answer ``torch.cuda`` queries as the device ``props`` and keep Inductor from loading
    the CUDA modules it generates: each graph's wrapper code is appended to the yielded
    list and the graph itself is returned in place of the compiled module (it then runs
    on whatever tensors it is given: fake ones here)."""
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor.graph import GraphLowering
    import torch._inductor.inductor_prims  # noqa: F401 (registers the prim patched below)

    codes: List[str] = []

    def compile_to_module(self):
        wrapper, _ = self.codegen()
        codes.append(wrapper.value)
        graph = self.module

        class Module:
            __file__ = "<generated for a simulated CUDA device>"

            @staticmethod
            def call(args):
                inputs = list(args)
                args.clear()
                return graph(*inputs)
        return Module

    cap = (props.major, props.minor)
    patches = [
        mock.patch("torch.cuda.is_available", lambda: True),
        mock.patch("torch.cuda.device_count", lambda: 1),
        mock.patch("torch.cuda.get_device_properties", lambda *a, **k: props),
        mock.patch("torch.cuda.get_device_capability", lambda *a, **k: cap),
        mock.patch("torch.cuda.get_device_name", lambda *a, **k: props.name),
        mock.patch("torch.cuda.current_device", lambda: 0),
        mock.patch("torch.cuda.set_device", lambda *a: None),
        mock.patch("torch.cuda.synchronize", lambda *a: None),
        mock.patch("torch.cuda.is_initialized", lambda: True),
        mock.patch("torch.cuda._lazy_init", lambda: None),
        mock.patch("torch.cuda._exchange_device", lambda idx: 0),
        mock.patch("torch.cuda._maybe_exchange_device", lambda idx: 0),
        mock.patch("torch.cuda.get_rng_state", lambda *a, **k: torch.zeros(16, dtype=torch.uint8)),
        mock.patch("torch.cuda.set_rng_state", lambda *a, **k: None),
        mock.patch("torch.utils._triton.triton_hash_with_backend", lambda: "simulated"),
        mock.patch("torch.utils._triton.triton_backend", lambda: None),
        mock.patch("torch._inductor.scheduler.has_triton", lambda *a: True),
        mock.patch.object(GraphLowering, "compile_to_module", compile_to_module),
        # its meta function would copy on the device when strides differ
        mock.patch.object(torch.ops.prims.inductor_force_stride_order.default, "prim_meta_impl",
                          lambda x, stride: torch.empty_strided(x.shape, stride, dtype=x.dtype,
                                                                device=x.device)),
    ]
    for name, fn in (("current_device", lambda: 0), ("set_device", lambda d: None),
                     ("device_count", lambda: 1), ("synchronize", lambda *a: None),
                     ("get_device_properties", lambda *a, **k: props),
                     ("exchange_device", lambda i: 0), ("maybe_exchange_device", lambda i: 0),
                     ("is_available", lambda: True), ("is_bf16_supported", lambda *a, **k: True),
                     ("get_compute_capability", lambda *a: cap[0] * 10 + cap[1])):
        patches.append(mock.patch.object(CudaInterface, name, staticmethod(fn)))
    patches.append(mock.patch.object(CudaInterface.Worker, "get_device_properties",
                                     staticmethod(lambda *a, **k: props)))
    started = []
    _clear_device_caches()  # answers cached for another device, or another props
    try:
        for p in patches:
            p.start()
            started.append(p)
        yield codes
    finally:
        for p in reversed(started):
            p.stop()
        _clear_device_caches()  # nothing of the simulated device stays behind


def _clear_device_caches() -> None:
    """Inductor caches device facts per device index (its properties, whether it is a
    big GPU); the simulated device must neither reuse nor leave them."""
    from torch._inductor import utils as inductor_utils
    from torch._inductor.runtime.hints import DeviceProperties
    for fn in (getattr(DeviceProperties.create, "cache_clear", None),
               getattr(inductor_utils.is_big_gpu, "cache_clear", None)):
        if fn is not None:
            fn()


def _retarget(obj):
    if isinstance(obj, torch.device) and obj.type == "cpu":
        return torch.device("cuda", 0)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_retarget(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _retarget(v) for k, v in obj.items()}
    return obj


def _lower_for_cuda(gm: torch.fx.GraphModule, example_inputs, kwargs: dict, props,
                    codes: List[str]) -> None:
    """Lower a partitioned graph traced on the CPU again for the simulated CUDA device."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    gm = copy.deepcopy(gm)
    for node in gm.graph.nodes:
        node.args, node.kwargs = _retarget(node.args), _retarget(node.kwargs)
    gm.recompile()
    mode = detect_fake_mode(example_inputs)
    with mode:
        inputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                  if isinstance(t, torch.Tensor) else t for t in example_inputs]

    with fake_cuda(props) as got:  # (its prims patch keeps the propagation on the host)
        FakeTensorProp(gm, mode=mode).propagate_dont_convert_inputs(*inputs)
        kwargs = dict(kwargs, cudagraphs=None)
        with inductor_config.patch(fx_graph_cache=False):
            compile_fx_inner(gm, inputs, **kwargs)
    codes.extend(got)


def _run_step(compiled: Callable, inputs: tuple, loss_fn: Optional[Callable], train: bool):
    if not train:
        with torch.no_grad():
            compiled(*inputs)
        return
    if loss_fn is not None:
        loss = loss_fn(compiled, inputs)
    else:
        out = compiled(*inputs)
        loss = (out[0] if isinstance(out, (tuple, list)) else out).float().sum()
    loss.backward()


def cuda_step_code(model: nn.Module, inputs: tuple, loss_fn: Optional[Callable] = None, *,
                   train: bool = True, props=H200) -> List[str]:
    """Inductor's CUDA wrapper code for one compiled step of ``model``: the forward graph
    and, when ``train``, the backward graph.

    ``loss_fn(compiled_model, inputs) -> scalar`` makes the loss of a training step
    (default: the sum of the first output). With ``model`` on a CUDA device the step runs
    for real (its gradients accumulate in ``model``); otherwise ``model`` is copied, its
    parameters replaced by fake tensors, and nothing is computed.
    """
    if not isinstance(inputs, tuple):
        raise TypeError(f"inputs must be a tuple of the model's arguments, got {type(inputs).__name__}")
    import torch._dynamo
    from torch._inductor import compile_fx

    params = list(model.parameters())
    on_cuda = bool(params) and params[0].is_cuda
    torch._dynamo.reset()
    if on_cuda:  # the real compilation: keep each module's code as Inductor loads it
        try:
            with output_code() as codes:
                _run_step(torch.compile(model), inputs, loss_fn, train)
        finally:
            torch._dynamo.reset()
        return codes

    import triton
    from functorch.compile import make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    codes = []
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = copy.deepcopy(model)
    for mod in model.modules():
        for key, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[key] = nn.Parameter(mode.from_tensor(p.detach()),
                                                    requires_grad=p.requires_grad)
        for key, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[key] = mode.from_tensor(b)
    fake_inputs = tuple(mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs)

    def inner(gm, example_inputs, **kwargs):
        _lower_for_cuda(gm, example_inputs, kwargs, props, codes)
        return make_boxed_func(gm.forward)  # runs the traced graph on the fake tensors

    def backend(gm, example_inputs):
        return compile_fx.compile_fx(gm, example_inputs, inner_compile=inner)

    driver = triton.runtime.driver
    previous = driver._active
    driver.set_active(_FakeTritonDriver(props.major * 10 + props.minor))
    try:
        with mode:
            _run_step(torch.compile(model, backend=backend), fake_inputs, loss_fn, train)
    finally:
        driver._active = previous
        torch._dynamo.reset()
    return codes
