"""The training loop shared by the CLI and the benchmarks.

Optimizers (``make_optimizers``): AdamW over every dense parameter (``fused=True`` on CUDA
and on the CPU: one kernel over all parameters instead of a loop over tensors); embedding
tables built with ``sparse=True`` (the paper-scale presets) get ``SparseAdam``, so a step
touches only the rows the batch used rather than every row of the tables; small tables stay
dense under AdamW, which is simpler, and at that size a dense update costs little.
No weight decay by default: a decayed embedding table shrinks rows that a batch did not use.

Checkpoints (``<checkpoint_dir>/checkpoint.pt``) hold the model, the optimizers, the step,
the loss/eval history, the CPU and CUDA RNG states and the data stream's ``state_dict()``,
so a resumed run continues exactly where it stopped (bit for bit on the CPU). They are
written atomically (temp file in the same directory, then ``os.replace``) and loaded with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

from .data.batch import Batch
from .data.metrics import Metrics

CHECKPOINT_NAME = "checkpoint.pt"


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


@torch.no_grad()
def evaluate(model: nn.Module, data_iter: Iterable[Batch], steps: int, *, device=None,
             autocast_bf16: bool = False) -> Dict[str, float]:
    """NE, AUC and log loss of ``model`` over the next ``steps`` batches of ``data_iter``
    (fewer if it ends). Returns dict(ne, auc, logloss, ctr, count)."""
    device = torch.device(device) if device is not None else next(model.parameters()).device
    was_training = model.training
    model.eval()
    metrics = Metrics(from_logits=True)
    try:
        for _, batch in zip(range(steps), data_iter):
            batch = batch.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                logits = model(batch)
            metrics.update(logits.float(), batch.labels)
    finally:
        model.train(was_training)
    return metrics.compute()


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


def _entropy(ctr: float) -> float:
    if not 0.0 < ctr < 1.0:
        return float("nan")
    return -(ctr * math.log(ctr) + (1 - ctr) * math.log1p(-ctr))


def _save_checkpoint(path: str, state: Dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".ckpt-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def train(model: nn.Module, data_iter: Iterable[Batch], steps: int, *, lr: float = 1e-3,
          device="cpu", eval_iter: Optional[Iterable[Batch]] = None, eval_every: int = 0,
          eval_steps: int = 20, checkpoint_dir: Optional[str] = None, checkpoint_every: int = 0,
          resume: bool = False, seed: int = 0, autocast_bf16: Optional[bool] = None,
          progress: bool = True, log_fn: Optional[Callable[[Dict[str, Any]], None]] = None,
          weight_decay: float = 0.0) -> TrainResult:
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
            per evaluation.
        checkpoint_dir: where ``checkpoint.pt`` goes (None: no checkpoints);
            checkpoint_every: every this many steps (0: only at the end).
        resume: continue from ``checkpoint_dir/checkpoint.pt`` when it exists.
        seed: seeds torch's RNG at the start of a fresh run.
        autocast_bf16: bf16 autocast of forward and loss; None: on for CUDA, off otherwise.
        progress: a tqdm bar with throughput and running NE.
        log_fn: called with dict(step, loss, ne_running, samples_per_s) every 50 steps and
            with the evaluation dict after each evaluation.
        weight_decay: AdamW's decoupled weight decay.

    Returns:
        TrainResult.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs a checkpoint_dir")
    device = torch.device(device)
    use_autocast = device.type == "cuda" if autocast_bf16 is None else bool(autocast_bf16)
    model.to(device)
    model.train()
    optimizers = make_optimizers(model, lr, device, weight_decay)
    result = TrainResult()
    start = 0
    ckpt_path = os.path.join(checkpoint_dir, CHECKPOINT_NAME) if checkpoint_dir else None
    if ckpt_path:
        os.makedirs(checkpoint_dir, exist_ok=True)
    if resume and ckpt_path and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        if len(state["optimizers"]) != len(optimizers):
            raise ValueError("checkpoint optimizers do not match this model's")
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
        torch.manual_seed(seed)

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
        n = sum(b for _, b, _ in window)
        if not n:
            return float("nan")
        ll = sum(l * b for l, b, _ in window) / n
        return ll / _entropy(sum(p for _, _, p in window) / n)

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
        _save_checkpoint(ckpt_path, {
            "model": model.state_dict(),
            "optimizers": [o.state_dict() for o in optimizers],
            "step": step,
            "losses": list(result.losses),
            "eval_history": [dict(e) for e in result.eval_history],
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "data": data_iter.state_dict() if hasattr(data_iter, "state_dict") else None,
        })

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
            loss = train_step(model, batch, optimizers, use_autocast)
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
    train_time += time.perf_counter() - tic
    flush()
    window = deque([(float(l), b, float(p)) for l, b, p in window], maxlen=200)
    result.steps = step
    result.samples_per_s = samples / train_time if samples else 0.0
    # the final checkpoint is written before the final evaluation, so that a resumed run's
    # eval history matches an uninterrupted one
    if ckpt_path and step > start and not (checkpoint_every and step % checkpoint_every == 0):
        checkpoint(step)
    if eval_iter is not None and step > start:
        result.final = run_eval(step)
    elif eval_iter is not None and result.eval_history:
        result.final = dict(result.eval_history[-1])
    else:
        result.final = {"step": step, "ne_running": running_ne()}
    return result
