"""The paired quality check on the tiny Wukong and the synthetic stream: a control is
exactly 0, a perturbation of known size is recovered inside an interval whose half-width
is below 0.02% relative NE, several seeds give a t-interval, the result is strict JSON, and
``loka quality`` runs it from the command line."""

import json
import math

import numpy as np
import pytest
import torch

import loka.models as M
from loka import cli
from loka.data import SyntheticCTR
from loka.dispatch import Plan
from loka.jsonio import ReportError
from loka.quality import QualityResult, paired_check

FP8 = "emulated-rowwise-e4m3"
STEPS, LR, BATCH = 60, 3e-3, 64
EVAL_BATCHES, EVAL_BATCH = 32, 1024  # 32,768 evaluation examples
SCALE = 1.002  # the planted perturbation: the plan arm's logits times this
RESOLUTION = 2e-4  # 0.02% relative NE


@pytest.fixture(scope="module")
def spec():
    return M.build("wukong", "tiny").feature_spec


@pytest.fixture(scope="module")
def held(spec):
    return SyntheticCTR(spec, EVAL_BATCH, seed=999)


def _check(spec, held, plan, **kw):
    return paired_check(lambda seed: M.build("wukong", "tiny"),
                        lambda seed: SyntheticCTR(spec, BATCH, seed=seed),
                        lambda: (held.batch(i) for i in range(EVAL_BATCHES)), plan,
                        steps=STEPS, lr=LR, progress=False, **kw)


def _ne64(logits, labels):
    """float64 reference NE, written out: log loss over the entropy of the base CTR."""
    z, y = np.asarray(logits, np.float64), np.asarray(labels, np.float64)
    ll = np.mean(y * np.logaddexp(0, -z) + (1 - y) * np.logaddexp(0, z))
    ctr = y.mean()
    return ll / -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))


def _plan():
    torch.manual_seed(0)
    return Plan.uniform(M.build("wukong", "tiny"), FP8, device="cpu")


def test_a_control_is_exactly_zero_and_restores_torch_settings(spec, held):
    plan = _plan()
    before = (torch.are_deterministic_algorithms_enabled(), torch.get_rng_state())
    result = _check(spec, held, plan, seeds=(0, 1), control=True)
    assert result.identical
    for s in result.seeds:
        assert (s.rel_ne_change, s.rel_ne_low, s.rel_ne_high) == (0.0, 0.0, 0.0)
        assert (s.auc_change, s.auc_low, s.auc_high) == (0.0, 0.0, 0.0)
        assert s.examples == EVAL_BATCHES * EVAL_BATCH
    assert result.rel_ne_seeds == (0.0, 0.0) and result.rel_ne_examples == (0.0, 0.0)
    assert torch.are_deterministic_algorithms_enabled() == before[0]
    assert torch.equal(torch.get_rng_state(), before[1])


def test_a_planted_perturbation_is_recovered_within_an_interval_narrower_than_0_02pct(spec,
                                                                                      held):
    seen = []

    def perturb(z):
        seen.append(z.clone())  # the plan arm's logits: in a control, the baseline's
        return z * SCALE

    result = _check(spec, held, _plan(), seeds=(0,), control=True, plan_logits=perturb)
    s = result.seeds[0]
    labels = torch.cat([held.batch(i).labels for i in range(EVAL_BATCHES)]).double().numpy()
    base = seen[0].numpy()
    expected = _ne64(base * SCALE, labels) / _ne64(base, labels) - 1
    assert s.ne_base == pytest.approx(_ne64(base, labels), rel=1e-12)
    assert s.rel_ne_change == pytest.approx(expected, abs=1e-12)
    assert s.rel_ne_low < expected < s.rel_ne_high
    half = (s.rel_ne_high - s.rel_ne_low) / 2
    assert half < RESOLUTION, f"half-width {half:.2e} is not below 0.02%"
    assert not s.identical


def test_several_seeds_give_a_t_interval_that_holds_the_planted_change(spec, held):
    seen = []

    def perturb(z):
        seen.append(z.clone())
        return z * SCALE

    result = _check(spec, held, _plan(), seeds=(0, 1, 2), control=True, plan_logits=perturb)
    labels = torch.cat([held.batch(i).labels for i in range(EVAL_BATCHES)]).double().numpy()
    expected = [_ne64(z.numpy() * SCALE, labels) / _ne64(z.numpy(), labels) - 1 for z in seen]
    changes = [s.rel_ne_change for s in result.seeds]
    np.testing.assert_allclose(changes, expected, rtol=0, atol=1e-12)
    low, high = result.rel_ne_seeds
    mean, sd = np.mean(changes), np.std(changes, ddof=1)
    assert (high - low) / 2 == pytest.approx(4.3026527 * sd / math.sqrt(3), rel=1e-6)
    assert low <= mean <= high and low < np.mean(expected) < high
    for s, e in zip(result.seeds, expected):  # each seed's interval over examples holds it
        assert s.rel_ne_low < e < s.rel_ne_high


