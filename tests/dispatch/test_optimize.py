"""loka.optimize: Probe, plan and a whole-step check in one call, never slower than no plan
(under scripted timers, so that what is decided is known exactly)."""

import pytest
import torch
from torch import nn

import loka
from loka.dispatch import Linear, optimize, step_timer
from loka.kernels.registry import get

# (torch 2.11's build has no rowwise _scaled_mm on the CPU: its emulated twin)
RW = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "emulated-rowwise-e4m3"
KERNELS = ("bf16", RW)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                         nn.Linear(64, 32))


def _batches(n=3):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(96, 64, generator=gen) for _ in range(n)]


def _loss(model, batch):
    return model(batch).float().pow(2).mean()


def _config():
    return loka.ProbeConfig(kernels=KERNELS, num_samples=4, timing=False, every_n_steps=1)


def _fp8_sites(model):
    return sum(1 for m in model.modules() if isinstance(m, Linear) and not m._all_baseline)


def _scripted(per_site_ms, noise=None):
    """A timer whose step costs 10 ms plus ``per_site_ms`` per FP8 site; ``noise(i)`` adds
    to the i-th call."""
    calls = []

    def time_step(model):
        t = 10.0 + per_site_ms * _fp8_sites(model) + (noise(len(calls)) if noise else 0.0)
        calls.append((_fp8_sites(model), t))
        return t
    return time_step, calls


def test_a_plan_that_slows_the_step_goes_back_to_the_baseline():
    model = _model()
    time_step, calls = _scripted(+0.5)  # every FP8 site costs time
    result = optimize(model, _batches(), _loss, config=_config(), time_step=time_step)
    assert result.timed and result.untuned.fp8_sites()  # the report alone would use FP8
    assert result.plan.fp8_sites() == []
    assert result.rounds == []  # nothing left to confirm
    assert calls[0][0] == 0 and calls[1][0] == len(result.untuned.fp8_sites())
    assert not any(isinstance(m, Linear) for m in model.modules())  # the model is left as it was


def test_a_plan_that_pays_is_kept_after_winning_every_round():
    model = _model()
    time_step, calls = _scripted(-1.0)  # every FP8 site saves 1 ms
    result = optimize(model, _batches(), _loss, config=_config(), time_step=time_step, rounds=3)
    kept = result.plan.fp8_sites()
    assert kept == result.untuned.fp8_sites() and kept
    assert len(result.rounds) == 3
    assert all(r["plan"] == pytest.approx(10.0 - len(kept)) and r["baseline"] == 10.0
               for r in result.rounds)
    assert result.speedup == pytest.approx(10.0 / (10.0 - len(kept)))
    assert result.plan.budget["optimize"]["speedup"] == pytest.approx(result.speedup)
    # beside it, what the report's isolated GEMM timings predicted for the same plan
    from loka.dispatch import predict_step
    want = predict_step(result.plan, result.report, 10.0)
    assert result.plan.budget["optimize"]["predicted_speedup"] == pytest.approx(want.speedup)
    assert want.per_role_us or want.untimed  # every FP8 site-role is accounted for
    # and the ceiling of the same step: a report without timings counts no GEMM
    ceil = result.plan.budget["optimize"]["ceiling"]
    assert ceil["baseline_step_ms"] == 10.0 and ceil["measured_speedup"] == 1.0
    assert ceil["gemm_ms"] == 0.0 and ceil["roofline_speedup"] is None
    assert not any(isinstance(m, Linear) for m in model.modules())


def _tuning_calls():
    """How many timings the tuning takes before the A/B rounds (the scripted model)."""
    return len(optimize(_model(), _batches(), _loss, config=_config(),
                        time_step=_scripted(-1.0)[0], rounds=3).trials)


@pytest.mark.parametrize("lost, kept, n_rounds", [
    ((2,), True, 6),          # one noisy round: three more, all won: 5 of 6 (p = 7/64)
    ((0, 2), False, 3),       # two lost of three: no number of extra rounds can pass
    ((1, 4), False, 5),       # one lost, then one of the extra rounds: 3 of 5, and 6 can't
])
def test_a_lost_ab_round_is_weighed_by_a_sign_test(lost, kept, n_rounds):
    model = _model()
    first = _tuning_calls()

    def noise(i):  # a slow plan step in the A/B rounds listed (2 calls per round, the
        r, second = divmod(i - first, 2)  # plan first in odd rounds)
        is_plan = second != r % 2
        return 5.0 if i >= first and is_plan and r in lost else 0.0
    time_step, calls = _scripted(-1.0, noise)
    lines = []
    result = optimize(model, _batches(), _loss, config=_config(), time_step=time_step,
                      rounds=3, progress=lines.append)
    wins = [r["plan"] < r["baseline"] for r in result.rounds]
    assert len(result.rounds) == n_rounds and wins == [i not in lost for i in range(n_rounds)]
    assert len(calls) == first + 2 * n_rounds  # nothing timed beyond the rounds
    assert bool(result.plan.fp8_sites()) is kept
    budget = result.plan.budget["optimize"]
    assert budget["first_rounds"] == 3 and len(budget["rounds"]) == n_rounds
    assert budget["null_keep_probability"] == 11 / 64
    if n_rounds > 3:
        assert any("timing up to 3 more" in line for line in lines)
    if kept:
        assert result.speedup > 1.0
        assert any("won 5 of 6 A/B rounds" in n for n in result.plan.notes)
    else:
        assert any(f"in {sum(wins)} of {n_rounds} A/B rounds" in n
                   and "every site is on the baseline" in n for n in result.plan.notes)


def test_a_broken_ab_timing_keeps_nothing_and_says_why():
    first = _tuning_calls()

    def noise(i):  # the plan's step of the second A/B round (timed first) times as NaN
        return float("nan") if i == first + 2 else 0.0
    time_step, calls = _scripted(-1.0, noise)
    result = optimize(_model(), _batches(), _loss, config=_config(), time_step=time_step,
                      rounds=3)
    assert len(result.rounds) == 3 and result.plan.fp8_sites() == []
    assert any("not a positive finite number" in n for n in result.plan.notes)


