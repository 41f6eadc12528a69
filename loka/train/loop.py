"""The training loop shared by the CLI and the benchmarks.

Optimizers (``make_optimizers``): AdamW over every dense parameter (``fused=True`` on CUDA
and on the CPU: one kernel over all parameters instead of a loop over tensors); embedding
tables built with ``sparse=True`` (the paper-scale presets) get ``SparseAdam``, so a step
touches only the rows the batch used rather than every row of the tables; small tables stay
dense under AdamW, which is simpler, and at that size a dense update costs little.
No weight decay by default: a decayed embedding table shrinks rows that a batch did not use.

Checkpoints (``<checkpoint_dir>/checkpoint.pt``, see :mod:`loka.train.checkpoint`) hold the
model, the optimizers, the step, the loss/eval history, the CPU and CUDA RNG states, the
data stream's ``state_dict()`` and the plan the run trains with, so a resumed run continues
exactly where it stopped (bit for bit on the CPU), on the same kernels. They carry a
checksum, are written atomically and loaded with ``torch.load(weights_only=True)``. A run
holds its directory's lock (:class:`~loka.train.checkpoint.RunLock`) and removes the temp
files a killed run left there; a run into a directory that holds a checkpoint must resume
it (:class:`~loka.train.checkpoint.RunExistsError` otherwise).

Plans: ``train(model, ..., plan=plan)`` applies a copy of ``plan`` (``loka.apply``) and arms
a :class:`~loka.dispatch.Guard`, which switches an FP8 site that turns finite values into
non-finite ones (or saturates a static scale) to the baseline for good and skips that
step's update; a plan the caller applied beforehand counts the same (it is not applied
again). Under the Guard a step whose loss or gradients are non-finite is not applied
either (``TrainResult.skipped_steps``). Resuming a run that trained with a plan: without a
plan, the plan recorded in the checkpoint is applied again, with the Guard's fallbacks,
and a note says so; with the plan the run started from, the same; with another plan,
:class:`PlanChangedError`.

Starting points: ``warmup_steps`` ramps the learning rate linearly (wide presets diverge
without one at rates that train narrow ones); ``optimizer_state`` starts a fresh run from
an earlier run's optimizer states (``load_optimizer_states``), so that a run from a
checkpoint's weights continues its Adam moments instead of restarting them.

Length: the loop, its checkpoints, resume, Guard and starting points share one step's
state (optimizers, RNG, data position, plan); split apart, each would pass all of it.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple


import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..data.batch import Batch
from ..dispatch import Guard, GuardEvent, Plan, applied_plan, apply
from .scoring import evaluate, is_infinite
from .checkpoint import (CHECKPOINT_NAME, CheckpointError, RunExistsError, RunLock,
                         read_checkpoint, remove_stale_temp_files, write_checkpoint)

__all__ = ["loss_fn", "make_optimizers", "check_optimizer_states", "load_optimizer_states",
           "train_step", "TrainResult", "PlanChangedError",
           "plan_digest", "checkpoint_plan", "train"]


class PlanChangedError(ValueError):
    """Resuming a run with a plan other than the one it trained with."""


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean binary cross-entropy of ``model(batch)`` (logits (B,)) against ``batch.labels``,
    computed in float32 whatever the model's dtype."""
    logits = model(batch)
    return F.binary_cross_entropy_with_logits(logits.float(), batch.labels.float())


def make_optimizers(model: nn.Module, lr: float, device, weight_decay: float = 0.0
                    ) -> List[torch.optim.Optimizer]:
    """AdamW over dense parameters (fused on CUDA and CPU), plus SparseAdam over the weights of
    embeddings built with ``sparse=True`` (only when there are any)."""
    sparse_ids, sparse = set(), []
    for m in model.modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and id(m.weight) not in sparse_ids:
            sparse_ids.add(id(m.weight))
            sparse.append(m.weight)
    dense = [p for p in model.parameters() if p.requires_grad and id(p) not in sparse_ids]
    opts: List[torch.optim.Optimizer] = []
    if dense:
        opts.append(torch.optim.AdamW(dense, lr=lr, weight_decay=weight_decay,
                                      fused=torch.device(device).type in ("cuda", "cpu")))
    if sparse:
        opts.append(torch.optim.SparseAdam(sparse, lr=lr))
    return opts


