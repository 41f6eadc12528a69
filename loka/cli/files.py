"""The files the ``loka`` commands read: reports, plans, training curves and checkpoints,
their usual failures (missing, a directory, not JSON, another kind of file, another model's
weights, a damaged checkpoint, a kernel this installation does not have) turned into
one-line :class:`~loka.cli.args.CliError` with a hint."""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import nn

from ..dispatch import Plan
from ..jsonio import ReportError
from ..probe.report import ProbeReport
from ..reporting import load
from ..train import CHECKSUM_KEY, CheckpointError, verify_checkpoint
from .args import CliError, kernel_hint, unknown_kernels

__all__ = ["PROBE_HINT", "PLAN_HINT", "CURVES_HINT", "CHECKPOINT_HINT", "DAMAGED_HINT",
           "load_report", "load_plan", "check_plan_kernels", "load_any", "load_curves",
           "load_checkpoint", "read_checkpoint_file", "load_weights"]

PROBE_HINT = "make one with 'loka probe wukong --preset tiny -o report.json'"
PLAN_HINT = "make one with 'loka plan report.json -o plan.json'"
CURVES_HINT = "the demo writes curves.json"
CHECKPOINT_HINT = "loka train --out DIR writes DIR/checkpoint.pt"
DAMAGED_HINT = ("restore the file from a copy, or start the run again in another --out; "
                "nothing was loaded from it")


def _load_file(load_fn: Callable[[str], Any], path: str, kind: str,
               hints: Tuple[Optional[str], Optional[str], Optional[str]]):
    """``load_fn(path)``, its usual failures turned into one-line CliErrors; ``hints`` for a
    missing file, a directory, and a file that is not a valid ``kind`` file."""
    missing, directory, invalid = hints
    try:
        return load_fn(path)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file", missing) from None
    except IsADirectoryError:
        raise CliError(f"{path} is a directory, not a {kind} file", directory) from None
    except ReportError as e:
        raise CliError(str(e).replace(": not a ", " is not a ", 1), invalid) from None


def load_report(path: str) -> ProbeReport:
    """A Probe report (``loka probe``)."""
    return _load_file(ProbeReport.load, path, "report", (PROBE_HINT,) * 3)


def load_plan(path: str) -> Plan:
    """A plan (``loka plan``)."""
    return _load_file(Plan.load, path, "plan", (PLAN_HINT,) * 3)


def check_plan_kernels(plan: Plan, path: str) -> None:
    """Every kernel ``plan`` names is registered here (else one line with the nearest
    names: a plan from another installation, or edited by hand)."""
    for site, sp in plan.sites.items():
        for role, choice in sp.roles.items():
            unknown = unknown_kernels([choice.kernel])
            if unknown:
                raise CliError(f"{path}: unknown kernel {choice.kernel!r} ({site} {role})",
                               kernel_hint(unknown))


def load_any(path: str):
    """A Probe report or a plan, by the file's schema."""
    return _load_file(load, path, "report or plan",
                      (f"{PROBE_HINT}, or {PLAN_HINT}", None,
                       "pass a report.json (loka probe) or a plan.json (loka plan)"))


def load_curves(path: str) -> Dict[str, Any]:
    """Training curves: ``{arm: {train: {step, loss}, eval: {step, ne}}}``, alone or under
    ``arms`` (the demo's curves.json), every series of an arm's part of one length."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file", CURVES_HINT) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CliError(f"{path}: not valid JSON ({e})", CURVES_HINT) from None
    arms = data.get("arms", data) if isinstance(data, dict) else None
    bad = not isinstance(arms, dict) or not arms
    for arm in (arms.values() if not bad else ()):
        for part in ("train", "eval"):
            series = arm.get(part, {}) if isinstance(arm, dict) else None
            if not isinstance(series, dict) or not all(isinstance(v, list) for v in series.values()) \
                    or len({len(v) for v in series.values()}) > 1:
                bad = True
    if bad:
        raise CliError(f"{path}: not a curves file (expected {{arm: {{train: {{step, loss}}, "
                       "eval: {step, ne}}}}, series of equal length)", CURVES_HINT)
    return data


def read_checkpoint_file(path: str) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """The weights in ``path`` (a ``loka train`` checkpoint.pt, its checksum verified, or a
    bare state dict) and, for a ``loka train`` checkpoint, the whole checkpoint.

    Returns:
        ``(model_state_dict, checkpoint or None)``.
    """
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CliError(f"{path}: no such file", CHECKPOINT_HINT) from None
    except IsADirectoryError:
        raise CliError(f"{path} is a directory, not a checkpoint", CHECKPOINT_HINT) from None
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CliError(f"{path}: not a loadable checkpoint ({type(e).__name__})",
                       CHECKPOINT_HINT) from None
    full = None
    if isinstance(state, dict) and CHECKSUM_KEY in state:
        try:
            full = state = verify_checkpoint(path, state)
        except CheckpointError as e:
            raise CliError(str(e), DAMAGED_HINT) from None
    weights = state.get("model", state) if isinstance(state, dict) else state
    return weights, full


def load_weights(model: nn.Module, weights: Dict[str, Any], path: str) -> None:
    """``model.load_state_dict(weights)``; another model's weights are a one-line error."""
    try:
        model.load_state_dict(weights)
    except (RuntimeError, TypeError, AttributeError) as e:
        raise CliError(f"{path} holds another model's weights ({str(e).splitlines()[0].strip()})",
                       "pass the --model/--preset/--mods the checkpoint was trained with") from None


def load_checkpoint(model: nn.Module, path: str) -> None:
    """Load the weights of ``path`` (a ``loka train`` checkpoint.pt, its checksum verified,
    or a bare state dict) into ``model``."""
    weights, _ = read_checkpoint_file(path)
    load_weights(model, weights, path)