def test_optimize_passes_paired_trials_to_the_tuning_and_records_them():
    time_step, calls = _scripted(-1.0)
    result = optimize(_model(), _batches(), _loss, config=_config(), time_step=time_step,
                      rounds=1, paired_trials=True)
    fp8_trials = [t for t in result.trials if t["sites"]]
    assert fp8_trials and all("baseline_time" in t for t in fp8_trials)
    assert result.plan.budget["optimize"]["paired_trials"] is True
    unpaired = optimize(_model(), _batches(), _loss, config=_config(),
                        time_step=_scripted(-1.0)[0], rounds=1)
    assert not any("baseline_time" in t for t in unpaired.trials)
    assert unpaired.plan.budget["optimize"]["paired_trials"] is False


def test_sign_test_p_is_the_binomial_tail():
    from math import comb

    from loka.dispatch import sign_test_p
    for n in range(1, 9):
        for k in range(n + 1):
            want = sum(comb(n, j) for j in range(k, n + 1)) / 2.0 ** n
            assert sign_test_p(k, n) == pytest.approx(want, rel=0, abs=1e-15)
    assert sign_test_p(3, 3) == 0.125 and sign_test_p(5, 6) == 7 / 64
    for bad in ((-1, 3), (4, 3)):
        with pytest.raises(ValueError, match="0 <= wins <= n"):
            sign_test_p(*bad)


def test_null_keep_probability_is_the_rules_own_by_enumeration():
    """Every sequence of won and lost rounds (even odds each), run through ab_verdict with
    the loop optimize runs: the share of sequences that keep the plan."""
    from itertools import product

    from loka.dispatch import ab_verdict, null_keep_probability
    for first in range(1, 5):
        kept = 0.0
        for seq in product((True, False), repeat=2 * first):
            rounds = _rounds(*(9.0 if won else 11.0 for won in seq[:first]))
            while ab_verdict(rounds, first) is None:
                rounds += _rounds(9.0 if seq[len(rounds)] else 11.0)
            kept += ab_verdict(rounds, first) / 2 ** (2 * first)
        assert null_keep_probability(first) == pytest.approx(kept, abs=1e-15)
    assert null_keep_probability(3) == 11 / 64 and null_keep_probability(1) == 0.5
    with pytest.raises(ValueError, match="first >= 1"):
        null_keep_probability(0)


def _rounds(*plan_ms, base=10.0):
    return [{"baseline": base, "plan": p} for p in plan_ms]


def test_ab_verdict():
    from loka.dispatch import ab_verdict
    assert ab_verdict(_rounds(9, 9, 9), 3) is True
    assert ab_verdict(_rounds(9, 9, 11), 3) is None            # 3 more wins would pass
    assert ab_verdict(_rounds(9, 9, 11, 9, 9, 9), 3) is True   # 5 of 6
    assert ab_verdict(_rounds(9, 9, 11, 9, 9, 11), 3) is False
    assert ab_verdict(_rounds(9, 11, 11), 3) is False          # 4 of 6 at best
    assert ab_verdict(_rounds(9, 9, 10), 3) is None            # a tie is no win
    assert ab_verdict(_rounds(9), 1) is True and ab_verdict(_rounds(11), 1) is False
    assert ab_verdict(_rounds(9, 11), 2) is False              # 3 of 4 is p = 5/16
    # a broken timing keeps nothing, wherever it falls
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        for at in range(3):
            plan = [9.0, 9.0, 9.0]
            plan[at] = bad
            assert ab_verdict(_rounds(*plan), 3) is False
        assert ab_verdict(_rounds(9, 9, 9, base=bad), 3) is False
    # 5 of 6 won, but the one lost by far: the median step is the slower
    rounds = [{"baseline": b, "plan": p} for b, p in
              zip((10, 10, 10, 1, 1, 1), (9.9, 9.9, 9.9, 0.9, 0.9, 50))]
    assert ab_verdict(rounds, 3) is False
    from loka.dispatch.verdict import ab_note
    assert "but its median step was not faster" in ab_note(rounds, 3)
    assert ab_note(_rounds(9, 9, 9), 3) is None  # every first round won: nothing to say
    for bad in ((_rounds(9, 9), 3), (_rounds(9), 0)):
        with pytest.raises(ValueError, match="at least first"):
            ab_verdict(*bad)


def test_without_a_gpu_or_a_timer_the_plan_is_made_on_error_alone_and_says_so():
    model = _model()
    result = optimize(model, _batches(), _loss, config=_config())
    assert not result.timed and result.trials == [] and result.rounds == []
    assert result.plan.fp8_sites() == result.untuned.fp8_sites() != []
    assert any("not timed" in n for n in result.plan.notes)


def test_optimize_refuses_bad_input():
    with pytest.raises(ValueError, match="at least one batch"):
        optimize(_model(), [], _loss, config=_config())
    with pytest.raises(ValueError, match="rounds >= 1"):
        optimize(_model(), _batches(), _loss, config=_config(), rounds=0)
    with pytest.raises(ValueError, match="loss_fn"):
        step_timer(_batches()[0])
    with pytest.raises(ValueError, match="steps >= 1"):
        step_timer(_batches()[0], _loss, steps=0)


@pytest.mark.parametrize("inference", [False, True])
def test_step_timer_times_without_changing_the_weights(inference):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    time_step = step_timer(_batches()[0], _loss, inference=inference, compile=False, steps=2,
                           warmup=1)
    ms = time_step(model)
    assert ms > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_given_report_is_used_and_the_probe_not_run_again():
    model = _model()
    first = optimize(model, _batches(), _loss, config=_config())
    calls = []
    again = optimize(model, _batches(1), lambda m, b: calls.append(1) or _loss(m, b),
                     report=first.report)
    assert calls == [] and again.report is first.report
    assert again.untuned.to_dict()["sites"] == first.untuned.to_dict()["sites"]