def test_a_larger_perturbation_is_detected(spec, held):
    result = _check(spec, held, _plan(), seeds=(0,), control=True,
                    plan_logits=lambda z: z * 1.05)
    s = result.seeds[0]
    assert s.rel_ne_low > 0  # the interval excludes 0: a worse NE, detected


def test_the_plan_against_the_baseline_gives_finite_intervals_and_strict_json(spec, held,
                                                                            tmp_path):
    result = _check(spec, held, _plan(), seeds=(0,), bootstrap=100,
                    meta={"model": "wukong/tiny", "plan": FP8})
    s = result.seeds[0]
    assert not s.identical and s.rel_ne_low <= s.rel_ne_change <= s.rel_ne_high
    assert s.bootstrap_low <= s.rel_ne_change <= s.bootstrap_high
    path = tmp_path / "quality.json"
    result.save(path)

    def refuse(token):
        raise ValueError(token)
    json.loads(path.read_text(), parse_constant=refuse)
    again = QualityResult.load(path)
    assert again.seeds == result.seeds and again.rel_ne_examples == result.rel_ne_examples
    assert "relative NE change" in again.summary()
    data = json.loads(path.read_text())
    data["seeds"][0]["rel_ne_low"] = "low"
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match=r"seeds\[0\].rel_ne_low"):
        QualityResult.load(path)


def test_loka_quality_on_the_command_line(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    _plan().save(plan)
    out = tmp_path / "q.json"
    base = ["quality", "--preset", "tiny", "--device", "cpu", "--steps", "3", "--batch-size",
            "32", "--eval-steps", "4", "--seeds", "0,1", "-o", str(out)]
    assert cli.main(base + ["--plan", str(plan), "--control"]) == 0
    text = capsys.readouterr().out
    assert "bit-identical" in text
    result = QualityResult.load(out)
    assert result.control and result.rel_ne_change == 0.0 and len(result.seeds) == 2
    assert cli.main(base + ["--plan", str(plan), "--control", "--logit-scale", "1.01"]) == 0
    capsys.readouterr()
    assert QualityResult.load(out).rel_ne_change != 0.0
    assert cli.main(base) == 2
    assert "--plan" in capsys.readouterr().err


def test_loka_quality_from_a_train_checkpoint_continues_its_optimizer_state(tmp_path, capsys):
    """`loka quality --checkpoint` of a `loka train` run: both arms continue the run's Adam
    moments (recorded in the result); from the same weights saved bare, fresh moments
    train the arms elsewhere."""
    run = tmp_path / "run"
    assert cli.main(["train", "--preset", "tiny", "--device", "cpu", "--steps", "4",
                     "--batch-size", "32", "--warmup-steps", "2", "--out", str(run)]) == 0
    ckpt = run / "checkpoint.pt"
    plan = tmp_path / "plan.json"
    _plan().save(plan)
    base = ["quality", "--preset", "tiny", "--device", "cpu", "--steps", "3", "--batch-size",
            "32", "--eval-steps", "4", "--seeds", "0", "--plan", str(plan), "--control"]
    out_full, out_bare = tmp_path / "full.json", tmp_path / "bare.json"
    assert cli.main(base + ["--checkpoint", str(ckpt), "-o", str(out_full)]) == 0
    full = QualityResult.load(out_full)
    assert full.meta["checkpoint_optimizer_state"] is True and full.rel_ne_change == 0.0
    bare = tmp_path / "bare.pt"
    torch.save(torch.load(ckpt, weights_only=True)["model"], bare)
    assert cli.main(base + ["--checkpoint", str(bare), "-o", str(out_bare)]) == 0
    other = QualityResult.load(out_bare)
    assert other.meta["checkpoint_optimizer_state"] is False
    # the same weights, other optimizer states: the arms end elsewhere
    assert full.seeds[0].ne_base != other.seeds[0].ne_base
    capsys.readouterr()
