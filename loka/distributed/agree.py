"""One plan for all ranks: statistics reduced across ranks, the plan made once and
broadcast, every rank checked to run the same plan, and the Guard's decisions agreed.

Every function here is a collective: each rank of ``group`` calls it at the same point.
Without an initialized process group they act on this process alone (world size 1).
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..dispatch import Plan
from ..probe import Probe

__all__ = ["PlanDivergenceError", "world", "collective_device", "broadcast_plan", "plan_once",
           "plan_fingerprint", "check_same_plan", "reduce_probe", "RankAgreement"]


class PlanDivergenceError(RuntimeError):
    """Ranks hold different plans (or different Probe sites)."""


def world(group=None) -> tuple:
    """(rank, world size) in ``group``; (0, 1) without an initialized process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def collective_device(group=None) -> torch.device:
    """Where tensors for collectives of ``group`` live: the current CUDA device for NCCL,
    else the CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _src_global(src: int, group) -> int:
    return src if group is None else dist.get_global_rank(group, src)


def broadcast_plan(plan: Optional[Plan], src: int = 0, group=None) -> Plan:
    """Rank ``src``'s plan on every rank (as JSON: what every rank gets is what
    ``Plan.from_dict`` validates). Other ranks may pass None; if rank ``src`` passes no
    Plan, every rank raises TypeError."""
    rank, size = world(group)
    bad = None
    if rank == src and not isinstance(plan, Plan):
        bad = f"broadcast_plan: rank {src} must pass a loka.Plan, got {type(plan).__name__}"
    if size == 1:
        if bad is not None:
            raise TypeError(bad)
        return plan
    # the error travels with the broadcast: every rank raises it instead of waiting
    box = [json.dumps(plan.to_dict()) if rank == src and bad is None else None, bad]
    dist.broadcast_object_list(box, src=_src_global(src, group), group=group)
    if box[1] is not None:
        raise TypeError(box[1])
    return Plan.from_dict(json.loads(box[0]))


def plan_once(make: Callable[[], Plan], src: int = 0, group=None) -> Plan:
    """Call ``make()`` on rank ``src`` only (its Probe report, its timings) and give every
    rank the plan it returns. An exception on ``src`` is raised on every rank."""
    rank, size = world(group)
    plan, error = None, None
    if rank == src:
        try:
            plan = make()
            if not isinstance(plan, Plan):
                raise TypeError(f"plan_once: make() returned {type(plan).__name__}, not a loka.Plan")
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            error = e
    if size == 1:
        if error is not None:
            raise error
        return plan
    first = (str(error).strip().splitlines() or [""])[0] if error is not None else ""
    box = [json.dumps(plan.to_dict()) if plan is not None else None,
           None if error is None else f"{type(error).__name__}: {first}"]  # one line
    dist.broadcast_object_list(box, src=_src_global(src, group), group=group)
    if box[1] is not None:
        if error is not None:
            raise error
        raise RuntimeError(f"making the plan failed on rank {src}: {box[1]}")
    return Plan.from_dict(json.loads(box[0]))


def plan_fingerprint(plan: Plan) -> str:
    """SHA-256 of the plan's JSON without its creation time: equal for plans that run the
    same kernels with the same fallbacks, budget and notes."""
    d = plan.to_dict()
    d.pop("created", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def _site_kernels(plan: Plan) -> Dict[str, dict]:
    return {s: plan.config(s).to_dict() for s in plan.sites}


def check_same_plan(plan: Plan, group=None) -> None:
    """Raise :class:`PlanDivergenceError` unless every rank of ``group`` holds this same
    plan; the error names the ranks that differ from rank 0 and a few sites where. A rank
    that passes something else raises TypeError, and every other rank this error."""
    bad = None if isinstance(plan, Plan) else \
        f"check_same_plan needs a loka.Plan, got {type(plan).__name__}"
    rank, size = world(group)
    if size == 1:
        if bad is not None:
            raise TypeError(bad)
        return
    # a rank without a plan still joins the gather, so that no rank waits for it
    mine = None if bad is not None else (plan_fingerprint(plan), _site_kernels(plan))
    gathered: List = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    if bad is not None:
        raise TypeError(bad)
    missing = [r for r, g in enumerate(gathered) if g is None]
    if missing:
        raise PlanDivergenceError(f"ranks {missing} passed no loka.Plan to check_same_plan")
    ref_print, ref_sites = gathered[0]
    differ = [r for r, (fp, _) in enumerate(gathered) if fp != ref_print]
    if not differ:
        return
    where = []
    for r in differ:
        sites = gathered[r][1]
        diff = sorted(s for s in set(sites) | set(ref_sites) if sites.get(s) != ref_sites.get(s))
        where.append(f"rank {r}: " + (", ".join(diff[:4]) + (" ..." if len(diff) > 4 else "")
                                      if diff else "same kernels, other budget/fallbacks/notes"))
    raise PlanDivergenceError(f"ranks {differ} hold a different plan than rank 0 "
                              f"({'; '.join(where)}); broadcast one plan (loka.distributed."
                              "plan_once or broadcast_plan) and apply it on every rank")


def reduce_probe(probe: Probe, group=None) -> Probe:
    """Merge every rank's Probe statistics into each rank's ``probe`` (in place): each
    rank saw its own rows, and after this every rank holds the statistics of all of them,
    merged in rank order, so that all ranks hold the same numbers. Weight models are
    rank 0's (the ranks' weights are the same); operand rows captured for
    ``source='captured'`` stay each rank's own."""
    rank, size = world(group)
    if size == 1:
        return probe
    names = list(probe.sites)
    portable = {n: probe.sites[n].to("cpu") for n in names}
    gathered: List = [None] * size
    dist.all_gather_object(gathered, portable, group=group)
    ref = list(gathered[0])
    differ = [r for r, g in enumerate(gathered) if list(g) != ref]
    if differ:
        raise PlanDivergenceError(f"ranks {differ} probe other sites than rank 0: every rank "
                                  "must probe the same model with the same module_filter")
    for name in names:
        device = next((t.device for t in (probe.modules[name].weight,) if t is not None),
                      torch.device("cpu"))
        device = torch.device("cpu") if device.type == "meta" else device
        merged = gathered[0][name]
        for r in range(1, size):
            merged.merge(gathered[r][name])
        merged.name = name
        own = probe.sites[name]
        probe.sites[name] = merged.to(device)
        # operand rows captured for source='captured' do not travel: keep this rank's own
        probe.sites[name].captured_x, probe.sites[name].captured_dy = own.captured_x, \
            own.captured_dy
    return probe


class RankAgreement:
    """The Guard's agreement across the ranks of ``group`` (see
    :class:`loka.dispatch.guard.Agreement`): pass it as ``Guard(..., agreement=...)``."""

    def __init__(self, group=None) -> None:
        self.group = group

    def any(self, flag: bool) -> bool:
        _, size = world(self.group)
        if size == 1:
            return bool(flag)
        t = torch.tensor([1.0 if flag else 0.0], device=collective_device(self.group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item() > 0)

    def union(self, failing: Dict[str, str]) -> Dict[str, str]:
        rank, size = world(self.group)
        if size == 1:
            return dict(failing)
        gathered: List = [None] * size
        dist.all_gather_object(gathered, dict(failing), group=self.group)
        out: Dict[str, str] = {}
        for r, part in enumerate(gathered):
            for site, reason in part.items():
                out.setdefault(site, f"{reason} (rank {r})")
        return out