def test_delayed_scaling_is_carried_by_every_plan_timed_and_the_one_returned():
    model = _model()
    seen = []

    def time_step(m):
        delayed = [x.delayed_decay for x in m.modules() if isinstance(x, Linear)]
        seen.append(delayed)
        return 10.0 - 1.0 * _fp8_sites(m)
    result = optimize(model, _batches(), _loss, config=_config(), time_step=time_step,
                      rounds=2, delayed_scaling=0.8)
    assert result.plan.delayed_scaling == 0.8 and result.plan.fp8_sites()
    timed_with_fp8 = [d for d in seen if d]
    assert timed_with_fp8 and all(v == 0.8 for d in timed_with_fp8 for v in d)
    assert result.untuned.delayed_scaling is None  # the report's plan, as loka.plan made it
    untimed = optimize(_model(), _batches(), _loss, config=_config(), delayed_scaling=0.9)
    assert untimed.plan.delayed_scaling == 0.9
    with pytest.raises(ValueError, match="for training"):
        optimize(_model(), _batches(), _loss, config=_config(), inference=True,
                 delayed_scaling=0.9)
    for bad in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="decay"):
            optimize(_model(), _batches(), _loss, config=_config(), delayed_scaling=bad)


def test_static_scales_serve_every_plan_timed_and_the_one_returned():
    """Serving with static scales: each timed step's FP8 forwards hold the plan's observed
    amax; a site tuned back to the baseline loses its scale; training refuses them."""
    model = _model()
    seen = []

    def time_step(m):
        seen.append({id(x): x.input_amax for x in m.modules()
                     if isinstance(x, Linear) and not x._all_baseline})
        return 10.0 - 1.0 * _fp8_sites(m)
    result = optimize(model, _batches(), _loss, config=_config(), time_step=time_step,
                      rounds=2, inference=True, static_scales=True, static_margin=1.25)
    plan = result.plan
    assert plan.fp8_sites() and sorted(plan.static_scales) == sorted(plan.fp8_sites())
    observed = loka.dispatch.amax_from_report(result.report)
    assert all(plan.static_scales[s] == pytest.approx(1.25 * observed[s])
               for s in plan.static_scales)
    timed = [d for d in seen if d]
    assert timed and all(a is not None and float(a) > 0 for d in timed for a in d.values())
    # a plan whose site went back to the baseline: the scale stays in the JSON, unused
    moved = loka.dispatch.tune.on_baseline(plan, plan.fp8_sites()[:1], "test")
    served = _model()
    loka.apply(served, moved, inference=True)
    assert all(float(m.input_amax) > 0 for m in served.modules()
               if isinstance(m, Linear) and not m._all_baseline)
    with pytest.raises(ValueError, match="for serving"):
        optimize(_model(), _batches(), _loss, config=_config(), static_scales=True)


def test_a_serving_probe_measures_forwards_only(monkeypatch):
    """``optimize(inference=True)`` without a config probes the forwards alone (a serving
    plan runs nothing else): the report holds the forward of every site and no other role,
    and the plan is the one a full report gives for serving; training probes all roles, and
    a config given is used as it is. (The default config's other fields are made cheap
    here, the same for both Probes: the roles are what is tested.)"""
    import functools
    import importlib

    optimize_module = importlib.import_module("loka.dispatch.optimize")  # (not the function)
    cheap = dict(kernels=KERNELS, num_samples=4, timing=False, every_n_steps=1)
    monkeypatch.setattr(optimize_module, "ProbeConfig",
                        functools.partial(loka.ProbeConfig, **cheap))
    served = optimize(_model(), _batches(), _loss, inference=True)
    assert all(list(s.roles) == [loka.Role.FWD] for s in served.report.sites.values())
    assert served.report.config["num_samples"] == 4  # the default path, made cheap
    full = loka.probe(_model(), _batches(), _loss,
                      config=loka.ProbeConfig(progress=False, **cheap))
    assert {n: sp.roles[loka.Role.FWD].kernel for n, sp in served.untuned.sites.items()} == \
        {n: sp.roles[loka.Role.FWD].kernel
         for n, sp in loka.plan(full, inference=True, assume_fast=True).sites.items()}
    given = optimize(_model(), _batches(), _loss, inference=True, config=_config())
    assert all(set(s.roles) == set(loka.config.ROLES) for s in given.report.sites.values())


def _reporting(per_site_ms, host_ms):
    """A scripted timer (as :func:`_scripted`) that also reports, as ``step_timer`` does,
    the host's time to issue the step and a GPU device."""
    base, calls = _scripted(per_site_ms)

    def time_step(model):
        ms = base(model)
        time_step.last = {"median_ms": ms, "host_ms": host_ms, "device": "cuda"}
        return ms
    time_step.last = None
    return time_step, calls


@pytest.mark.parametrize("host_ms, bound", [(9.5, True), (8.0, True), (7.9, False),
                                             (4.0, False)])
def test_optimize_says_when_the_step_without_fp8_is_host_bound(host_ms, bound):
    """The baseline step takes 10 ms: a host that issues it in 8 ms or more sets its pace
    (FP8's GPU savings cannot show), one that issues it in less does not."""
    lines = []
    time_step, _ = _reporting(-1.0, host_ms)
    result = optimize(_model(), _batches(), _loss, config=_config(), time_step=time_step,
                      rounds=2, progress=lines.append)
    assert result.host_bound is bound
    assert result.plan.budget["optimize"]["host_bound"] is bound
    said = [ln for ln in lines if "host-bound" in ln]
    assert (len(said) == 1 and f"{host_ms:.3f} of 10.000 ms" in said[0]
            and "reduce-overhead" in said[0]
            and "synchronized_steps=True" in said[0]) if bound else said == []
    assert result.plan.budget["optimize"]["synchronized_steps"] is False


