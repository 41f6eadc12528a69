"""Serving a planned model with no Python per call: AOTInductor packages.

``torch.compile``'s code is issued by Python at every call: Dynamo's guard checks,
AOTAutograd's runtime wrappers, then the wrapper code that launches each kernel. On the
serving forward of a ranking model at a few thousand rows (a few hundred microseconds of
GPU time) that host time is as long as the GPU's, so an FP8 plan's GPU saving never reaches
the wall clock unless the step is replayed from a CUDA graph. AOTInductor compiles the same
Inductor code ahead of time into a shared library whose C++ launcher issues every kernel:
a call crosses into C++ once.

:func:`aot_compile` exports a model (planned or not: ``loka.apply(model, plan,
inference=True)`` first, static input scales included) with ``torch.export`` and
compiles it into a ``.pt2`` package; :func:`load_aot` loads one. Both return an
:class:`AOTModel`, a callable that checks its inputs against what the package was
compiled for (shapes, row counts, dtypes, the device) and then runs the package's launcher
directly, with the layout of its outputs decoded once, at load. The package reads each
input's memory as a contiguous tensor, so an input that is not (a transposed view, a
column slice, an expanded row) is copied first.

The package is compiled code: it computes what ``torch.compile`` of the same model
computes (the same Inductor lowering, LoKA's ``loka::scaled_mm`` included), and it is
native code, so load only packages you made. It runs on the device type it was compiled
for, on the GPU it is loaded on.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..config import BASELINE
from ..numerics.metrics import relative_frobenius
from .linear import Linear

__all__ = ["AOTModel", "aot_compile", "load_aot", "METADATA_KEY"]

METADATA_KEY = "loka.inputs"
"""the package metadata entry that holds the example inputs' description (JSON)"""


@dataclass(frozen=True)
class InputSpec:
    """One tensor input as the package was compiled for it. ``shape`` holds None at the
    batch dimension where it may vary (``dynamic_batch``), between ``min_rows`` and
    ``max_rows`` (None: no bound)."""

    shape: Tuple[Optional[int], ...]
    dtype: str
    device: str
    min_rows: Optional[int] = None
    max_rows: Optional[int] = None

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "device": self.device,
                "min_rows": self.min_rows, "max_rows": self.max_rows}

    @classmethod
    def from_dict(cls, d: dict) -> "InputSpec":
        """Parse and validate one input's description; ValueError names what is wrong."""
        if not isinstance(d, dict):
            raise ValueError(f"an input is described by {type(d).__name__}, not an object")
        shape = d["shape"]
        if not isinstance(shape, list) or not all(s is None or _count(s) for s in shape):
            raise ValueError(f"shape {shape!r} is not a list of sizes")
        _dtype(d["dtype"])
        try:
            torch.device(d["device"])
        except (RuntimeError, TypeError):
            raise ValueError(f"device {d['device']!r} is not a device") from None
        lo, hi = d.get("min_rows"), d.get("max_rows")
        if not all(b is None or _count(b) for b in (lo, hi)) or (
                lo is not None and hi is not None and lo > hi):
            raise ValueError(f"row bounds {lo!r}, {hi!r} are not a range of row counts")
        return cls(tuple(shape), d["dtype"], d["device"], lo, hi)

    def shown(self) -> tuple:
        return tuple("*" if s is None else s for s in self.shape)


def _count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _dtype(name: object) -> torch.dtype:
    """``torch.float32`` from its name, ``"torch.float32"``."""
    got = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(got, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a torch dtype")
    return got


def _fp8_sites(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, Linear) and m.config.fwd != BASELINE]


