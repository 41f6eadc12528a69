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
:class:`AOTModel`, a callable that checks its inputs against the example's (shapes,
dtypes, devices: a compiled package reads memory as its example laid it out) and then
runs the package's launcher directly, with the input and output layouts decoded once,
at load.

The package is compiled code: it computes what ``torch.compile`` of the same model
computes (the same Inductor lowering, LoKA's ``loka::scaled_mm`` included), and it is
native code, so load only packages you made. It runs on the device type it was compiled
for.
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

from ..config import BASELINE
from .linear import Linear

__all__ = ["AOTModel", "aot_compile", "load_aot", "METADATA_KEY"]

METADATA_KEY = "loka.inputs"
"""the package metadata entry that holds the example inputs' description (JSON)"""


@dataclass(frozen=True)
class InputSpec:
    """One tensor input as the package was compiled for it. ``shape`` holds None at a
    dimension that may vary (the batch, with ``dynamic_batch``)."""

    shape: Tuple[Optional[int], ...]
    dtype: str
    device: str

    def to_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "device": self.device}

    @classmethod
    def from_dict(cls, d: dict) -> "InputSpec":
        return cls(tuple(None if s is None else int(s) for s in d["shape"]), str(d["dtype"]),
                   str(d["device"]))

    def problem(self, t: object, i: int) -> Optional[str]:
        """Why ``t`` cannot be input ``i``, or None."""
        if not isinstance(t, torch.Tensor):
            return f"input {i} must be a tensor, got {type(t).__name__}"
        if str(t.dtype) != self.dtype:
            return f"input {i} must be {self.dtype}, got {t.dtype}"
        if t.device.type != torch.device(self.device).type:
            return f"input {i} must be on {self.device}, got {t.device}"
        if t.dim() != len(self.shape) or any(
                s is not None and s != n for s, n in zip(self.shape, t.shape)):
            shown = tuple("*" if s is None else s for s in self.shape)
            return f"input {i} must have shape {shown}, got {tuple(t.shape)}"
        if self.shape and self.shape[0] is None and t.shape[0] == 0:
            return f"input {i} has no rows"
        return None


def _fp8_sites(model: nn.Module) -> List[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, Linear) and m.config.fwd != BASELINE]