def test_a_timer_that_does_not_report_the_host_leaves_it_unknown():
    time_step, _ = _scripted(-1.0)
    result = optimize(_model(), _batches(), _loss, config=_config(), time_step=time_step,
                      rounds=2)
    assert result.host_bound is None and result.plan.budget["optimize"]["host_bound"] is None
    # on the CPU the host always sets the pace: a CPU timing says nothing of it
    cpu, _ = _reporting(-1.0, 10.0)
    base = cpu

    def on_cpu(model):
        ms = base(model)
        on_cpu.last = dict(base.last, device="cpu")
        return ms
    assert optimize(_model(), _batches(), _loss, config=_config(), time_step=on_cpu,
                    rounds=2).host_bound is None


def test_step_timer_reports_the_last_timing():
    model = _model()
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=1)
    assert timer.last is None
    ms = timer(model)
    assert timer.last["median_ms"] == ms and timer.last["device"] == "cpu"
    assert 0 < timer.last["host_ms"]


def test_step_timer_compiles_under_the_inductor_options_it_is_given(monkeypatch):
    """``compile_options`` hold while the timed steps compile (their first call), and not
    after; a key that is not an Inductor option, or options that are not a mapping, are
    refused before anything runs."""
    from torch._inductor import config as inductor_config

    seen = []

    def fake_compile(model, **kw):
        def run(*args):
            seen.append(inductor_config.cpp_wrapper)
            return model(*args)
        return run
    monkeypatch.setattr(torch, "compile", fake_compile)
    before = inductor_config.cpp_wrapper
    timer = step_timer(_batches()[0], _loss, steps=2, warmup=1,
                       compile_options={"cpp_wrapper": not before})
    assert timer(_model()) > 0
    assert seen == [not before] * 3 and inductor_config.cpp_wrapper is before
    plain = step_timer(_batches()[0], _loss, steps=1, warmup=0)
    plain(_model())
    assert seen[-1] is before
    with pytest.raises(ValueError, match="'no_such_option' is not an option of torch._induc"):
        step_timer(_batches()[0], _loss, compile_options={"no_such_option": 1})
    with pytest.raises(ValueError, match="must map option names to values, got list"):
        step_timer(_batches()[0], _loss, compile_options=["cpp_wrapper"])
    with pytest.raises(ValueError, match="compile=False times eager ones"):
        step_timer(_batches()[0], _loss, compile=False, compile_options={"cpp_wrapper": True})


def test_optimize_reports_the_step_from_an_idle_gpu_beside_the_back_to_back_one():
    """A timer that reports ``synchronized_ms`` beside its back-to-back timing (as
    ``step_timer`` does on a GPU): the final rounds keep both, the plan's budget records
    the second speedup, and a host-bound step says it. The verdict stays the timing's."""
    lines = []
    base, _ = _scripted(-1.0)

    def time_step(model):
        ms = base(model)
        time_step.last = {"median_ms": ms, "host_ms": 9.0, "device": "cuda",
                          "synchronized": False,
                          "synchronized_ms": 8.0 if _fp8_sites(model) else 12.0}
        return ms
    time_step.last = None
    result = optimize(_model(), _batches(), _loss, config=_config(), time_step=time_step,
                      rounds=2, progress=lines.append)
    assert result.plan.fp8_sites() and len(result.rounds) == 2
    assert all(r["baseline_synchronized"] == 12.0 and r["plan_synchronized"] == 8.0
               for r in result.rounds)
    assert result.synchronized_speedup == pytest.approx(1.5)
    assert result.plan.budget["optimize"]["synchronized_speedup"] == pytest.approx(1.5)
    said = [ln for ln in lines if "idle GPU" in ln]
    assert len(said) == 1 and "1.500x" in said[0] and f"{result.speedup:.3f}x" in said[0]
    # a synchronized timing, or a timer that does not report it: no second figure
    time_step.last = None

    def synced(model):
        ms = time_step(model)
        synced.last = dict(time_step.last, synchronized=True)
        return ms
    again = optimize(_model(), _batches(), _loss, config=_config(), time_step=synced,
                     rounds=2)
    assert again.synchronized_speedup is None and "baseline_synchronized" not in again.rounds[0]
    plain, _ = _reporting(-1.0, 9.0)
    assert optimize(_model(), _batches(), _loss, config=_config(), time_step=plain,
                    rounds=2).plan.budget["optimize"]["synchronized_speedup"] is None


def test_step_timer_times_steps_synchronized_only_when_asked(monkeypatch):
    """``synchronized`` reaches :func:`loka.timing.time_steps` and the timing's record;
    optimize refuses it with a time_step of the caller's (its own timer's option)."""
    import sys

    opt = sys.modules["loka.dispatch.steptimer"]
    seen = []
    real = opt.time_steps

    def spy(*args, **kw):
        seen.append(kw.get("synchronized"))
        return dict(real(*args, **kw), synchronized_ms=4.25)  # as a GPU timing reports it
    monkeypatch.setattr(opt, "time_steps", spy)
    for flag in (False, True):
        timer = step_timer(_batches()[0], _loss, compile=False, steps=1, warmup=0,
                           synchronized=flag)
        timer(_model())
        assert seen[-1] is flag and timer.last["synchronized"] is flag
        assert timer.last["synchronized_ms"] == 4.25  # passed on, for optimize's rounds
    time_step, calls = _scripted(-1.0)
    with pytest.raises(ValueError, match="synchronized_steps is the default timer's"):
        optimize(_model(), _batches(), _loss, config=_config(), time_step=time_step,
                 synchronized_steps=True)
    assert calls == []