class AOTModel:
    """A compiled ``.pt2`` package, loaded: ``model(*inputs)`` as the exported model.

    Attributes:
        path: the package file.
        inputs: one :class:`InputSpec` per tensor input.
        device: the device the package runs on; every input must be there.
        fp8_sites: the planned Linears whose forward runs an FP8 kernel (as compiled).
        check: what :func:`aot_compile` measured against the eager model on the example
            (``rel_err_vs_eager``, ``max_abs_diff``), or None for a package only loaded.
    """

    def __init__(self, path: "str | os.PathLike", single_threaded: bool = False,
                 device: "torch.device | str | None" = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no AOTInductor package at {self.path}")
        if not zipfile.is_zipfile(self.path):
            raise ValueError(f"{self.path} is not an AOTInductor package (.pt2, a zip archive)")
        want = None if device is None else torch.device(device)
        index = want.index if want is not None and want.index is not None else -1
        try:
            self._package = torch._inductor.aoti_load_package(
                str(self.path), run_single_threaded=bool(single_threaded), device_index=index)
        except Exception as e:  # noqa: BLE001 - one line for the caller
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{self.path} could not be loaded as an AOTInductor package: "
                             f"{first[:300]}") from None
        meta = self._package.get_metadata()
        try:
            described = json.loads(meta[METADATA_KEY])
            listed = described["inputs"]
            if not isinstance(listed, list) or not listed:
                raise ValueError("it lists no inputs")
            self.inputs = tuple(InputSpec.from_dict(d) for d in listed)
            sites = described.get("fp8_sites", [])
            if not isinstance(sites, list) or not all(isinstance(n, str) for n in sites):
                raise ValueError("fp8_sites is not a list of names")
            self.fp8_sites = tuple(sites)
            kinds = {torch.device(i.device).type for i in self.inputs}
            if len(kinds) != 1:
                raise ValueError(f"its inputs are on several device types: {sorted(kinds)}")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{self.path} was not made by loka.aot_compile (its metadata "
                             f"has no valid {METADATA_KEY!r}: {e})") from None
        kind = kinds.pop()
        if want is not None and want.type != kind:
            raise ValueError(f"{self.path} was compiled for {kind}, not {want.type}")
        # the package binds to the given GPU, else to the current one when loaded
        self.device = (torch.device(kind) if kind == "cpu" else
                       torch.device(kind, index if index >= 0 else
                                    getattr(torch, kind).current_device()))
        self.check: Optional[Dict[str, float]] = None  # set by aot_compile
        self._shapes = tuple(i.shape for i in self.inputs)
        self._dtypes = tuple(_dtype(i.dtype) for i in self.inputs)
        self._dynamic = tuple(bool(i.shape) and i.shape[0] is None for i in self.inputs)
        # the launcher and the layout of the outputs, decoded once: the package's own
        # __call__ decodes the layouts from JSON at every call
        loader = getattr(self._package, "loader", None)
        self._run = getattr(loader, "boxed_run", None)
        self._out_spec = (pytree.treespec_loads(loader.get_call_spec()[1])
                          if self._run is not None else None)

    def _problem(self, inputs: Tuple[object, ...]) -> Optional[str]:
        """Why ``inputs`` cannot be this package's, or None."""
        if len(inputs) != len(self.inputs):
            return f"takes {len(self.inputs)} tensor input(s), got {len(inputs)}"
        rows = None
        for i, (t, shape, dtype, dynamic) in enumerate(zip(inputs, self._shapes, self._dtypes,
                                                           self._dynamic)):
            if not isinstance(t, torch.Tensor):
                return f"input {i} must be a tensor, got {type(t).__name__}"
            if t.dtype != dtype:
                return f"input {i} must be {dtype}, got {t.dtype}"
            if t.device != self.device:
                return f"input {i} must be on {self.device}, got {t.device}"
            if t.dim() != len(shape) or any(s is not None and s != n
                                            for s, n in zip(shape, t.shape)):
                return (f"input {i} must have shape {self.inputs[i].shown()}, "
                        f"got {tuple(t.shape)}")
            if dynamic:
                n = t.shape[0]
                spec = self.inputs[i]
                if n < (spec.min_rows or 1) or (spec.max_rows is not None and n > spec.max_rows):
                    bound = (f"at least {spec.min_rows or 1}" if spec.max_rows is None else
                             f"{spec.min_rows or 1} to {spec.max_rows}")
                    return f"input {i} has {n} rows; the package serves {bound}"
                if rows is None:
                    rows = n
                elif n != rows:
                    return (f"the inputs' batch dimensions differ ({rows} and {n} rows): "
                            "every input holds the same rows")
        return None

    def __call__(self, *inputs: torch.Tensor):
        why = self._problem(inputs)
        if why is not None:
            raise (TypeError if why.startswith("takes") else ValueError)(
                f"{self.path.name}: {why}")
        # the package reads memory as contiguous tensors (it was compiled for them)
        flat = [t if t.is_contiguous() else t.contiguous() for t in inputs]
        if self._run is None:
            return self._package(*flat)
        out = self._run(flat)
        return out[0] if self._out_spec.is_leaf() else pytree.tree_unflatten(out,
                                                                             self._out_spec)

    def __repr__(self) -> str:
        shapes = ", ".join(str(i.shown()) for i in self.inputs)
        return (f"AOTModel({str(self.path)!r}, inputs=[{shapes}], device={self.device}, "
                f"fp8_sites={len(self.fp8_sites)})")