class AOTModel:
    """A compiled ``.pt2`` package, loaded: ``model(*inputs)`` as the exported model.

    Attributes:
        path: the package file.
        inputs: one :class:`InputSpec` per tensor input.
        fp8_sites: the planned Linears whose forward runs an FP8 kernel (as compiled).
        check: what :func:`aot_compile` measured against the eager model on the example
            (``rel_err_vs_eager``, ``max_abs_diff``), or None for a package only loaded.
    """

    def __init__(self, path: "str | os.PathLike", single_threaded: bool = False,
                 check: Optional[Dict[str, float]] = None) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no AOTInductor package at {self.path}")
        if not zipfile.is_zipfile(self.path):
            raise ValueError(f"{self.path} is not an AOTInductor package (.pt2, a zip archive)")
        try:
            self._package = torch._inductor.aoti_load_package(
                str(self.path), run_single_threaded=bool(single_threaded))
        except Exception as e:  # noqa: BLE001 - one line for the caller
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{self.path} could not be loaded as an AOTInductor package: "
                             f"{first[:300]}") from None
        meta = self._package.get_metadata()
        try:
            described = json.loads(meta[METADATA_KEY])
            self.inputs = tuple(InputSpec.from_dict(d) for d in described["inputs"])
            self.fp8_sites = tuple(str(s) for s in described.get("fp8_sites", ()))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{self.path} was not made by loka.aot_compile (its metadata "
                             f"has no valid {METADATA_KEY!r}: {e})") from None
        self.check = check
        # the launcher and the layouts of inputs and outputs, decoded once: the package's
        # own __call__ decodes both from JSON at every call
        loader = getattr(self._package, "loader", None)
        self._run = getattr(loader, "boxed_run", None)
        self._out_spec = None
        if self._run is not None:
            from torch.utils import _pytree as pytree
            self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1])

    def __call__(self, *inputs: torch.Tensor):
        if len(inputs) != len(self.inputs):
            raise TypeError(f"{self.path.name} takes {len(self.inputs)} tensor input(s), "
                            f"got {len(inputs)}")
        for i, (spec, t) in enumerate(zip(self.inputs, inputs)):
            why = spec.problem(t, i)
            if why is not None:
                raise ValueError(f"{self.path.name}: {why}")
        if self._run is None:
            return self._package(*inputs)
        from torch.utils import _pytree as pytree
        return pytree.tree_unflatten(self._run(list(inputs)), self._out_spec)

    def __repr__(self) -> str:
        shapes = ", ".join(str(tuple("*" if s is None else s for s in i.shape))
                           for i in self.inputs)
        return f"AOTModel({str(self.path)!r}, inputs=[{shapes}], fp8_sites={len(self.fp8_sites)})"


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def aot_compile(model: nn.Module, example_inputs: Sequence[torch.Tensor],
                path: "str | os.PathLike", *, dynamic_batch: bool = False,
                inductor_configs: Optional[Dict[str, Any]] = None,
                single_threaded: bool = False) -> AOTModel:
    """Export ``model``'s forward on ``example_inputs`` and compile it with AOTInductor into
    the package ``path`` (written whole or not at all), then load it.

    Args:
        model: the model in eval mode; for an FP8 serving plan, after
            ``loka.apply(model, plan, inference=True)``.
        example_inputs: the positional tensors of one call, on the device to serve on.
        path: where to write the ``.pt2`` package (its folder must exist).
        dynamic_batch: let the first dimension of every input vary (from 1 row up);
            otherwise the package serves the example's shapes only.
        inductor_configs: Inductor options for the compilation (as ``torch.compile``'s
            ``options``).
        single_threaded: run without the package's locking, for one serving thread
            (needed to capture its calls in a CUDA graph).

    Returns:
        The loaded :class:`AOTModel`, its ``check`` the relative error of its output
        against the eager model's on the example (FP8 casts that Inductor fuses may round
        a few elements one FP8 step apart from eager PyTorch; ``torch.compile`` of the same
        model gives the package's bits).

    Raises:
        ValueError: the model is in training mode, an input is not a non-empty tensor, the
            path's folder does not exist, or the outputs are not finite where the eager
            model's are.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError("aot_compile compiles a serving forward: call model.eval() first")
    inputs = tuple(example_inputs)
    if not inputs:
        raise ValueError("example_inputs is empty: give the tensors of one call")
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"example input {i} must be a tensor, got {type(t).__name__}")
        if t.numel() == 0 or (t.dim() and t.shape[0] == 0):
            raise ValueError(f"example input {i} is empty (shape {tuple(t.shape)})")
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"the folder of {path} does not exist")
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give the package's file name (.pt2)")
    dynamic_shapes = None
    if dynamic_batch:
        if any(t.dim() == 0 for t in inputs):
            raise ValueError("dynamic_batch needs every input to have a batch dimension")
        batch = torch.export.Dim("batch", min=1)
        dynamic_shapes = tuple({0: batch} for _ in inputs)
    specs = [InputSpec(tuple(None if dynamic_batch and d == 0 else int(n)
                             for d, n in enumerate(t.shape)), str(t.dtype), str(t.device))
             for t in inputs]
    sites = _fp8_sites(model)
    meta = {METADATA_KEY: json.dumps({"inputs": [s.to_dict() for s in specs],
                                      "fp8_sites": sites})}
    configs = dict(inductor_configs or {})
    configs["aot_inductor.metadata"] = {**configs.get("aot_inductor.metadata", {}), **meta}
    with torch.no_grad():
        ref = model(*inputs)
        exported = torch.export.export(model, inputs, dynamic_shapes=dynamic_shapes)
    # compiled beside its destination under its own name (the package's archive is named
    # after the file), then moved into place whole
    scratch = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        tmp = os.path.join(scratch, path.name)
        torch._inductor.aoti_compile_and_package(exported, package_path=tmp,
                                                 inductor_configs=configs)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    served = AOTModel(path, single_threaded=single_threaded)
    with torch.no_grad():
        out = served(*inputs)
    check = {"rel_err_vs_eager": 0.0, "max_abs_diff": 0.0}
    for i, (o, r) in enumerate(zip(_leaves(out), _leaves(ref))):
        fin = torch.isfinite(r)
        bad = fin & ~torch.isfinite(o)
        if bool(bad.any()):
            raise ValueError(f"the compiled package's output {i} is not finite where the eager "
                             f"model's is ({int(bad.sum())} elements)")
        if r.is_floating_point() and bool(fin.any()):
            o, r = o[fin].double(), r[fin].double()
            check["rel_err_vs_eager"] = max(check["rel_err_vs_eager"], _rel_err(o, r))
            check["max_abs_diff"] = max(check["max_abs_diff"], float((o - r).abs().max()))
    served.check = check
    return served


def _leaves(out) -> List[torch.Tensor]:
    from torch.utils import _pytree as pytree
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def load_aot(path: "str | os.PathLike", single_threaded: bool = False) -> AOTModel:
    """Load a package :func:`aot_compile` wrote (see :class:`AOTModel`). Raises
    FileNotFoundError for a missing file and ValueError for one that is not such a package."""
    return AOTModel(path, single_threaded=single_threaded)
