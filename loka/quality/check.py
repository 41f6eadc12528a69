"""The paired quality check: does a plan change the model's quality, and by how much?

For each seed the baseline arm and the plan arm start from the same initial weights (one
model built, then copied; or a checkpoint's weights), train for the same steps on the same
batches with the same RNG (``loka.train.train`` seeds it), with
``torch.use_deterministic_algorithms(True, warn_only=True)`` for the run (restored after),
and are scored on the same evaluation examples, each once. The per-example log losses and
scores of the two arms are then compared pairwise (:mod:`loka.quality.stats`): the relative
NE change ``NE_plan / NE_base - 1`` with its interval over evaluation examples (the delta
method, and a paired bootstrap when asked) and, over several seeds, a Student-t interval of
the per-seed changes; the AUC change likewise (DeLong over examples).

A control (``control=True``) runs the plan arm's configuration in both arms: on the CPU the
two arms are bit-identical and every figure is exactly 0. ``plan_logits`` is a test hook
that transforms the plan arm's evaluation logits (a perturbation of known size), so that
the check can be shown to recover a change it was given.
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from ..data.batch import Batch
from ..data.metrics import normalized_entropy
from ..dispatch import Plan
from ..jsonio import (ReportError, atomic_write_text, field_bool, field_int, field_list,
                      field_mapping, field_number, json_safe, read_json)
from ..train import predict, train
from .stats import (bootstrap_ratio_interval, example_log_losses, paired_auc, ratio_interval,
                    t_interval)

__all__ = ["SCHEMA", "SCHEMA_VERSION", "SeedResult", "QualityResult", "paired_check",
           "predict", "deterministic"]

SCHEMA = "loka.quality"
SCHEMA_VERSION = 1


class deterministic:
    """``torch.use_deterministic_algorithms(True, warn_only=True)`` and the CPU RNG state
    for the duration of a ``with`` block; both restored after."""

    def __enter__(self) -> "deterministic":
        self._was = (torch.are_deterministic_algorithms_enabled(),
                     torch.is_deterministic_algorithms_warn_only_enabled())
        self._rng = torch.get_rng_state()
        torch.use_deterministic_algorithms(True, warn_only=True)
        return self

    def __exit__(self, *exc) -> None:
        torch.use_deterministic_algorithms(self._was[0], warn_only=self._was[1])
        torch.set_rng_state(self._rng)


@dataclass
class SeedResult:
    """One seed's paired comparison. Changes are plan minus baseline; NE changes are
    relative (``NE_plan / NE_base - 1``), AUC changes absolute."""

    seed: int
    examples: int
    """evaluation examples both arms were scored on"""
    ne_base: float
    ne_plan: float
    rel_ne_change: float
    rel_ne_low: float
    rel_ne_high: float
    """the delta method's interval over evaluation examples"""
    auc_base: float
    auc_plan: float
    auc_change: float
    auc_low: float
    auc_high: float
    """DeLong's interval over evaluation examples"""
    identical: bool
    """the two arms' evaluation logits are bit-identical"""
    bootstrap_low: Optional[float] = None
    bootstrap_high: Optional[float] = None
    """the paired bootstrap's percentile interval of the relative NE change (when asked)"""
    fallbacks: int = 0
    """plan sites the Guard switched to the baseline while the plan arm trained"""


_SEED_NUMBERS = ("ne_base", "ne_plan", "rel_ne_change", "rel_ne_low", "rel_ne_high",
                 "auc_base", "auc_plan", "auc_change", "auc_low", "auc_high")