def _compare(out, ref) -> Dict[str, float]:
    """The package's outputs against the eager model's, leaf by leaf: the same count, each
    tensor of the same shape and dtype, floating ones finite where eager's are, numbers
    equal (a number the model returns comes back from the package as a tensor);
    ValueError otherwise. Returned: the floating outputs' largest relative error and
    absolute difference, and how many integer or boolean elements differ."""
    got, want = pytree.tree_leaves(out), pytree.tree_leaves(ref)
    if len(got) != len(want):
        raise ValueError(f"the compiled package returns {len(got)} values where the eager "
                         f"model returns {len(want)}")
    check = {"rel_err_vs_eager": 0.0, "max_abs_diff": 0.0, "unequal_integers": 0}
    for i, (o, r) in enumerate(zip(got, want)):
        if not isinstance(r, torch.Tensor):
            value = o.item() if isinstance(o, torch.Tensor) and o.numel() == 1 else o
            if r is not None and value != r and not (
                    isinstance(r, float) and isinstance(value, float)
                    and abs(value - r) <= 1e-3 * abs(r)):
                raise ValueError(f"the compiled package's output {i} is {value!r} where the "
                                 f"eager model's is {r!r}")
            continue
        if not isinstance(o, torch.Tensor) or o.shape != r.shape or o.dtype != r.dtype:
            shown = (f"{tuple(o.shape)} {o.dtype}" if isinstance(o, torch.Tensor)
                     else type(o).__name__)
            raise ValueError(f"the compiled package's output {i} is {shown} where the eager "
                             f"model's is {tuple(r.shape)} {r.dtype}")
        o = o.to(r.device)
        if not r.is_floating_point():
            # (counted, not refused: indices or labels computed from FP8 values, a top-k
            # or a threshold, may differ where eager's float values round otherwise)
            check["unequal_integers"] += int((o != r).sum())
            continue
        fin = torch.isfinite(r)
        bad = fin & ~torch.isfinite(o)
        if bool(bad.any()):
            raise ValueError(f"the compiled package's output {i} is not finite where the eager "
                             f"model's is ({int(bad.sum())} elements)")
        if bool(fin.any()):
            o, r = o[fin].double(), r[fin].double()
            check["rel_err_vs_eager"] = max(check["rel_err_vs_eager"],
                                            relative_frobenius(o, r))
            check["max_abs_diff"] = max(check["max_abs_diff"], float((o - r).abs().max()))
    return check


def _row_bounds(exported) -> Tuple[Optional[int], Optional[int]]:
    """The range of row counts the exported program serves (its batch symbol's)."""
    for node in exported.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and val.dim() and isinstance(val.shape[0], torch.SymInt):
            vr = exported.range_constraints.get(val.shape[0].node.expr)
            if vr is None:
                return None, None
            lo, hi = vr.lower, vr.upper
            # (sympy integers; the infinities, torch's int_oo among them, are not)
            return (int(lo) if lo.is_Integer else None), (int(hi) if hi.is_Integer else None)
    return None, None


def _mutated_state(exported) -> List[str]:
    """The buffers and inputs the exported forward writes to (a package would run on a
    copy of the buffers' values frozen at export, and write into the caller's inputs)."""
    sig = exported.run_decompositions({}).graph_signature
    return ([f"buffer {b}" for b in sorted(set(sig.buffers_to_mutate.values()))]
            + [f"input {n}" for n in sorted(set(sig.user_inputs_to_mutate.values()))])