def check_optimizer_states(optimizers: Sequence[torch.optim.Optimizer],
                           states: Sequence[Mapping[str, Any]]) -> None:
    """ValueError (one line) unless ``states`` (one ``state_dict()`` per optimizer) were made
    for these optimizers' parameters: the same count of optimizers, of parameters in each,
    and every moment of a parameter's shape."""
    states = list(states)
    if len(states) != len(optimizers):
        raise ValueError(f"optimizer_state holds {len(states)} optimizer state(s); this model "
                         f"trains with {len(optimizers)}")
    for i, (opt, st) in enumerate(zip(optimizers, states)):
        if not isinstance(st, Mapping) or "state" not in st or "param_groups" not in st:
            raise ValueError(f"optimizer_state[{i}] is not an optimizer state_dict()")
        params = [p for g in opt.param_groups for p in g["params"]]
        ids = [j for g in st["param_groups"] for j in g.get("params", ())]
        if len(ids) != len(params):
            raise ValueError(f"optimizer_state[{i}] is for {len(ids)} parameter(s); this "
                             f"model's optimizer {i} has {len(params)}")
        for j, p in zip(ids, params):
            for key, t in (st["state"].get(j) or {}).items():
                if torch.is_tensor(t) and t.dim() and t.shape != p.shape:
                    raise ValueError(f"optimizer_state[{i}]: {key} of parameter {j} has shape "
                                     f"{tuple(t.shape)}, the parameter {tuple(p.shape)}")


def load_optimizer_states(optimizers: Sequence[torch.optim.Optimizer],
                          states: Sequence[Mapping[str, Any]]) -> None:
    """Load the moments and step counts of ``states`` (one ``state_dict()`` per optimizer)
    into ``optimizers``, after :func:`check_optimizer_states`; every hyperparameter (lr,
    betas, weight decay, fused, ...) stays this run's, not the saved run's. ``states`` are
    copied, never stepped in place."""
    check_optimizer_states(optimizers, states)
    for opt, st in zip(optimizers, states):
        mine = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        # a copy: the optimizer may keep the given tensors and step them in place, which
        # would change the caller's states for the next run that starts from them
        opt.load_state_dict(copy.deepcopy(st))
        for group, hyper in zip(opt.param_groups, mine):
            group.update(hyper)


def train_step(model: nn.Module, batch: Batch, optimizers: List[torch.optim.Optimizer],
               autocast_bf16: bool = False) -> torch.Tensor:
    """One step: forward, BCE, backward, every optimizer. Returns the loss (no host sync)."""
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        loss = loss_fn(model, batch)
    loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach()


@dataclass
class TrainResult:
    """What a :func:`train` run produced."""

    losses: List[float] = field(default_factory=list)
    """training loss of every step, from step 1 (including steps before a resume)"""
    eval_history: List[Dict[str, float]] = field(default_factory=list)
    """dict(step, ne, auc, logloss, ...) per evaluation"""
    final: Dict[str, float] = field(default_factory=dict)
    """final evaluation (when ``eval_iter`` is given), else the running training NE"""
    samples_per_s: float = 0.0
    """training throughput of this invocation (evaluation excluded)"""
    steps: int = 0
    """steps completed"""
    resumed_from: Optional[int] = None
    """the checkpoint step this run resumed from, if any"""
    plan: Optional[Plan] = None
    """the plan the run trained with, as it stands at the end (the Guard's switches are in
    its ``fallbacks``); None without a plan"""
    guard_events: List[GuardEvent] = field(default_factory=list)
    """the sites the Guard switched to the baseline in this invocation"""
    skipped_steps: List[int] = field(default_factory=list)
    """steps of this invocation whose update the Guard skipped (a non-finite loss or
    gradient, or a site switched on that step)"""
    notes: List[str] = field(default_factory=list)
    """what the run did that the caller did not ask for (a plan re-applied from the
    checkpoint, a dead run's lock taken over, its temp files removed)"""


