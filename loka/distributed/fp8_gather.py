"""FP8 weights in FSDP2's all-gather: each rank casts its weight shard to FP8 before the
all-gather, so the all-gather moves one byte per weight (plus scales) instead of two.

:func:`fp8_all_gather` (after ``loka.apply``, before ``fully_shard``) wraps the weight of
every ``loka.Linear`` whose forward kernel is FP8 at the chosen granularity in
:class:`FP8GatherWeight`, the tensor subclass FSDP2 asks for its all-gather inputs
(``fsdp_pre_all_gather``) and hands the gathered ones back to (``fsdp_post_all_gather``):

* ``rowwise``: the forward's weight operand Wᵀ (K, N) has one scale per output row of
  W (N, K), FSDP's shard dimension: each rank quantizes its rows with their own scales,
  and the scales travel in the same all-gather as the FP8 rows (no collective of their
  own). The gathered FP8 weight equals the forward kernel's ``quantize_b`` of the whole
  weight, bit for bit.
* ``tensorwise``: one scale for the whole weight, from the largest |w| of all shards (one
  all-reduce); :func:`precompute_fp8_scales` does it for every weight in one all-reduce
  after the optimizer step.

After the all-gather the ``loka.Linear`` holds the gathered FP8 weight as its
``weight_q`` (its forward does not quantize the weight again) and its ``weight`` is the
dequantized FP8 weight, which the backward's dgrad uses. The weight gradient and FSDP's
reduce-scatter stay in high precision. Each shard is quantized once per optimizer step,
not once per use: the quantized shard is kept until any optimizer steps (a global
optimizer step hook counts the steps); weights changed otherwise (loaded in place, edited
by hand) need :func:`weights_changed`. :func:`loka.distributed.load` calls it. The
step count is each process's own and decides which collectives the scales need, so every
rank must step its optimizer together, as FSDP training does (with mixed precision, a
grad scaler that agrees across ranks on skipping a step, such as FSDP's
``ShardedGradScaler``).

On one rank there is nothing to all-gather and rowwise weights are left as they are.

Weights whose rows do not split evenly over the ranks: FSDP pads every shard to the first
shard's rows and requires each all-gather input to have that padded shape, so the scales
cannot ride beside the rows. Such a shard sends its FP8 rows zero-padded (one byte per
weight, as before), and its row scales (4 bytes per row) go in a small all-gather of their
own, once per optimizer step (:func:`precompute_fp8_scales` does every such weight in one
all-gather). Tensorwise shards are padded the same way and need nothing more.
A site the Guard later switches to the baseline still all-gathers FP8 (FSDP fixes the
all-gather's layout at the first call): its weight is the dequantized FP8 weight.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..dispatch import Linear
from ..dispatch.swap import root_module
from ..kernels.registry import Kernel, Scaling
from ..numerics import Granularity, QTensor, get_format, quantize
from .agree import world

__all__ = ["FP8GatherWeight", "fp8_all_gather", "precompute_fp8_scales", "weights_changed",
           "CollectiveBytes", "count_all_gather"]

_GENERATION = [0]
"""bumped by every optimizer step (and :func:`weights_changed`): quantized shards of an
older generation are stale"""
_STEP_HOOK: List = []


def weights_changed(*_args) -> None:
    """Mark every FP8-gathered weight as changed: the next all-gather quantizes again
    (optimizer steps do this by themselves)."""
    _GENERATION[0] += 1


def _watch_optimizers() -> None:
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(weights_changed))

SCALINGS = ("rowwise", "tensorwise")

# FSDP pads, slices, copies and moves the local shard: those results stay the subclass
_PRESERVE = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default, torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default, torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default, torch.ops.aten.chunk.default,
}


def _matches(kernel: Optional[Kernel], scaling: str) -> bool:
    """Whether ``kernel`` (a forward kernel) takes a weight quantized at ``scaling``."""
    return (kernel is not None and kernel.is_fp8 and kernel.quantize_b is not None
            and kernel.scaling is Scaling(scaling))


def _bytes(data: torch.Tensor) -> torch.Tensor:
    """FP8 rows as bytes: every backend all-gathers uint8 (gloo has no FP8 types)."""
    return data.contiguous().view(torch.uint8)


def _pad_rows(data: torch.Tensor, rows: int) -> torch.Tensor:
    """``data`` (r, K) with zero rows appended up to ``rows`` (FSDP's padded shard)."""
    if data.shape[0] == rows:
        return data
    return torch.cat([data, data.new_zeros((rows - data.shape[0], data.shape[1]))])


def _quantize_rows(w: torch.Tensor, use: Optional[Kernel], fmt) -> QTensor:
    """Rows of a weight shard (r, K) with one scale each: the forward kernel's own
    ``quantize_b`` of Wᵀ, or LoKA's rowwise quantizer in ``fmt`` without one."""
    return (use.quantize_b(w.t()) if use is not None
            else quantize(w.t(), fmt, Granularity.ROWWISE, "b"))


def _holder(module, shard) -> object:
    """Where the caches that decide a collective live: the Linear that owns the weight
    (one per rank, and kept when FSDP re-pads a smaller shard and installs a new shard
    object on that rank only: caches on the shard object would then differ between ranks,
    and so would the collectives they skip); the shard itself without a module."""
    return module if module is not None else shard


def _gather_row_scales(entries, group, ranks: int) -> List[torch.Tensor]:
    """The scales of every row (all ranks', padded layout: ``ranks * padded``) of each
    uneven rowwise shard in ``entries`` (``(shard, holder, kernel, format, padded)``), in
    one all-gather for those whose holder has none for this generation. Every rank calls it
    with the same entries in the same order (FSDP's all-gather order, or the model's), and
    the holders' state is the same on every rank, so every rank gathers the same."""
    def key(entry):  # moved weights (.to(), FSDP's _apply) are gathered again
        shard, _, use, _, padded = entry
        return (_GENERATION[0], None if use is None else use.name, padded,
                str(shard._tensor.device))
    held = [getattr(h, "_loka_row_scales", None) for _, h, _, _, _ in entries]
    todo = [i for i, (entry, h) in enumerate(zip(entries, held))
            if h is None or h[0] != key(entry)]
    if todo:
        local = [entries[i][0]._local_rows(entries[i][2], entries[i][3], entries[i][4])
                 for i in todo]
        mine = torch.cat([scales for _, _, scales in local])
        if ranks > 1:
            every = mine.new_empty(ranks * mine.numel())
            dist.all_gather_into_tensor(every, mine, group=group)
            every = every.view(ranks, -1)
        else:
            every = mine.view(1, -1)
        offset = 0
        for i, (_, _, scales) in zip(todo, local):
            holder = entries[i][1]
            full = every[:, offset:offset + scales.numel()].reshape(-1).clone()
            offset += scales.numel()
            held[i] = (key(entries[i]), full)
            setattr(holder, "_loka_row_scales", held[i])
    return [h[1] for h in held]


class FP8GatherWeight(torch.Tensor):
    """A high-precision weight (N, K) that FSDP2 all-gathers as FP8 (module docstring).

    Every operation but FSDP's own (padding, slicing, copies) sees the plain weight; the
    optimizer updates it in place like any parameter.
    """

    @staticmethod
    def __new__(cls, tensor: torch.Tensor, scaling: str):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device,
            requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor, scaling: str):
        if scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
        self._tensor = tensor
        self.scaling = scaling
        _watch_optimizers()
        self._cache: Optional[tuple] = None  # (key, all-gather inputs, metadata)
        # uneven rows: (key, padded FP8 rows, padded local scales); local work only (the
        # all-reduced amax and the gathered row scales live on the module: _holder)
        self._rows: Optional[tuple] = None

    def __repr__(self) -> str:
        return f"FP8GatherWeight({self.scaling}, {self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is torch.ops.aten.detach.default:
            return FP8GatherWeight(args[0]._tensor.detach(), args[0].scaling)
        scaling = None

        def unwrap(t):
            nonlocal scaling
            scaling = t.scaling
            return t._tensor

        args, kwargs = pytree.tree_map_only(FP8GatherWeight, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda x: FP8GatherWeight(x, scaling), out)

    def __tensor_flatten__(self):
        return ["_tensor"], self.scaling

    @staticmethod
    def __tensor_unflatten__(inner, scaling, outer_size, outer_stride):
        return FP8GatherWeight(inner["_tensor"], scaling)

    # -- FSDP2's all-gather extension ---------------------------------------------------
    def _global_amax(self, w: torch.Tensor, mesh, holder) -> torch.Tensor:
        generation = (_GENERATION[0], str(w.device))
        held = getattr(holder, "_loka_amax", None)
        if held is not None and held[0] == generation:
            return held[1]
        amax = (w.abs().amax() if w.numel() else w.new_zeros(())).float().reshape(1)
        if mesh is not None and mesh.size() > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        setattr(holder, "_loka_amax", (generation, amax[0]))
        return amax[0]

    def _local_rows(self, use: Optional[Kernel], fmt, padded: int) -> tuple:
        """Uneven rows, rowwise: this shard's FP8 rows and scales, zero-padded (scale 1) to
        ``padded`` rows, once per generation: ``(key, rows, scales)``."""
        key = (_GENERATION[0], None if use is None else use.name, padded)
        if self._rows is not None and self._rows[0] == key:
            return self._rows
        w = self._tensor.detach()
        scales = torch.ones(padded, dtype=torch.float32, device=w.device)
        data = w.new_zeros((0, w.shape[1]), dtype=torch.uint8)
        if w.shape[0]:
            q = _quantize_rows(w, use, fmt)
            data = _bytes(q.data.t())
            scales[:w.shape[0]] = q.scale.reshape(-1).float()
        self._rows = (key, _pad_rows(data, padded), scales)
        return self._rows

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """FP8 rows of this shard (and, rowwise, their scales) as all-gather inputs."""
        kernel = module.kernels[0] if isinstance(module, Linear) else None
        use = kernel if _matches(kernel, self.scaling) else None
        fmt = get_format(use.formats[1] if use is not None else "e4m3")
        w = self._tensor.detach()
        rows = int(outer_size[0]) if outer_size is not None else w.shape[0]
        ranks = mesh.size() if mesh is not None else 1
        padded = -(-rows // ranks)  # FSDP's shard rows: every rank's input has this many
        uneven = rows % ranks != 0
        if self.scaling == "rowwise":
            key = (_GENERATION[0], None if use is None else use.name)
            if self._cache is not None and self._cache[0] == key:
                return self._cache[1], self._cache[2]
            if uneven:
                group = mesh.get_group() if ranks > 1 else None
                full = _gather_row_scales([(self, _holder(module, self), use, fmt, padded)],
                                          group, ranks)[0]
                inputs = (self._local_rows(use, fmt, padded)[1],)
                meta = (module, use, fmt, full[:rows].reshape(rows, 1), rows)
            else:
                q = _quantize_rows(w, use, fmt)
                inputs = (_bytes(q.data.t()), q.scale.reshape(-1, 1).float().contiguous())
                meta = (module, use, fmt, None, rows)
        else:
            amax = self._global_amax(w, mesh, _holder(module, self))
            key = (_GENERATION[0], None if use is None else use.name, float(amax))
            if self._cache is not None and self._cache[0] == key:
                return self._cache[1], self._cache[2]
            probe = torch.stack([amax, torch.zeros_like(amax)]).reshape(2, 1).to(w.device)
            scale = (use.quantize_b(probe).scale if use is not None else
                     quantize(probe, fmt, Granularity.TENSORWISE, "b").scale).reshape(1, 1)
            data = w.new_zeros((0, w.shape[1]), dtype=torch.uint8)
            if w.shape[0]:
                data = _bytes(quantize(w.t(), fmt, Granularity.TENSORWISE, "b", scale=scale,
                                       check_scale=False).data.t())
            inputs = (_pad_rows(data, padded) if uneven else data,)
            meta = (module, use, fmt, scale.float(), rows)
        self._cache = (key, inputs, meta)
        return inputs, meta

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        """The dequantized weight as FSDP's unsharded parameter; the FP8 weight as the
        module's ``weight_q``."""
        module, use, fmt, scale, rows = metadata
        data = outputs[0].view(fmt.dtype)[:rows]  # padded shards: the rows come first
        n, k = data.shape
        if self.scaling == "rowwise":
            row_scale = outputs[1].reshape(-1, 1)[:rows] if len(outputs) > 1 else scale
            q = QTensor(data.t(), row_scale.t(), fmt, (k, 1), Granularity.ROWWISE)
            deq = data.float() * row_scale
        else:
            q = QTensor(data.t(), scale, fmt, (k, n), Granularity.TENSORWISE)
            deq = data.float() * scale
        if isinstance(module, Linear):
            module.weight_q = q if use is not None and _matches(module.kernels[0], self.scaling) \
                else None
        if out is not None:
            # refill the parameter saved for the backward (as FSDP's own copy-out does:
            # the version counter stays, the values are the same weights gathered again)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(deq)
            return None
        deq = deq.to(param_dtype)
        return deq, (deq,)


def fp8_all_gather(model: nn.Module, scaling: str = "rowwise",
                   world_size: Optional[int] = None) -> Dict[str, str]:
    """Make FSDP2 all-gather the weights of ``model``'s FP8 sites in FP8.

    Call it after ``loka.apply(model, plan)`` and before ``fully_shard`` (and before the
    optimizer is built: the weights become new Parameters).

    Args:
        model: the planned model.
        scaling: 'rowwise' (per-output-row scales, no collective of their own) or
            'tensorwise' (one all-reduced amax per weight); sites whose forward kernel has
            another granularity keep a high-precision all-gather.
        world_size: ranks the weights will be sharded over (default: the process group's).

    Returns:
        site -> 'fp8' for the wrapped weights, or why a loka.Linear was not wrapped.
    """
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    size = world()[1] if world_size is None else int(world_size)
    if size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    root, _ = root_module(model)
    out: Dict[str, str] = {}
    for name, mod in root.named_modules():
        if not isinstance(mod, Linear) or mod.weight is None:
            continue
        w = mod.weight
        if hasattr(w, "device_mesh") or type(w).__name__ == "DTensor":
            raise ValueError(f"{name}: the weight is sharded already; call fp8_all_gather "
                             "before fully_shard")
        if isinstance(w, FP8GatherWeight) or isinstance(getattr(w, "data", None), FP8GatherWeight):
            out[name] = "fp8"
            continue
        if not _matches(mod.kernels[0], scaling):
            out[name] = f"forward kernel {mod.config.fwd} is not {scaling} FP8"
        elif size == 1 and scaling == "rowwise":
            # one rank gathers nothing (and FSDP2 takes only the first all-gather input
            # of a one-rank mesh, where rowwise sends two): the forward quantizes itself
            out[name] = "one rank: nothing to all-gather"
        else:
            mod.weight = nn.Parameter(FP8GatherWeight(w.detach(), scaling),
                                      requires_grad=w.requires_grad)
            out[name] = "fp8"
    return out


def _fp8_local(param) -> Optional[FP8GatherWeight]:
    """The shard object FSDP calls (a DTensor's own local tensor: ``to_local()`` returns a
    fresh wrapper, on which a precomputed amax would be lost)."""
    local = getattr(param, "_local_tensor", None)
    if local is None:
        local = param.to_local() if hasattr(param, "to_local") else param
    return local if isinstance(local, FP8GatherWeight) else None


@torch.no_grad()
def precompute_fp8_scales(model: nn.Module) -> int:
    """Every scale the next all-gathers need, in at most one collective of each kind per
    process group (call it on every rank after ``optimizer.step()``): the all-reduced amax
    of every tensorwise FP8-gathered weight (one all-reduce), and the row scales of every
    rowwise weight whose rows do not split evenly over the ranks (one all-gather). The
    all-gathers of the next step then need no collective of their own. Returns the number
    of weights."""
    root, _ = root_module(model)
    tensorwise: Dict[int, list] = {}  # id(group) -> [group, ranks, [(shard, module)]]
    uneven: Dict[int, list] = {}  # id(group) -> [group, ranks, [entry]]
    for mod in root.modules():
        w = getattr(mod, "weight", None) if isinstance(mod, Linear) else None
        local = _fp8_local(w) if w is not None else None
        if local is None:
            continue
        group, ranks = _shard_group(w)
        if local.scaling == "tensorwise":
            tensorwise.setdefault(id(group), [group, ranks, []])[2].append((local, mod))
            continue
        rows = w.shape[0]
        if ranks > 1 and rows % ranks:
            use = mod.kernels[0] if _matches(mod.kernels[0], "rowwise") else None
            fmt = get_format(use.formats[1] if use is not None else "e4m3")
            uneven.setdefault(id(group), [group, ranks, []])[2].append(
                (local, mod, use, fmt, -(-rows // ranks)))
    for group, ranks, entries in uneven.values():
        _gather_row_scales(entries, group, ranks)
    for group, ranks, shards in tensorwise.values():
        amax = torch.stack([(s._tensor.abs().amax() if s._tensor.numel()
                             else s._tensor.new_zeros(())).float() for s, _ in shards])
        if ranks > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        for (s, mod), a in zip(shards, amax):
            setattr(mod, "_loka_amax", ((_GENERATION[0], str(s._tensor.device)), a))
    return sum(len(v[2]) for v in tensorwise.values()) + sum(len(v[2]) for v in uneven.values())


def _shard_group(param) -> Tuple[object, int]:
    """The process group and size of the mesh dimension that shards ``param`` (HSDP: not
    the replicating one), over which FSDP all-gathers it; (None, 1) when not sharded."""
    mesh = getattr(param, "device_mesh", None)
    for dim, placement in enumerate(getattr(param, "placements", ())):
        if placement.is_shard() and mesh.size(dim) > 1:
            return mesh.get_group(dim), mesh.size(dim)
    return None, 1


class CollectiveBytes:
    """Bytes this rank put into all-gathers (``count``: calls; ``seconds``: their time,
    when counted with ``timed=True``) while counting."""

    def __init__(self) -> None:
        self.bytes = 0
        self.count = 0
        self.seconds = 0.0


def _wait(result, device: torch.device) -> None:
    if result is not None and hasattr(result, "wait"):
        result.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def count_all_gather(timed: bool = False) -> Iterator[CollectiveBytes]:
    """Count the input bytes of every ``torch.distributed`` all-gather into one tensor
    (``all_gather_into_tensor``, ``all_gather_single``) of this process: FSDP2's
    all-gathers (functional collectives, such as a DTensor's ``full_tensor()``, are not
    counted).

    ``timed``: also time each all-gather to its end (it waits for the collective and the
    device, so it serializes the step: time steps apart from counted ones)."""
    counter = CollectiveBytes()
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor")
                 if hasattr(dist, name)}

    def wrap(fn):
        def counted(output_tensor, input_tensor, *args, **kwargs):
            counter.bytes += input_tensor.numel() * input_tensor.element_size()
            counter.count += 1
            if not timed:
                return fn(output_tensor, input_tensor, *args, **kwargs)
            _wait(None, input_tensor.device)
            tic = time.perf_counter()
            result = fn(output_tensor, input_tensor, *args, **kwargs)
            _wait(result, input_tensor.device)
            counter.seconds += time.perf_counter() - tic
            return result
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(fn))
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