def test_optimize_refuses_inductor_options_it_would_not_use():
    """``compile_options`` belong to the default timer: refused (before any Probe) with a
    time_step of the caller's, with compile=False, and where a key is not an option."""
    time_step, calls = _scripted(-1.0)
    for kw, msg in (({"time_step": time_step}, "a time_step of your own"),
                    ({"compile": False}, "compile=False times eager ones")):
        with pytest.raises(ValueError, match=msg):
            optimize(_model(), _batches(), _loss, config=_config(),
                     compile_options={"cpp_wrapper": True}, **kw)
    for bad in ({"_private": 1}, {"os": 1}, {"patch": 1}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))!r} is not an option"):
            optimize(_model(), _batches(), _loss, config=_config(), compile_options=bad)
    assert calls == []
    # dotted names of its sub-configs are options
    from loka.dispatch.optimize import _recorded, check_compile_options

    assert check_compile_options({"triton.cudagraphs": False}) == {"triton.cudagraphs": False}
    # a plan records JSON values as they are, anything else (a custom pass) by its repr
    assert _recorded({"cpp_wrapper": True, "max_autotune_gemm_backends": "ATEN",
                      "post_grad_custom_post_pass": len}) == {
        "cpp_wrapper": True, "max_autotune_gemm_backends": "ATEN",
        "post_grad_custom_post_pass": repr(len)}


def test_ab_rounds_time_the_plan_first_in_every_second_round():
    """With a timer of the caller's, each round applies the plan, times it, removes it:
    in odd rounds the plan's step is timed before the baseline's, so a host that drifts
    one way within a round favours neither; the budget says how the rounds were timed."""
    first = _tuning_calls()
    time_step, calls = _scripted(-1.0)
    result = optimize(_model(), _batches(), _loss, config=_config(), time_step=time_step,
                      rounds=4)
    n = len(result.plan.fp8_sites())
    assert n and [sites for sites, _ in calls[first:]] == [0, n, n, 0, 0, n, n, 0]
    assert [r["first"] for r in result.rounds] == ["baseline", "plan"] * 2
    assert result.plan.budget["optimize"]["ab_timing"] == {
        "timing": "recompiled",
        "why": "the timer does not pair (a time_step of the caller's)"}


def _scripted_steps(monkeypatch, per_site_ms, host=None):
    """``loka.timing.time_steps`` as the default timer calls it, scripted: a step of the
    model with ``n`` FP8 sites takes 10 + ``per_site_ms`` * n ms (it still runs once), its
    host ``host(n)`` ms (default: the step less 0.5 ms per site); returns the list of
    (sites, ms) timed."""
    import sys

    timer_module = sys.modules["loka.dispatch.steptimer"]
    timed = []
    host_of = host

    def fake(step, device, steps, warmup, host=False, synchronized=False):
        step()
        n = _fp8_sites(step.model)
        ms = 10.0 + per_site_ms * n
        timed.append((n, ms))
        out = {"median_ms": ms, "synchronized": synchronized}
        if host:
            out.update(host_ms=host_of(n) if host_of else ms - 0.5 * n, synchronized_ms=ms)
        return out
    monkeypatch.setattr(timer_module, "time_steps", fake)
    return timed


def test_with_the_default_timer_the_ab_rounds_time_two_live_models_in_turn(monkeypatch):
    """``step_timer``'s ``pair``: the model and a copy of it that holds the plan, compiled
    once, each timed first in half the rounds; the rounds keep both steps' host times;
    the model is left without the plan, as it came."""
    timed = _scripted_steps(monkeypatch, -1.0)
    model = _model()
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=1)
    result = optimize(model, _batches(), _loss, config=_config(), time_step=timer, rounds=3)
    n = len(result.plan.fp8_sites())
    assert n and result.plan.budget["optimize"]["ab_timing"] == {"timing": "paired"}
    assert [r["first"] for r in result.rounds] == ["baseline", "plan", "baseline"]
    assert all(r["baseline"] == 10.0 and r["plan"] == 10.0 - n
               and r["baseline_host"] == 10.0 and r["plan_host"] == 10.0 - 1.5 * n
               for r in result.rounds)
    # the warm-up of both (baseline first), then each round's pair in its order
    assert [s for s, _ in timed[-8:]] == [0, n, 0, n, n, 0, 0, n]
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert model.training  # its mode as it came
    model.eval()  # (a training step is timed in training mode, and the mode comes back)
    optimize(model, _batches(), _loss, config=_config(), time_step=timer, rounds=1)
    assert not model.training


def _uncopyable(model):
    import threading

    model.lock = threading.Lock()  # deepcopy cannot copy a lock
    return model


def _failing_warm_up(monkeypatch):
    from loka.dispatch import PairedSteps

    def fail(self):
        raise RuntimeError("CUDA out of memory (scripted)")
    monkeypatch.setattr(PairedSteps, "warm_up", fail)


@pytest.mark.parametrize("case, why", [
    ("uncopyable", "cannot be copied (TypeError"),
    ("wrapped", "the model is wrapped"),
    ("failing", "pairing failed (RuntimeError: CUDA out of memory (scripted))"),
])
def test_the_ab_rounds_fall_back_to_recompiled_timings_and_say_why(monkeypatch, case, why):
    """A model that cannot be copied or is wrapped, or a copy that fails to compile (its
    warm-up), is timed the other way; the verdict is the same and the model comes back as
    it was."""
    import functools

    _scripted_steps(monkeypatch, -1.0)
    model = _uncopyable(_model()) if case == "uncopyable" else _model()
    if case == "failing":
        _failing_warm_up(monkeypatch)
    given = (torch.compile(model, backend=functools.partial(lambda gm, _: gm))
             if case == "wrapped" else model)
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=1)
    result = optimize(given, _batches(), _loss, config=_config(), time_step=timer, rounds=2)
    how = result.plan.budget["optimize"]["ab_timing"]
    assert how["timing"] == "recompiled" and why in how["why"]
    assert result.plan.fp8_sites() and [r["first"] for r in result.rounds] == [
        "baseline", "plan"]
    assert all("baseline_host" not in r for r in result.rounds)
    assert result.plan.budget["optimize"]["host_ms"] is None
    assert not any(isinstance(m, Linear) for m in model.modules())