def _entropy(ctr: float) -> float:
    if not 0.0 < ctr < 1.0:
        return float("nan")
    return -(ctr * math.log(ctr) + (1 - ctr) * math.log1p(-ctr))


def plan_digest(plan: Plan) -> str:
    """``"sha256:<hex>"`` of a plan's JSON: the same for a plan and its saved copy."""
    text = json.dumps(plan.to_dict(), sort_keys=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def _recorded_plan(path: str, state: Dict[str, Any]) -> Optional[Tuple[Plan, str]]:
    """The plan a checkpoint recorded and the digest of the plan its run started from."""
    record = state.get("plan")
    if record is None:
        return None
    try:
        return Plan.from_dict(json.loads(record["json"])), str(record["digest"])
    except (TypeError, KeyError, ValueError) as e:  # a ReportError or a JSON error too
        raise CheckpointError(f"{path}: its recorded plan is not readable ({e})") from None


def checkpoint_plan(path: str, state: Dict[str, Any]) -> Optional[Plan]:
    """The plan a checkpoint's run trained with (``state``: the checkpoint read from
    ``path``), or None when it trained without one."""
    recorded = _recorded_plan(path, state)
    return None if recorded is None else recorded[0]


def _fp8_summary(plan: Plan) -> str:
    return (f"{len(plan.fp8_sites())} FP8 site(s)"
            + (f", {len(plan.fallbacks)} switched to {plan.baseline} by the Guard"
               if plan.fallbacks else ""))


def _grads_finite(optimizers: List[torch.optim.Optimizer]) -> Optional[torch.Tensor]:
    """Whether every gradient is finite, as a tensor on the device (no host sync)."""
    grads = [p.grad for opt in optimizers for group in opt.param_groups for p in group["params"]
             if p.grad is not None]
    grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
    if not grads:
        return None
    return torch.isfinite(torch.nn.utils.get_total_norm(grads, norm_type=math.inf))


def train(model: nn.Module, data_iter: Iterable[Batch], steps: int, *, lr: float = 1e-3,
          device="cpu", eval_iter: Optional[Iterable[Batch]] = None, eval_every: int = 0,
          eval_steps: Optional[int] = None, checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0,
          resume: bool = False, seed: int = 0, autocast_bf16: Optional[bool] = None,
          progress: bool = True, log_fn: Optional[Callable[[Dict[str, Any]], None]] = None,
          weight_decay: float = 0.0, plan: Optional[Plan] = None, guard: bool = True,
          guard_every: Optional[int] = 100, warmup_steps: int = 0,
          optimizer_state: Optional[Sequence[Mapping[str, Any]]] = None) -> TrainResult:
    """Train ``model`` for ``steps`` steps (total, counting steps before a resume).

    Args:
        model: ``forward(batch) -> logits (B,)``; moved to ``device``.
        data_iter: iterable of :class:`Batch`; if it has ``state_dict``/``load_state_dict``
            (``SyntheticCTR``, ``CriteoReader``) its position is checkpointed.
        steps: total steps.
        lr: learning rate of every optimizer.
        device: where to train.
        eval_iter: held-out batches; if it has ``state_dict`` it is rewound before every
            evaluation, so every evaluation sees the same batches.
        eval_every: evaluate every this many steps (0: only at the end); eval_steps: batches
            per evaluation (None: all of ``eval_iter``, once; an infinite stream needs a
            number). A resumed run that has nothing left to train evaluates again, so its
            ``final`` is the finished run's.
        checkpoint_dir: where ``checkpoint.pt`` goes (None: no checkpoints); the run locks
            it. checkpoint_every: every this many steps (0: only at the end).
        resume: continue from ``checkpoint_dir/checkpoint.pt`` when it exists (without
            ``resume`` an existing checkpoint is an error, not overwritten).
        seed: seeds torch's RNG at the start of a fresh run.
        autocast_bf16: bf16 autocast of forward and loss; None: on for CUDA, off otherwise.
        progress: a tqdm bar with throughput and running NE.
        log_fn: called with dict(event="train", step, loss, ne_running, samples_per_s)
            every 50 steps, with the evaluation dict (event="eval") after each evaluation,
            dict(event="guard", step, site, reason) for each site the Guard switches and
            dict(event="note", message) for each of ``TrainResult.notes``.
        weight_decay: AdamW's decoupled weight decay.
        plan: train with this plan: a copy is applied to the model, recorded in the
            checkpoints and watched by the Guard (see the module docstring). None: the plan
            the caller applied, if any, or the one a resumed checkpoint recorded.
        guard: arm a :class:`~loka.dispatch.Guard` when the run has a plan.
        guard_every: the Guard's ``check_every`` (None: only after a non-finite loss).
        warmup_steps: step k (1-based, counted across a resume) updates at
            ``lr * min(1, k / warmup_steps)``: a linear rise to ``lr`` over the first
            ``warmup_steps`` steps. The rate is set from this call's ``lr`` and
            ``warmup_steps`` at every step, so a resumed run follows the schedule it is
            resumed with. Wide models diverge without a warm-up at rates that train narrow
            ones well.
        optimizer_state: a fresh run's starting optimizer states, one per optimizer
            (``[opt.state_dict() for opt in optimizers]`` of an earlier run of this model,
            e.g. a checkpoint's ``"optimizers"``): with the weights of that run it continues
            it rather than restarting Adam's moments; the hyperparameters stay this run's
            (:func:`load_optimizer_states`). A resumed run takes its checkpoint's instead.

    Returns:
        TrainResult.

    Raises:
        CheckpointError: the checkpoint to resume is empty, damaged or not LoKA's.
        RunInUseError: another live run holds ``checkpoint_dir``.
        RunExistsError: ``checkpoint_dir`` holds a checkpoint and ``resume`` is False.
        PlanChangedError: resuming a run with another plan than it trained with.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs a checkpoint_dir")
    if eval_iter is not None and eval_steps is None and is_infinite(eval_iter):
        raise ValueError("eval_iter never ends: give eval_steps, the batches per evaluation")
    result = TrainResult()

    def note(message: str) -> None:
        result.notes.append(message)
        if log_fn:
            log_fn({"event": "note", "message": message})

    lock = RunLock(checkpoint_dir) if checkpoint_dir else contextlib.nullcontext()
    with lock:
        if checkpoint_dir:
            if lock.takeover_note:
                note(lock.takeover_note)
            stale = remove_stale_temp_files(checkpoint_dir)
            if stale:
                note(f"removed {len(stale)} temp file(s) a killed run left in "
                     f"{checkpoint_dir}: {', '.join(stale)}")
        return _train(model, data_iter, steps, result, note, lr=lr, device=device,
                      eval_iter=eval_iter, eval_every=eval_every, eval_steps=eval_steps,
                      checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                      resume=resume, seed=seed, autocast_bf16=autocast_bf16, progress=progress,
                      log_fn=log_fn, weight_decay=weight_decay, plan=plan, guard=guard,
                      guard_every=guard_every, warmup_steps=warmup_steps,
                      optimizer_state=optimizer_state)


def _train(model, data_iter, steps, result: TrainResult, note: Callable[[str], None], *, lr,
           device, eval_iter, eval_every, eval_steps, checkpoint_dir, checkpoint_every, resume,
           seed, autocast_bf16, progress, log_fn, weight_decay, plan, guard,
           guard_every, warmup_steps=0, optimizer_state=None) -> TrainResult:
    """:func:`train` holding the run directory's lock."""
    device = torch.device(device)
    use_autocast = device.type == "cuda" if autocast_bf16 is None else bool(autocast_bf16)
    ckpt_path = os.path.join(checkpoint_dir, CHECKPOINT_NAME) if checkpoint_dir else None
    state = None
    if ckpt_path and os.path.exists(ckpt_path):
        if not resume:
            raise RunExistsError(f"{checkpoint_dir} already holds a run's checkpoint "
                                 f"({ckpt_path}); resume it (resume=True) or train into "
                                 "another directory")
        state = read_checkpoint(ckpt_path, map_location=device)
        if state["step"] > 0 and len(state["losses"]) != state["step"]:
            raise CheckpointError(f"{ckpt_path}: not a LoKA checkpoint ({len(state['losses'])} "
                                  f"losses for step {state['step']})")

    # the plan of the run: given, applied by the caller, or recorded in the checkpoint
    run_plan, to_apply, digest = None, None, None
    mine = plan if plan is not None else applied_plan(model)
    recorded = _recorded_plan(ckpt_path, state) if state is not None else None
    if recorded is not None:
        run_plan, digest = recorded
        if mine is None:
            note(f"resuming with the plan recorded in the checkpoint ({_fp8_summary(run_plan)})")
        elif plan_digest(mine) != digest:
            raise PlanChangedError(f"{ckpt_path}: this run trained with another plan "
                                   f"({digest[:15]}..., not {plan_digest(mine)[:15]}...); "
                                   "resume it without a plan to continue with its own")
        to_apply = run_plan
    elif mine is not None:
        digest = plan_digest(mine)
        if plan is not None:
            run_plan = to_apply = plan.copy()  # the Guard's switches leave the caller's as it is
        else:
            run_plan = mine  # applied by the caller: trained as applied, not applied again
        if state is not None:
            note(f"the checkpoint trained without a plan; from step {state['step']} on with "
                 f"this one ({_fp8_summary(run_plan)})")
    model.to(device)
    if to_apply is not None:
        apply(model, to_apply)
    model.train()
    optimizers = make_optimizers(model, lr, device, weight_decay)
    start = 0
    if state is not None:
        model.load_state_dict(state["model"])
        if len(state["optimizers"]) != len(optimizers):
            raise CheckpointError(f"{ckpt_path}: its optimizers do not match this model's")
        for opt, s in zip(optimizers, state["optimizers"]):
            opt.load_state_dict(s)
        torch.set_rng_state(state["rng_cpu"].cpu())
        if torch.cuda.is_available() and state.get("rng_cuda"):
            torch.cuda.set_rng_state_all([s.cpu() for s in state["rng_cuda"]])
        start = int(state["step"])
        result.losses = list(state["losses"])
        result.eval_history = [dict(e) for e in state["eval_history"]]
        result.resumed_from = start
        if state.get("data") is not None:
            if not hasattr(data_iter, "load_state_dict"):
                raise ValueError("checkpoint holds a data position but data_iter has no "
                                 "load_state_dict(); pass the same kind of stream")
            data_iter.load_state_dict(state["data"])
        else:  # a stateless iterable: replay it to the checkpoint's position
            data_iter = iter(data_iter)
            for _ in range(start):
                next(data_iter)
    else:
        if optimizer_state is not None:
            load_optimizer_states(optimizers, optimizer_state)
        torch.manual_seed(seed)
    if state is not None and optimizer_state is not None:
        note("resumed from the checkpoint's own optimizer states; optimizer_state was not "
             "used")
    result.plan = run_plan
    watch = Guard(model, run_plan, check_every=guard_every) if run_plan is not None and guard \
        else None
    if watch is not None:
        watch.step_index = start + 1  # the Guard's step numbers are the run's

    eval_state = eval_iter.state_dict() if hasattr(eval_iter, "state_dict") else None
    stream = iter(data_iter)
    pending: List[torch.Tensor] = []          # losses not yet copied to the host
    window = deque(maxlen=200)                # (loss, batch size, positives) for running NE
    samples, train_time = 0, 0.0

    def flush() -> None:
        if pending:
            result.losses.extend(torch.stack(pending).tolist())
            pending.clear()

    def running_ne() -> float:
        finite = [(l, b, p) for l, b, p in window if math.isfinite(l)]
        n = sum(b for _, b, _ in finite)
        if not n:
            return float("nan")
        ll = sum(l * b for l, b, _ in finite) / n
        return ll / _entropy(sum(p for _, _, p in finite) / n)

    def run_eval(step: int) -> Dict[str, float]:
        if eval_state is not None:
            eval_iter.load_state_dict(eval_state)
        m = evaluate(model, eval_iter, eval_steps, device=device, autocast_bf16=use_autocast)
        m = {"step": step, **m}
        result.eval_history.append(m)
        if log_fn:
            log_fn(dict(m, event="eval"))
        return m

    def checkpoint(step: int) -> None:
        flush()
        write_checkpoint(ckpt_path, {
            "model": model.state_dict(),
            "optimizers": [o.state_dict() for o in optimizers],
            "step": step,
            "losses": list(result.losses),
            "eval_history": [dict(e) for e in result.eval_history],
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "data": data_iter.state_dict() if hasattr(data_iter, "state_dict") else None,
            "plan": None if run_plan is None else {"json": json.dumps(run_plan.to_dict()),
                                                   "digest": digest},
        })

    def guarded_update(batch: Batch, loss: torch.Tensor, step: int) -> None:
        """The Guard's check of this step (loss and gradients), then the update or not."""
        finite = _grads_finite(optimizers)
        health = loss if finite is None else torch.where(finite, loss, loss.new_tensor(math.nan))

        def recheck() -> None:  # the same forward and backward, with the sites watched
            with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=use_autocast):
                again = loss_fn(model, batch)
            again.backward()

        seen = len(watch.events)
        if watch.step(health, recheck=recheck):
            for opt in optimizers:
                opt.step()
        else:
            result.skipped_steps.append(step)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        for event in watch.events[seen:]:
            result.guard_events.append(event)
            if log_fn:
                log_fn({"event": "guard", "step": event.step, "site": event.site,
                        "reason": event.reason})

    bar = tqdm(total=steps, initial=min(start, steps), disable=not progress, unit="step",
               dynamic_ncols=True)
    step = start
    tic = time.perf_counter()
    try:
        for step in range(start + 1, steps + 1):
            try:
                batch = next(stream)
            except StopIteration:
                step -= 1
                break
            batch = batch.to(device, non_blocking=True)
            step_lr = lr * min(1.0, step / warmup_steps) if warmup_steps else lr
            for opt in optimizers:  # every step: a resumed run follows this call's schedule
                for group in opt.param_groups:
                    group["lr"] = step_lr
            if watch is None:
                loss = train_step(model, batch, optimizers, use_autocast)
            else:
                with torch.autocast(batch.device.type, dtype=torch.bfloat16,
                                    enabled=use_autocast):
                    loss = loss_fn(model, batch)
                loss.backward()
                loss = loss.detach()
                guarded_update(batch, loss, step)
            pending.append(loss)
            samples += batch.batch_size
            window.append((loss, batch.batch_size, batch.labels.sum()))
            if step % 50 == 0 or step == steps:
                window_host = [(float(l), b, float(p)) for l, b, p in window]
                window.clear()
                window.extend(window_host)
                rate = samples / max(time.perf_counter() - tic, 1e-9)
                ne = running_ne()
                bar.set_postfix(samples_s=f"{rate:,.0f}", ne=f"{ne:.4f}")
                if log_fn:
                    log_fn({"event": "train", "step": step, "loss": float(loss),
                            "ne_running": ne, "samples_per_s": rate})
            bar.update(1)
            if eval_iter is not None and eval_every and step % eval_every == 0 and step < steps:
                train_time += time.perf_counter() - tic
                run_eval(step)
                tic = time.perf_counter()
            if ckpt_path and checkpoint_every and step % checkpoint_every == 0:
                checkpoint(step)
    finally:
        bar.close()
        if watch is not None:
            watch.close()
    train_time += time.perf_counter() - tic
    flush()
    window = deque([(float(l), b, float(p)) for l, b, p in window], maxlen=200)
    result.steps = step
    result.samples_per_s = samples / train_time if samples else 0.0
    # the final checkpoint is written before the final evaluation, so that a resumed run's
    # eval history matches an uninterrupted one
    if ckpt_path and step > start and not (checkpoint_every and step % checkpoint_every == 0):
        checkpoint(step)
    if eval_iter is not None:
        # also when a resumed run had nothing left to train: the checkpoint holds the model
        # its final evaluation scored, so scoring it again gives the same figures
        result.final = run_eval(step)
    else:
        result.final = {"step": step, "ne_running": running_ne()}
    return result