def _with_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` with ``n`` rows, its own rows repeated in turn."""
    return t[torch.arange(n, device=t.device) % t.shape[0]]


def _rows_disagree(model: nn.Module, served: "AOTModel",
                   inputs: Tuple[torch.Tensor, ...]) -> Optional[str]:
    """Where the package, run at its fewest rows and at one row more than the example
    (the example's rows repeated), returns other values than the model: another count,
    shape or dtype, or (at one row more) a larger error than on the example; None where
    it agrees."""
    rows, least = inputs[0].shape[0], served.inputs[0].min_rows or 1
    for n in sorted({least, rows + 1}):
        x = tuple(_with_rows(t, n) for t in inputs)
        try:
            with torch.no_grad():
                check = _compare(served(*x), model(*x))
        except (ValueError, RuntimeError) as e:
            return f"at {n} rows: {str(e).strip().splitlines()[0][:200]}"
        # (one row's error is one row's: only the count with the example's rows in it is
        # held to the example's)
        if n > rows and check["rel_err_vs_eager"] > 4 * served.check["rel_err_vs_eager"] + 1e-3:
            return (f"at {n} rows: relative error {check['rel_err_vs_eager']:.2e} against "
                    f"{served.check['rel_err_vs_eager']:.2e} on the example")
    return None


def _package(exported, inputs: Tuple[torch.Tensor, ...], ref, sites: List[str],
             configs: Dict[str, Any], single_threaded: bool, dynamic: bool,
             tmp: str) -> "AOTModel":
    """Compile ``exported`` (its batch a symbol where ``dynamic``) into the package ``tmp``
    (its folder made), its description in the metadata, load it and check it against the
    eager outputs ``ref`` on the example."""
    lo, hi = _row_bounds(exported) if dynamic else (None, None)
    specs = [InputSpec(tuple(None if dynamic and d == 0 else int(n)
                             for d, n in enumerate(t.shape)), str(t.dtype), str(t.device),
                       lo, hi) for t in inputs]
    meta = {METADATA_KEY: json.dumps({"inputs": [s.to_dict() for s in specs],
                                      "fp8_sites": sites})}
    configs = {**configs, "aot_inductor.metadata": {
        **configs.get("aot_inductor.metadata", {}), **meta}}
    os.makedirs(os.path.dirname(tmp))
    torch._inductor.aoti_compile_and_package(exported, package_path=tmp,
                                             inductor_configs=configs)
    served = AOTModel(tmp, single_threaded=single_threaded, device=inputs[0].device)
    with torch.no_grad():
        served.check = _compare(served(*(t.clone() for t in inputs)), ref)
    return served


def _export(model: nn.Module, inputs: Tuple[torch.Tensor, ...], dynamic_batch: bool,
            least: int = 1):
    """``torch.export`` of ``model`` on ``inputs``, refused where the forward writes to a
    buffer or an input. With ``dynamic_batch`` the rows of every input are one symbol,
    from one row up (``least``) where the model's code allows it (sizes 0 and 1 traced
    like any other), else from two (code that branches on a single row, such as a GEMM's
    row-scale checks: :func:`_row_bounds` records the bound the package keeps)."""
    if not dynamic_batch:
        exported = torch.export.export(model, inputs)
    else:
        from torch.fx.experimental import _config as fx_config
        for low in range(least, 3):
            batch = torch.export.Dim("batch", min=low)
            try:
                with fx_config.patch(backed_size_oblivious=low == 1):
                    exported = torch.export.export(
                        model, inputs, dynamic_shapes=tuple({0: batch} for _ in inputs))
                break
            except torch._dynamo.exc.UserError:
                if low == 2:
                    raise
    written = _mutated_state(exported)
    if written:
        raise ValueError("aot_compile serves a forward that writes to no buffer or input; "
                         f"this one writes to {', '.join(written[:3])}")
    return exported


def aot_compile(model: nn.Module, example_inputs: Sequence[torch.Tensor],
                path: "str | os.PathLike", *, dynamic_batch: bool = False,
                inductor_configs: Optional[Dict[str, Any]] = None,
                single_threaded: bool = False) -> AOTModel:
    """Export ``model``'s forward on ``example_inputs`` and compile it with AOTInductor into
    the package ``path``, load it and check it against the eager model; the package
    reaches ``path`` only when all of that succeeded (written beside it, moved into place).

    Args:
        model: the model, every module in eval mode; for an FP8 serving plan, after
            ``loka.apply(model, plan, inference=True)``. It runs once, eagerly, on a copy of
            the example (the reference of the check).
        example_inputs: the positional tensors of one call, on the device to serve on
            (made contiguous for the export).
        path: the ``.pt2`` file to write; its folder must exist and be writable.
        dynamic_batch: let the first dimension of every input vary, the same for all, from
            one row up, or from two where the model's code branches on a single row or
            computes otherwise at one (the package is run at its fewest rows and at one
            more than the example's, and compiled again from two rows where it disagrees
            with the model); the range is recorded and checked at every call. Otherwise
            the package serves the example's shapes only.
        inductor_configs: Inductor options for the compilation (as ``torch.compile``'s
            ``options``).
        single_threaded: run without the package's locking, for one serving thread
            (needed to capture its calls in a CUDA graph).

    Returns:
        The loaded :class:`AOTModel`, its ``check`` the relative error of its output
        against the eager model's on the example (not zero with FP8: Inductor's code
        computes what a cast reads a little differently, in float32 where eager rounds to
        bf16, and a value moved across an FP8 rounding step moves by a whole step;
        ``torch.compile`` of the same model gives the package's bits).

    Raises:
        TypeError: ``model`` is not a module, or ``example_inputs`` is one tensor, not a
            sequence of them.
        ValueError: a module is in training mode; an input is not a tensor with rows; the
            inputs are on several devices; ``dynamic_batch`` with an example of one row;
            the forward writes to a buffer or an input (a package would freeze the
            buffer's value and write into the caller's tensors); with ``dynamic_batch``,
            the package computes otherwise than the model at another row count from two
            rows up; ``path`` does not end in ``.pt2`` or its folder is missing
            or read-only; the package's outputs differ from the eager model's in number,
            shapes or dtypes, returned numbers, or finiteness.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    training = [n or type(model).__name__ for n, m in model.named_modules() if m.training]
    if training:
        raise ValueError(f"aot_compile compiles a serving forward: call model.eval() first "
                         f"(in training mode: {', '.join(training[:3])})")
    if isinstance(example_inputs, torch.Tensor):
        raise TypeError("example_inputs is the sequence of one call's tensors: pass (x,), "
                        "not x")
    inputs = tuple(example_inputs)
    if not inputs:
        raise ValueError("example_inputs is empty: give the tensors of one call")
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"example input {i} must be a tensor, got {type(t).__name__}")
        if t.numel() == 0 or (t.dim() and t.shape[0] == 0):
            raise ValueError(f"example input {i} is empty (shape {tuple(t.shape)})")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give the package's file name (.pt2)")
    if path.suffix != ".pt2":
        raise ValueError(f"the package's file name must end in .pt2, got {path.name}")
    if not path.parent.is_dir():
        raise ValueError(f"the folder of {path} does not exist")
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"the folder of {path} is not writable")
    devices = {t.device for t in inputs}
    if len(devices) > 1:
        raise ValueError(f"the example inputs are on several devices "
                         f"({', '.join(sorted(map(str, devices)))}): a package serves one")
    if dynamic_batch:
        if any(t.dim() == 0 for t in inputs):
            raise ValueError("dynamic_batch needs every input to have a batch dimension")
        if len({t.shape[0] for t in inputs}) != 1:
            raise ValueError("dynamic_batch needs every input to hold the same rows, got "
                             f"{[t.shape[0] for t in inputs]}")
        if inputs[0].shape[0] < 2:
            raise ValueError("dynamic_batch needs an example of at least 2 rows (at one, "
                             "the export may trace a size of one for the batch)")
    inputs = tuple(t.contiguous() for t in inputs)
    sites = _fp8_sites(model)
    configs = dict(inductor_configs or {})
    with torch.no_grad():
        # exported (and refused if it writes to a buffer or an input) before the model runs
        exported = _export(model, inputs, dynamic_batch)
        ref = model(*(t.clone() for t in inputs))
    # compiled, loaded and checked beside its destination under its own name (the package's
    # archive is named after the file), then moved into place whole
    scratch = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        served = _package(exported, inputs, ref, sites, configs, single_threaded,
                          dynamic_batch, os.path.join(scratch, "1", path.name))
        if dynamic_batch:
            why = _rows_disagree(model, served, inputs)
            if why is not None and served.inputs[0].min_rows == 1:
                # Inductor took a size-oblivious trace at its word where the model's code
                # computes otherwise at one row (a squeeze() over the rows): from two
                with torch.no_grad():
                    exported = _export(model, inputs, True, least=2)
                served = _package(exported, inputs, ref, sites, configs, single_threaded,
                                  True, os.path.join(scratch, "2", path.name))
                why = _rows_disagree(model, served, inputs)
            if why is not None:
                raise ValueError(f"dynamic_batch: the package computes otherwise than the "
                                 f"model {why}; compile for the example's rows "
                                 f"(dynamic_batch=False)")
        with open(served.path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(served.path, path)  # the loaded package no longer reads its file
        served.path = path
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return served


def load_aot(path: "str | os.PathLike", single_threaded: bool = False,
             device: "torch.device | str | None" = None) -> AOTModel:
    """Load a package :func:`aot_compile` wrote (see :class:`AOTModel`): on ``device``
    (a GPU's index; default: the current one), which its inputs must then be on. Raises
    FileNotFoundError for a missing file and ValueError for one that is not such a package
    or was compiled for another device type."""
    return AOTModel(path, single_threaded=single_threaded, device=device)
