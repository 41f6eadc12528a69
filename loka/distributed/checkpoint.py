"""Checkpoints of data-parallel training through ``torch.distributed.checkpoint``: every
rank writes its shards, and a checkpoint saved on N ranks loads on M (DCP reshards), with
FSDP2 (DTensor parameters), DDP or a single process alike.

Beside the shards, rank 0 writes the plan (``plan.json``) and the Probe's report
(``probe_report.json``) as validated JSON; :func:`load` reads them back. FP8-gathered
weights (:func:`~loka.distributed.fp8_gather.fp8_all_gather`) and the optimizer states
shaped like them are saved as the plain tensors they hold, so a checkpoint loads with or
without the FP8 all-gather (and with ``weights_only`` unpickling).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from ..dispatch import Plan
from ..probe import ProbeReport
from .agree import collective_device, world
from .fp8_gather import FP8GatherWeight, weights_changed

__all__ = ["save", "load", "Loaded", "PLAN_FILE", "REPORT_FILE"]

PLAN_FILE = "plan.json"
REPORT_FILE = "probe_report.json"


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when there is no process group: here that
    is the intent (a checkpoint of one process loads on N ranks like any other)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _plain(value):
    """State with FP8-gathered weights (and the optimizer states shaped like them) as
    the plain tensors inside, sharing their storage: the checkpoint holds ordinary
    tensors, and loading writes into the weights themselves."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    local = value.to_local() if hasattr(value, "device_mesh") else None
    if isinstance(local, FP8GatherWeight):
        return DTensor.from_local(local._tensor, value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, FP8GatherWeight):
        return value._tensor
    return value


def save(path: "str | os.PathLike", model: nn.Module, optimizer=None, *,
         plan: Optional[Plan] = None, report: Optional[ProbeReport] = None) -> pathlib.Path:
    """Save ``model`` (and ``optimizer``) as a DCP checkpoint at the directory ``path``,
    with ``plan`` and ``report`` beside it. A collective: every rank calls it, and every
    rank raises when rank 0 cannot write the plan or the report."""
    path = pathlib.Path(path)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a loka.Plan, got {type(plan).__name__}")
    if report is not None and not isinstance(report, ProbeReport):
        raise TypeError(f"report must be a loka.ProbeReport, got {type(report).__name__}")
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    state = _plain(state)
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    rank, size = world()
    error = None
    if rank == 0:
        try:
            if plan is not None:
                plan.save(path / PLAN_FILE)
            if report is not None:
                report.save(path / REPORT_FILE)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
    if size > 1:  # rank 0's outcome reaches every rank: none waits for a rank that failed
        failed = torch.tensor([0.0 if error is None else 1.0], device=collective_device())
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        dist.barrier()  # the last collective, as before (a destroy_process_group may follow)
        if failed.item() > 0 and error is None:
            raise RuntimeError(f"rank 0 could not write the plan or report beside the "
                               f"checkpoint at {path} (rank 0 raised why)")
    if error is not None:
        raise error
    return path


@dataclass
class Loaded:
    """What :func:`load` read besides the weights."""

    plan: Optional[Plan]
    report: Optional[ProbeReport]


def load(path: "str | os.PathLike", model: nn.Module, optimizer=None) -> Loaded:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``),
    whatever the number of ranks that saved it. A collective: every rank calls it.

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: the checkpoint does not hold this model's (or optimizer's) state, or
            its plan or report is not valid JSON of its kind.
    """
    path = pathlib.Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"no distributed checkpoint at {path} (no .metadata file)")
    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    state = _plain(state)
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except (Exception, dcp.api.CheckpointException) as e:  # noqa: BLE001 - say what failed
        lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
        errors = [ln for ln in lines if "Error" in ln.split(":")[0]]
        first = (errors[-1] if errors else (lines or [type(e).__name__])[0])[:300]
        raise ValueError(f"cannot load the checkpoint at {path}: {first}") from e
    set_model_state_dict(model, state["model"])
    weights_changed()  # FP8 shards quantized from the weights before the load are stale
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    plan = Plan.load(path / PLAN_FILE) if (path / PLAN_FILE).is_file() else None
    report = ProbeReport.load(path / REPORT_FILE) if (path / REPORT_FILE).is_file() else None
    return Loaded(plan, report)