def test_a_failed_pairing_frees_the_models_copy(monkeypatch):
    """The copy made for the pair is gone once optimize has fallen back (no reference
    left in the stack or the pair's steps)."""
    import gc
    import weakref

    import sys

    opt = sys.modules["loka.dispatch.steptimer"]
    copies = []
    real = opt._twin

    def spy(model, root):
        twin, why = real(model, root)
        if twin is not None:
            copies.append(weakref.ref(twin))
        return twin, why
    monkeypatch.setattr(opt, "_twin", spy)
    _scripted_steps(monkeypatch, -1.0)
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=1)
    for failing in (False, True):
        if failing:
            _failing_warm_up(monkeypatch)
        optimize(_model(), _batches(), _loss, config=_config(), time_step=timer, rounds=1)
        gc.collect()
        assert len(copies) == 1 + failing and copies[-1]() is None


def test_paired_steps_compile_each_model_once_and_keep_both(monkeypatch):
    """Two models of one class compiled together (Dynamo's backend ``eager``: the
    graphs, not Inductor's code): after the warm-up, rounds in either order compile
    nothing more; the models' modes are theirs again after the pair."""
    import functools

    from torch._dynamo.utils import counters

    class Other(nn.Linear):
        pass

    real = torch.compile
    monkeypatch.setattr(torch, "compile", functools.partial(real, backend="eager"))
    base = _model()
    planned = _model()
    planned[2] = Other(128, 64)  # another class than the baseline's: a second graph
    timer = step_timer(_batches()[0], inference=True, steps=2, warmup=1)
    with timer.pair(base, planned) as paired:
        before = counters["stats"]["unique_graphs"]
        paired.warm_up()
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == before + 2  # one each
        rows = [paired.round(plan_first=bool(i % 2)) for i in range(4)]
        assert counters["stats"]["unique_graphs"] == graphs
        assert not base.training and not planned.training
    assert base.training and planned.training
    assert [r["first"] for r in rows] == ["baseline", "plan"] * 2
    assert all(r["baseline"] > 0 and r["plan"] > 0 and r["plan_host"] > 0 for r in rows)


@pytest.mark.parametrize("host_ms, said", [(9.5, True), (5.0, False)])
def test_a_kept_plan_that_adds_host_time_to_a_host_bound_step_says_so(monkeypatch, host_ms,
                                                                      said):
    """On a GPU (as the timer reports it), a host-bound step whose plan wins by 1 ms per
    site but adds 0.2 ms of host time per site, the host check off (host_slowdown=1.0):
    the plan is kept, its note says by how much and what a slower host would do; the
    budget records both host times. A step that is not host-bound says nothing."""
    _scripted_steps(monkeypatch, -1.0, host=lambda n: host_ms + 0.2 * n)
    lines = []
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=1, device="cuda")
    result = optimize(_model(), _batches(), _loss, config=_config(), time_step=timer,
                      rounds=2, progress=lines.append, host_slowdown=1.0)
    n = len(result.plan.fp8_sites())
    assert n and result.host_bound is said
    budget = result.plan.budget["optimize"]
    assert budget["host_ms"] == {"baseline": host_ms, "plan": pytest.approx(host_ms + 0.2 * n)}
    assert budget["host_check"] is None
    noted = [x for x in result.plan.notes if "of host time per step" in x]
    assert bool(noted) is said and any("of host time per step" in x for x in lines) is said
    if said:
        assert f"adds {200 * n:.0f} us" in noted[0] and "slower than none" in noted[0]
        assert "would not lose" not in noted[0]


def _checked(monkeypatch, per_site_ms, host, slowdown):
    """optimize under the scripted default timer on a GPU (steps of 10 + per_site_ms * n
    ms, host(n) ms): (result, progress lines, FP8 sites of the untuned plan)."""
    _scripted_steps(monkeypatch, per_site_ms, host=host)
    lines = []
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=1, device="cuda")
    result = optimize(_model(), _batches(), _loss, config=_config(), time_step=timer,
                      rounds=2, progress=lines.append, host_slowdown=slowdown)
    return result, lines, len(result.untuned.fp8_sites())


@pytest.mark.parametrize("slowdown, kept", [(1.5, False), (1.2, True), (1.0, True)])
def test_a_plan_whose_host_time_would_cost_its_gain_goes_back_to_the_baseline(monkeypatch,
                                                                              slowdown, kept):
    """Exposed host time: steps of 10 ms that the host issues in 5 ms; the plan wins every
    round by 0.1 ms per FP8 site and adds 0.3 ms of host time per site. On a host 1.5x
    slower that costs 0.15 ms per site, more than it gains, so every site goes back, and
    the note and the budget say why; on one 1.2x slower it costs 0.06 ms (kept); 1.0 turns
    the check off. Back to back (max(step, 1.5 host)) the plan would not be slower: this is
    the exposed model's verdict alone."""
    result, lines, n = _checked(monkeypatch, -0.1, lambda n: 5.0 + 0.3 * n, slowdown)
    assert n and result.host_bound is False
    assert all(r["plan"] < r["baseline"] for r in result.rounds)
    assert bool(result.plan.fp8_sites()) is kept
    check = result.plan.budget["optimize"]["host_check"]
    if slowdown == 1.0:
        assert check is None
    else:
        assert check["passed"] is kept and check["gain_ms"] == pytest.approx(0.1 * n)
        assert check["margin_ms"] == pytest.approx((slowdown - 1) * 0.3 * n)
        assert check["slow_host_ms"] == {
            "baseline": pytest.approx(max(10.0, slowdown * 5.0)),
            "plan": pytest.approx(max(10.0 - 0.1 * n, slowdown * (5.0 + 0.3 * n)))}
        assert check["slow_host_ms"]["plan"] <= check["slow_host_ms"]["baseline"]
    said = [x for x in result.plan.notes if "(host_slowdown)" in x]
    assert bool(said) is (not kept)
    if not kept:
        assert f"by {100 * n:.0f} us per step" in said[0] and f"adds {300 * n:.0f} us" in said[0]
        # 0.15 n lost against 0.1 n gained; back to back it would not be slower
        assert f"all in the step, by {50 * n:.0f} us)" in said[0]
        assert "back to back" not in said[0]
        assert any("(host_slowdown)" in x for x in lines)
    # the last line says what was kept, and whose ratio the rounds measured
    speed = 10.0 / (10.0 - 0.1 * n)
    assert lines[-1] == (f"kept {n}" if kept else "kept 0") + " FP8 site(s)" + (
        f", step {speed:.3f}x of the baseline" if kept
        else f"; the plan timed ran at {speed:.3f}x of the baseline in its rounds")