@dataclass
class QualityResult:
    """What :func:`paired_check` found: every seed's comparison and their summary."""

    seeds: List[SeedResult]
    steps: int
    confidence: float
    control: bool
    """both arms ran the plan arm's configuration"""
    meta: Dict[str, Any] = field(default_factory=dict)
    """what was compared: model, data, plan, lr, batch size, perturbation, ..."""

    # -- the summary over seeds ---------------------------------------------------------
    @property
    def rel_ne_change(self) -> float:
        """Mean relative NE change over seeds."""
        return math.fsum(s.rel_ne_change for s in self.seeds) / len(self.seeds)

    @property
    def rel_ne_examples(self) -> Tuple[float, float]:
        """Interval of the mean change over evaluation examples (the seeds' delta-method
        half-widths combined as independent: ``sqrt(sum h^2) / n``)."""
        return self._combined("rel_ne")

    @property
    def rel_ne_seeds(self) -> Optional[Tuple[float, float]]:
        """Student-t interval over seeds of the per-seed changes (None for one seed)."""
        t = t_interval([s.rel_ne_change for s in self.seeds], self.confidence)
        return None if t is None else (t[1], t[2])

    @property
    def auc_change(self) -> float:
        return math.fsum(s.auc_change for s in self.seeds) / len(self.seeds)

    @property
    def auc_examples(self) -> Tuple[float, float]:
        return self._combined("auc")

    @property
    def auc_seeds(self) -> Optional[Tuple[float, float]]:
        t = t_interval([s.auc_change for s in self.seeds], self.confidence)
        return None if t is None else (t[1], t[2])

    @property
    def identical(self) -> bool:
        """Every seed's two arms gave bit-identical evaluation logits."""
        return all(s.identical for s in self.seeds)

    @property
    def unlearned(self) -> List[int]:
        """Seeds whose baseline arm is no better than the base rate (NE >= 1, or not
        finite): diverged, or not trained long enough. Their changes say nothing of the
        plan."""
        return [s.seed for s in self.seeds if not s.ne_base < 1.0]

    def _combined(self, name: str) -> Tuple[float, float]:
        n = len(self.seeds)
        mean = math.fsum(getattr(s, f"{name}_change") for s in self.seeds) / n
        half = math.sqrt(math.fsum(((getattr(s, f"{name}_high") - getattr(s, f"{name}_low")) / 2)
                                   ** 2 for s in self.seeds)) / n
        return mean - half, mean + half

    # -- files ------------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        seeds_iv = self.rel_ne_seeds
        auc_iv = self.auc_seeds
        return json_safe({
            "schema": SCHEMA, "version": SCHEMA_VERSION, "steps": self.steps,
            "confidence": self.confidence, "control": self.control, "meta": self.meta,
            "summary": {"rel_ne_change": self.rel_ne_change,
                        "rel_ne_examples": list(self.rel_ne_examples),
                        "rel_ne_seeds": None if seeds_iv is None else list(seeds_iv),
                        "auc_change": self.auc_change, "auc_examples": list(self.auc_examples),
                        "auc_seeds": None if auc_iv is None else list(auc_iv),
                        "identical": self.identical, "unlearned_seeds": self.unlearned},
            "seeds": [asdict(s) for s in self.seeds]})

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "QualityResult":
        """A result from :meth:`to_dict`'s form; a bad field is a :class:`ReportError`
        naming it (the summary is recomputed from the seeds, not read)."""
        seeds = []
        for i, s in enumerate(field_list(d, "seeds", "")):
            where = f"seeds[{i}]"
            if not isinstance(s, dict):
                raise ReportError(f"{where}: expected a JSON object")
            values = {k: field_number(s, k, where, optional=False) for k in _SEED_NUMBERS}
            boot = {k: field_number(s, k, where) for k in ("bootstrap_low", "bootstrap_high")}
            seeds.append(SeedResult(seed=field_int(s, "seed", where, minimum=-2 ** 63),
                                    examples=field_int(s, "examples", where, minimum=1),
                                    identical=field_bool(s, "identical", where),
                                    fallbacks=field_int(s, "fallbacks", where) if "fallbacks"
                                    in s else 0, **values, **boot))
        if not seeds:
            raise ReportError("seeds: expected at least one seed")
        confidence = field_number(d, "confidence", "", optional=False)
        if not 0.0 < confidence < 1.0:
            raise ReportError(f"confidence: expected a number in (0, 1), got {confidence}")
        return cls(seeds=seeds, steps=field_int(d, "steps", ""), confidence=confidence,
                   control=field_bool(d, "control", ""), meta=dict(field_mapping(d, "meta", "",
                                                                                 {})))

    def save(self, path: "str | os.PathLike") -> None:
        """Write the result as strict JSON (no NaN), atomically."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=False))

    @classmethod
    def load(cls, path: "str | os.PathLike") -> "QualityResult":
        """Read and validate a result file (one-line :class:`ReportError` on any fault)."""
        data = read_json(path, SCHEMA, SCHEMA_VERSION)
        try:
            return cls.from_dict(data)
        except ReportError as e:
            raise ReportError(f"{path}: {e}") from None

    # -- text -------------------------------------------------------------------------
    def summary(self) -> str:
        """One screen: what was compared, each seed, and the intervals."""
        pct = 100.0
        what = "control (the plan arm against itself)" if self.control else "plan vs baseline"
        meta = self.meta
        lines = [f"paired quality check: {what}; {meta.get('model', 'model')} on "
                 f"{meta.get('data', 'data')}, {self.steps} steps per arm, "
                 f"{len(self.seeds)} seed(s), {self.seeds[0].examples:,} evaluation examples "
                 f"each, {self.confidence:.0%} intervals"]
        if meta.get("perturbation"):
            lines.append(f"perturbation of the plan arm: {meta['perturbation']}")
        lines.append(f"{'seed':>6} {'NE base':>9} {'NE plan':>9} {'rel NE change':>14} "
                     f"{'interval (examples)':>24} {'AUC change':>11} {'identical':>9}")
        for s in self.seeds:
            lines.append(f"{s.seed:>6} {s.ne_base:9.5f} {s.ne_plan:9.5f} "
                         f"{s.rel_ne_change * pct:+13.4f}% "
                         f"[{s.rel_ne_low * pct:+.4f}%, {s.rel_ne_high * pct:+.4f}%] "
                         f"{s.auc_change:+11.5f} {'yes' if s.identical else 'no':>9}")
        lo, hi = self.rel_ne_examples
        lines.append(f"relative NE change {self.rel_ne_change * pct:+.4f}%: over examples "
                     f"[{lo * pct:+.4f}%, {hi * pct:+.4f}%] (half-width "
                     f"{(hi - lo) / 2 * pct:.4f}%)")
        if self.rel_ne_seeds is not None:
            lo, hi = self.rel_ne_seeds
            lines.append(f"  over seeds (t, {len(self.seeds) - 1} df) [{lo * pct:+.4f}%, "
                         f"{hi * pct:+.4f}%]")
        lo, hi = self.auc_examples
        lines.append(f"AUC change {self.auc_change:+.5f}: over examples [{lo:+.5f}, {hi:+.5f}]"
                     + ("" if self.auc_seeds is None else
                        f"; over seeds [{self.auc_seeds[0]:+.5f}, {self.auc_seeds[1]:+.5f}]"))
        if self.identical:
            lines.append("the two arms were bit-identical: every change is exactly 0")
        if self.unlearned:
            lines.append(f"WARNING: the baseline did not learn at seed(s) {self.unlearned} "
                         "(NE >= 1, no better than the base rate): these changes say nothing "
                         "about the plan")
        return "\n".join(lines)


def _compare(seed: int, base: Tuple[np.ndarray, np.ndarray], plan: Tuple[np.ndarray, np.ndarray],
             confidence: float, bootstrap: int, fallbacks: int) -> SeedResult:
    (z_base, labels), (z_plan, labels_plan) = base, plan
    if not np.array_equal(labels, labels_plan):
        raise RuntimeError("the two arms were scored on different examples: the evaluation "
                           "data must give the same batches every time it is read")
    l_base, l_plan = example_log_losses(z_base, labels), example_log_losses(z_plan, labels)
    change, low, high = ratio_interval(l_base, l_plan, confidence)
    ne_base = normalized_entropy(z_base, labels, from_logits=True)
    ne_plan = normalized_entropy(z_plan, labels, from_logits=True)
    auc_base, auc_plan, auc_change, auc_low, auc_high = paired_auc(z_base, z_plan, labels,
                                                                   confidence)
    boot = (bootstrap_ratio_interval(l_base, l_plan, bootstrap, confidence, seed=seed)
            if bootstrap else (None, None))
    return SeedResult(seed=seed, examples=int(labels.size), ne_base=ne_base, ne_plan=ne_plan,
                      rel_ne_change=change, rel_ne_low=low, rel_ne_high=high,
                      auc_base=auc_base, auc_plan=auc_plan, auc_change=auc_change,
                      auc_low=auc_low, auc_high=auc_high,
                      identical=bool(np.array_equal(z_base, z_plan)),
                      bootstrap_low=boot[0], bootstrap_high=boot[1], fallbacks=fallbacks)


def paired_check(build_model: Callable[[int], nn.Module],
                 train_data: Callable[[int], Iterable[Batch]],
                 eval_data: Callable[[], Iterable[Batch]], plan: Optional[Plan], *,
                 steps: int, seeds: Sequence[int] = (0,), lr: float = 1e-3, device="cpu",
                 initial_state: Optional[Dict[str, torch.Tensor]] = None,
                 eval_steps: Optional[int] = None, control: bool = False,
                 confidence: float = 0.95, bootstrap: int = 0,
                 plan_logits: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                 autocast_bf16: Optional[bool] = None, progress: bool = True,
                 meta: Optional[Dict[str, Any]] = None,
                 initial_optimizer_state: Optional[Sequence[Mapping[str, Any]]] = None,
                 warmup_steps: int = 0) -> QualityResult:
    """Train a baseline arm and a plan arm on identical terms and compare their quality.

    Args:
        build_model: ``seed -> model`` (``forward(batch) -> logits (B,)``); called once per
            seed, the two arms train copies of it.
        train_data: ``seed -> batches``; called once per arm, it must give both arms the
            same batches (``SyntheticCTR(spec, B, seed=seed)`` does).
        eval_data: ``() -> batches``; called once per arm, the same batches every time.
        plan: the plan arm's plan (``loka.train.train(plan=...)``: applied to a copy, the
            Guard armed); None trains the plan arm without one.
        steps: training steps per arm (0: score the initial weights).
        seeds: one paired comparison per seed (initial weights, batches and RNG).
        lr: learning rate of both arms.
        device: where both arms train.
        initial_state: weights loaded into every seed's model before the arms branch (a
            checkpoint's); None: the weights ``build_model`` made.
        initial_optimizer_state: the optimizer states saved with ``initial_state`` (a
            checkpoint's ``"optimizers"``): both arms continue that run's Adam moments
            (``loka.train.train(optimizer_state=...)``) instead of restarting them, which
            can throw a trained wide model far off in its first steps.
        warmup_steps: linear learning-rate warm-up of both arms (``loka.train.train``).
        eval_steps: evaluation batches (None: all of ``eval_data``, once; a stream that
            never ends needs a number).
        control: run the plan arm's configuration in both arms (the result must be 0).
        confidence: of every interval.
        bootstrap: paired bootstrap resamples of the examples per seed (0: the delta
            method's interval only).
        plan_logits: a test hook applied to the plan arm's evaluation logits (N,): a
            perturbation of known size that the check must recover.
        autocast_bf16: bf16 autocast of both arms; None: on for CUDA.
        progress: a tqdm bar over the arms.
        meta: recorded in the result as given (model, data, plan names, ...).

    Returns:
        QualityResult.
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    if not seeds:
        raise ValueError("give at least one seed")
    device = torch.device(device)
    use_autocast = device.type == "cuda" if autocast_bf16 is None else bool(autocast_bf16)
    arms = (("baseline", plan if control else None), ("plan", plan))
    results = []
    bar = tqdm(total=2 * len(seeds), disable=not progress, unit="arm", dynamic_ncols=True)
    try:
        with deterministic():
            for seed in seeds:
                torch.manual_seed(seed)
                origin = build_model(seed)
                if initial_state is not None:
                    origin.load_state_dict(initial_state)
                scored, fallbacks = [], 0
                for name, arm_plan in arms:
                    bar.set_description(f"seed {seed} {name}")
                    model = copy.deepcopy(origin)
                    run = train(model, train_data(seed), steps, lr=lr, device=device, seed=seed,
                                plan=arm_plan, autocast_bf16=use_autocast, progress=False,
                                warmup_steps=warmup_steps,
                                optimizer_state=initial_optimizer_state)
                    logits, labels = predict(model, eval_data(), eval_steps, device=device,
                                             autocast_bf16=use_autocast)
                    if name == "plan":
                        fallbacks = len(run.plan.fallbacks) if run.plan is not None else 0
                        if plan_logits is not None:
                            logits = plan_logits(torch.from_numpy(logits)).double().numpy()
                    scored.append((logits, labels))
                    bar.update(1)
                results.append(_compare(seed, scored[0], scored[1], confidence, bootstrap,
                                        fallbacks))
    finally:
        bar.close()
    return QualityResult(seeds=results, steps=steps, confidence=confidence, control=control,
                         meta=dict(meta or {}))