def test_a_plan_that_would_be_slower_back_to_back_on_a_slower_host_goes_back(monkeypatch):
    """Pipelined: a host-bound step (host 9.5 of 10 ms) whose plan gains 0.5 ms per site and
    adds 0.1 ms of host time per site passes the exposed model (0.5 n >= 0.05 n) but,
    issued back to back on a host 1.5x slower, its step is the host's, 14.25 + 0.15 n ms
    against the baseline's 14.25: it goes back. A plan that adds no host time, or less than
    2% of the baseline's (the rounds' noise), stays: both steps are then the host's."""
    result, _, n = _checked(monkeypatch, -0.5, lambda n: 9.5 + 0.1 * n, 1.5)
    check = result.plan.budget["optimize"]["host_check"]
    assert n and 0.1 * n > 0.02 * 9.5  # more than the noise
    assert not result.plan.fp8_sites() and check["passed"] is False
    assert check["gain_ms"] >= check["margin_ms"]  # the exposed model alone would keep it
    assert check["slow_host_ms"] == {"baseline": pytest.approx(14.25),
                                     "plan": pytest.approx(1.5 * (9.5 + 0.1 * n))}
    note = [x for x in result.plan.notes if "(host_slowdown)" in x][0]
    assert f"(issued back to back, {1.5 * (9.5 + 0.1 * n):.3f} against 14.250 ms)" in note
    assert "all in the step" not in note
    for host in (lambda n: 9.5, lambda n: 9.5 * (1.019 if n else 1.0)):
        same, _, _ = _checked(monkeypatch, -0.5, host, 1.5)
        check = same.plan.budget["optimize"]["host_check"]
        assert same.plan.fp8_sites() and check["passed"] and check["margin_ms"] == 0.0
        assert check["slow_host_ms"]["plan"] == pytest.approx(14.25)


def test_the_host_check_weighs_the_gain_against_the_host_time_added():
    """host_check on rounds as the paired rounds record them: medians of the steps and of
    the host times; a plan that takes host time off passes whatever the slowdown; rounds
    that did not time the host give None."""
    import sys

    opt = sys.modules["loka.dispatch.optimize"]
    rounds = [{"baseline": 1.0, "plan": 0.9, "baseline_host": 0.5, "plan_host": 0.6},
              {"baseline": 1.1, "plan": 0.95, "baseline_host": 0.52, "plan_host": 0.7},
              {"baseline": 1.0, "plan": 0.92, "baseline_host": 0.5, "plan_host": 0.62}]
    check = opt.host_check(rounds, 1.5)  # gain 0.08, added 0.12: margin 0.06
    assert check["gain_ms"] == pytest.approx(0.08) and check["host_added_ms"] == \
        pytest.approx(0.12) and check["margin_ms"] == pytest.approx(0.06) and check["passed"]
    assert check["slow_host_ms"] == {"baseline": pytest.approx(1.0),
                                     "plan": pytest.approx(0.93)}  # 1.5 * 0.62 over 0.92
    assert not opt.host_check(rounds, 2.0)["passed"]  # margin 0.12 > 0.08
    mid = opt.host_check(rounds, 1.65)  # margin 0.078 <= 0.08, but back to back
    assert mid["margin_ms"] <= mid["gain_ms"] and not mid["passed"]
    assert mid["slow_host_ms"]["plan"] == pytest.approx(1.023)  # 1.65 * 0.62 > 1.0
    lighter = [dict(r, plan_host=0.4) for r in rounds]
    assert opt.host_check(lighter, 10.0)["passed"]  # no host time added
    assert opt.host_check(lighter, 10.0)["margin_ms"] == 0.0
    assert opt.host_check([{"baseline": 1.0, "plan": 0.9}], 1.5) is None
    assert opt.host_check([], 1.5) is None


@pytest.mark.parametrize("why", ["uncopyable", "timer"])
def test_the_host_check_runs_on_rounds_that_recompile_too(monkeypatch, why):
    """Rounds that apply and remove the plan (a model that cannot be copied, a timer that
    does not pair) keep each timing's host time where the timer reports it on a GPU, so
    the check runs there too: the exposed-host plan of the test above goes back."""
    import sys

    timer_module = sys.modules["loka.dispatch.steptimer"]
    _scripted_steps(monkeypatch, -0.1, host=lambda n: 5.0 + 0.3 * n)
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=1, device="cuda")
    if why == "uncopyable":
        monkeypatch.setattr(timer_module, "_twin", lambda model, root: (None, "no copy"))
    else:
        inner = timer

        def timer(model):  # the default timer's timings, without its pair
            ms = inner(model)
            timer.last = inner.last
            return ms
        timer.last = None
    result = optimize(_model(), _batches(), _loss, config=_config(), time_step=timer,
                      rounds=2)
    n = len(result.untuned.fp8_sites())
    budget = result.plan.budget["optimize"]
    assert n and budget["ab_timing"]["timing"] == "recompiled"
    assert all(r["baseline_host"] == 5.0 and r["plan_host"] == pytest.approx(5.0 + 0.3 * n)
               for r in result.rounds)
    assert budget["host_check"]["passed"] is False and not result.plan.fp8_sites()


def test_lost_rounds_leave_the_host_check_unrun(monkeypatch):
    """A plan that lost its rounds went back already: no host check, no note of it."""
    result, _, n = _checked(monkeypatch, 0.5, lambda n: 5.0, 1.5)
    assert n and not result.plan.fp8_sites()
    assert result.plan.budget["optimize"]["host_check"] is None
    assert not any("(host_slowdown)" in x for x in result.plan.notes)


@pytest.mark.parametrize("bad", [0.99, 0.0, -1.0, float("nan"), float("inf"), "1.5", None,
                                 True])
def test_optimize_refuses_a_host_slowdown_below_one_or_not_a_number(bad):
    with pytest.raises(ValueError, match="host_slowdown must be a finite number >= 1.0"):
        optimize(_model(), _batches(), _loss, config=_config(), host_slowdown=bad)


@pytest.mark.parametrize("pairs", [True, False])
def test_timing_leaves_the_models_gradients_and_running_statistics_as_they_were(monkeypatch,
                                                                                  pairs):
    """Timed training steps (scripted: each still runs once) replace gradients and move a
    BatchNorm's running statistics; optimize puts both back, whichever way it times."""
    _scripted_steps(monkeypatch, -1.0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
                          nn.Linear(128, 32))
    grads = [torch.full_like(p, 0.5) for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    norm = model[1]
    mean, var, seen = (norm.running_mean.clone(), norm.running_var.clone(),
                       int(norm.num_batches_tracked))
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=1)
    if not pairs:
        _uncopyable(model)
    result = optimize(model, _batches(), _loss, config=_config(), time_step=timer, rounds=2)
    assert result.rounds  # steps were timed (and ran)
    assert result.plan.budget["optimize"]["ab_timing"]["timing"] == (
        "paired" if pairs else "recompiled")
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert torch.equal(norm.running_mean, mean) and torch.equal(norm.running_var, var)
    assert int(norm.num_batches_tracked) == seen


def test_paired_trials_time_a_copy_without_fp8_beside_each_trial(monkeypatch):
    """With the default timer, paired tuning trials compare each plan with a copy of the
    model without FP8, compiled beside it and timed in the same round (each first in
    every second trial), not with a baseline compiled and timed seconds before."""
    timed = _scripted_steps(monkeypatch, -1.0)
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=1)
    model = _model()
    result = optimize(model, _batches(), _loss, config=_config(), time_step=timer, rounds=1,
                      paired_trials=True)
    trials = [t for t in result.trials if t["sites"]]
    assert trials and all(t["paired_with"] == "copy" for t in trials)
    assert all(t["baseline_time"] == 10.0 and t["raw_time"] == 10.0 - len(t["sites"])
               for t in trials)
    assert result.trials[0]["sites"] == [] and "paired_with" not in result.trials[0]
    # the first trial timed alone (the reference), then each paired trial: both warm-ups,
    # then the two timings in the trial's order
    n = len(trials[0]["sites"])
    assert [s for s, _ in timed[1:5]] == [0, n, n, 0]
    assert result.plan.fp8_sites() and not any(isinstance(m, Linear) for m in model.modules())


def test_step_timer_captures_each_whole_step_when_asked(monkeypatch):
    """``capture``: every step the timer times (one model, and both of a pair) is a
    :class:`loka.timing.CapturedStep` of the training step (forward, loss, backward), with
    no cudagraph step marks (no Inductor graphs inside); the record says so. Refused beside
    Inductor's CUDA graphs, and by optimize with a time_step of the caller's."""
    import sys

    st = sys.modules["loka.dispatch.steptimer"]
    made, timed = [], []

    class Captured:
        def __init__(self, step, device, warmup=3):
            made.append((device, warmup))
            self.step, self.model = step, step.model

        def __call__(self):
            return self.step()

    def fake_time_steps(step, device, steps, warmup, host=False, synchronized=False):
        timed.append(step)
        step()
        return {"median_ms": 2.0, "host_ms": 0.01, "synchronized_ms": 2.1}
    monkeypatch.setattr(st, "CapturedStep", Captured)
    monkeypatch.setattr(st, "time_steps", fake_time_steps)
    model = _model()
    timer = step_timer(_batches()[0], _loss, compile=False, steps=2, warmup=2, device="cuda",
                       capture=True)
    assert timer(model) == 2.0 and timer.last["captured"] is True
    assert isinstance(timed[-1], Captured) and made == [(torch.device("cuda"), 2)]
    assert all(p.grad is None for p in model.parameters())  # the step drops its gradients
    with timer.pair(model, _model()) as paired:
        assert all(isinstance(s, Captured) for s in paired.steps.values())
        assert len(made) == 3
    plain = step_timer(_batches()[0], _loss, compile=False, steps=1, warmup=0, device="cuda")
    plain(model)
    assert not isinstance(timed[-1], Captured) and plain.last["captured"] is False
    for kw in ({"compile_mode": "reduce-overhead"}, {"compile_mode": "max-autotune"},
               {"compile_options": {"triton.cudagraphs": True}}):
        with pytest.raises(ValueError, match="one CUDA graph of its own"):
            step_timer(_batches()[0], _loss, capture=True, **kw)
    step_timer(_batches()[0], _loss, capture=True, compile_mode="max-autotune-no-cudagraphs")
    time_step, calls = _scripted(-1.0)
    with pytest.raises(ValueError, match="capture_steps is the default timer's"):
        optimize(_model(), _batches(), _loss, config=_config(), time_step=time_step,
                 capture_steps=True)
    assert calls == []
    # beside Inductor's graphs: refused before any Probe, even where nothing is timed (CPU)
    probed = []
    monkeypatch.setattr(sys.modules["loka.dispatch.optimize"], "probe",
                        lambda *a, **k: probed.append(1))
    with pytest.raises(ValueError, match="one CUDA graph of its own"):
        optimize(_model(), _batches(), _loss, config=_config(), capture_steps=True,
                 compile_mode="reduce-overhead")
    assert probed == []


def test_step_timer_capture_needs_a_cuda_device():
    timer = step_timer(_batches()[0], _loss, compile=False, steps=1, warmup=1, capture=True)
    with pytest.raises(ValueError, match="runs in a CUDA graph: the device is cpu"):
        timer(_model())
