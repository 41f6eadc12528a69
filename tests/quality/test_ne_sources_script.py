"""bench/ne_sources.py --mode plan: the default plan's paired NE change, the NE budget, and
the plan files it writes (the GPU row of the NE budget table, run here at CPU size)."""

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from loka.dispatch import Plan
from loka.quality import fp8_site_roles

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _script():
    import importlib
    return importlib.import_module("bench.ne_sources")


def test_cached_batches_are_the_streams_own():
    script = _script()
    args = types.SimpleNamespace(table_rows=100, eval_batch=32, batch_size=16, eval_batches=3,
                                 steps=4, cache_batches=False)
    _, train_a, eval_a = script.terms("wukong", "tiny", args, torch.device("cpu"))
    args.cache_batches = True
    _, train_b, eval_b = script.terms("wukong", "tiny", args, torch.device("cpu"))
    for a, b in zip(list(zip(range(4), train_a(3))), list(train_b(3))):
        assert torch.equal(a[1].dense, b.dense) and torch.equal(a[1].labels, b.labels)
        assert a[1].sparse.keys() == b.sparse.keys()
        assert all(torch.equal(a[1].sparse[k].values, b.sparse[k].values) and
                   torch.equal(a[1].sparse[k].offsets, b.sparse[k].offsets) for k in b.sparse)
    assert len(list(train_b(3))) == 4  # replayed from the start every time
    held_a, held_b = list(eval_a()), list(eval_b())
    assert len(held_a) == len(held_b) == 3
    assert all(torch.equal(x.labels, y.labels) for x, y in zip(held_a, held_b))


def test_plan_mode_writes_the_default_plan_its_check_and_the_budget(tmp_path, capsys):
    script = _script()
    out, plan_out, budget_out = tmp_path / "ne.json", tmp_path / "p.json", tmp_path / "pb.json"
    assert script.main(["--mode", "plan", "--models", "wukong:tiny", "--steps", "20",
                        "--eval-batches", "4", "--eval-batch", "256", "--batch-size", "64",
                        "--seeds", "0,1", "--cache-batches", "--max-ne-change", "2e-4",
                        "--plan-out", str(plan_out), "--budget-plan-out", str(budget_out),
                        "--speed-steps", "3", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["models"]["wukong:tiny"]
    plan, within = Plan.load(plan_out), Plan.load(budget_out)
    assert row["plan"]["fp8_site_roles"] == len(fp8_site_roles(plan)) > 0
    assert row["plan"]["head_sites"] == plan.budget["head_sites"] == 3  # loka.plan's default
    budget = row["budget"]
    # the default plan's paired change is the budget's first check (nothing moved back),
    # kept in full as it was made
    assert row["default_plan"]["moved_back"] == 0
    kept0 = row["check_results"]["0"]
    assert kept0["meta"]["moved_back"] == []
    assert kept0["summary"]["rel_ne_change"] == row["default_plan"]["rel_ne_change"]
    assert kept0["summary"]["rel_ne_seeds"] == row["default_plan"]["rel_ne_seeds"]
    lo, hi = row["default_plan"]["rel_ne_seeds"]
    assert lo <= row["default_plan"]["rel_ne_change"] <= hi == row["default_plan"]["upper"]
    assert budget["kept_site_roles"] == len(fp8_site_roles(within))
    assert budget["kept_site_roles"] + len(budget["moved_back"]) == row["plan"]["fp8_site_roles"]
    assert budget["upper"] <= 2e-4
    assert len(row["costs"]) == row["plan"]["fp8_site_roles"]
    assert any("moved back: relative NE change" in line for line in row["progress"])
    assert "speed" not in row  # compiled step timings are taken on a GPU only
    assert sorted(int(k) for k in row["check_results"]) == sorted(
        c["moved_back"] for c in budget["checks"])
    with pytest.raises(SystemExit):
        script.main(["--mode", "budgets", "--out", str(out)])
    assert "invalid choice" in capsys.readouterr().err

    # a run cut short in its cost phase (5 costs kept, no check) resumes where it stopped,
    # writing over the very file it resumes
    doc = json.loads(out.read_text())
    cut = doc["models"]["wukong:tiny"]
    total = len(cut["costs"])
    cut["costs"] = cut["costs"][:5]
    cut["check_results"] = {}
    for key in ("default_plan", "budget"):
        del cut[key]
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps(doc))
    common = ["--mode", "plan", "--models", "wukong:tiny", "--steps", "20", "--eval-batches",
              "4", "--eval-batch", "256", "--batch-size", "64", "--seeds", "0,1",
              "--cache-batches", "--max-ne-change", "2e-4", "--plan-in", str(plan_out)]
    assert script.main(common + ["--resume", str(partial), "--out", str(partial)]) == 0
    resumed = json.loads(partial.read_text())["models"]["wukong:tiny"]
    assert resumed["resumed"] == {"from": str(partial), "costs": 5, "checks": []}
    measured = [line for line in resumed["progress"] if ": cost " in line]
    assert len(measured) == total - 5  # only the costs not kept were measured again
    assert sorted(map(json.dumps, resumed["costs"])) == sorted(map(json.dumps, row["costs"]))
    # the same checks and the same outcome as the run that was not cut short (CPU: exact)
    assert resumed["budget"]["moved_back"] == budget["moved_back"]
    assert resumed["budget"]["checks"] == budget["checks"]

    # cut short after its first check: that check is not made again
    doc = json.loads(out.read_text())
    doc["models"]["wukong:tiny"]["check_results"] = {"0": kept0}
    partial.write_text(json.dumps(doc))
    again = tmp_path / "again.json"
    assert script.main(common + ["--resume", str(partial), "--out", str(again)]) == 0
    twice = json.loads(again.read_text())["models"]["wukong:tiny"]
    assert twice["resumed"] == {"from": str(partial), "costs": total, "checks": [0]}
    assert not any(": cost " in line for line in twice["progress"])
    assert sum("moved back: made before" in line for line in twice["progress"]) == 1
    assert twice["budget"]["checks"] == budget["checks"]
    # another run's terms, another plan, or a run that predates resuming: one line each
    with pytest.raises(SystemExit, match="its run had other terms \\(steps\\)"):
        script.main([a if a != "20" else "21" for a in common]
                    + ["--resume", str(partial), "--out", str(tmp_path / "x.json")])
    within_args = [a if a != str(plan_out) else str(budget_out) for a in common]
    with pytest.raises(SystemExit, match="plan differs from this one"):
        script.main(within_args + ["--resume", str(partial), "--out", str(tmp_path / "x.json")])
    del doc["models"]["wukong:tiny"]["plan"]["digest"]
    partial.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="predates resumable runs"):
        script.main(common + ["--resume", str(partial), "--out", str(tmp_path / "x.json")])


def test_start_state_is_the_seed_0_baseline_trained_on_its_own_stream(tmp_path, monkeypatch,
                                                                     capsys):
    """--start-steps: every arm (costs and checks) starts from one trained baseline, made
    once; --mode horizon reports from scratch and from that start, each interval holding
    its change."""
    script = _script()
    seen, opts = [], []
    real = script.PairedArms

    class Spy(real):
        def __init__(self, *a, **kw):
            seen.append(kw.get("initial_state"))
            opts.append(kw.get("initial_optimizer_state"))
            super().__init__(*a, **kw)

    monkeypatch.setattr(script, "PairedArms", Spy)
    import loka.quality.budget as qb
    monkeypatch.setattr(qb, "PairedArms", Spy)
    out = tmp_path / "ne.json"
    common = ["--models", "wukong:tiny", "--steps", "8", "--eval-batches", "2", "--eval-batch",
              "128", "--batch-size", "32", "--seeds", "0,1", "--cache-batches"]
    assert script.main(["--mode", "plan", *common, "--start-steps", "6", "--max-baseline-ne",
                        "0", "--max-ne-change", "0.5", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["models"]["wukong:tiny"]
    assert row["start"]["steps"] == 6 and row["start"]["seed"] == script.START_SEED
    assert len(seen) >= 2 and all(s is not None for s in seen)
    assert all(s is seen[0] for s in seen)  # one start, made once, shared by every arm
    # ... with its optimizer states: the arms continue its Adam moments
    assert all(o is opts[0] for o in opts) and len(opts[0]) == 1 and opts[0][0]["state"]
    assert all(int(v["step"]) == 6 for v in opts[0][0]["state"].values())
    args = types.SimpleNamespace(batch_size=32, lr=3e-3, warmup_steps=0)
    build = lambda seed: script.build_reference("wukong", "tiny", None, torch.device("cpu"),  # noqa: E731
                                                seed=seed, table_rows=100)
    again = script.start_state(build, args, torch.device("cpu"), 6)
    assert all(torch.equal(again["model"][k], seen[0][k]) for k in again["model"])  # deterministic
    assert script.state_digest(again) == row["start"]["digest"]
    fresh = build(0).state_dict()
    assert any(not torch.equal(fresh[k], again["model"][k]) for k in fresh)  # it did train
    # a warm-up changes the start, and the digest covers the optimizer states too
    args.warmup_steps = 3
    warm = script.start_state(build, args, torch.device("cpu"), 6)
    assert script.state_digest(warm) != row["start"]["digest"]
    moved = {"model": again["model"], "optimizers": warm["optimizers"]}
    assert script.state_digest(moved) not in (row["start"]["digest"], script.state_digest(warm))

    seen.clear()
    opts.clear()
    hout = tmp_path / "h.json"
    assert script.main(["--mode", "horizon", *common, "--start-steps", "6", "--horizons",
                        "2,4", "--out", str(hout)]) == 0
    assert opts[0] is None and opts[1] is not None and opts[2] is opts[1]
    rows = json.loads(hout.read_text())["models"]["wukong:tiny"]["rows"]
    assert list(rows) == ["from scratch, 8 steps", "from 6 steps, 2 more", "from 6 steps, 4 more"]
    assert seen[0] is None and seen[1] is not None and seen[2] is seen[1]
    for v in rows.values():
        lo, hi = v["rel_ne_seeds"]
        assert lo <= v["rel_ne_change"] <= hi and len(v["per_seed"]) == 2
    for bad, needle in ((["--horizons", "a,b"], "--horizons"), (["--horizons", "0"], ">= 1"),
                        (["--start-steps", "-1"], ">= 0")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            script.main(["--mode", "horizon", *common, *bad, "--out", str(hout)])
        assert needle in capsys.readouterr().err


def test_a_resume_from_a_checkpoint_start_is_checked_before_anything_is_written(tmp_path,
                                                                                 capsys):
    """With --start-steps, a refused resume leaves the file it resumes as it was (--out may
    be that file); a start whose weights differ is refused; the start's stream is no arm's;
    horizon arms longer than --steps get every batch they need from the cache."""
    script = _script()
    out, plan_out = tmp_path / "ne.json", tmp_path / "p.json"
    common = ["--mode", "plan", "--models", "wukong:tiny", "--steps", "6", "--eval-batches",
              "2", "--eval-batch", "128", "--batch-size", "32", "--seeds", "0,1",
              "--cache-batches", "--start-steps", "4", "--max-ne-change", "0.5",
              "--max-baseline-ne", "0"]
    assert script.main(common + ["--plan-out", str(plan_out), "--out", str(out)]) == 0
    before = out.read_text()
    row = json.loads(before)["models"]["wukong:tiny"]
    assert row["start"]["digest"].startswith("sha256:") and row["costs"] and row["check_results"]
    # another plan: refused, and the file is untouched
    other = Plan.load(plan_out)
    site = next(iter(other.fp8_sites()))
    other.sites[site].roles[next(r for r, c in other.sites[site].roles.items()
                                 if c.kernel != other.baseline)].kernel = other.baseline
    other_path = tmp_path / "other.json"
    other.save(other_path)
    with pytest.raises(SystemExit, match="plan differs"):
        script.main(common + ["--plan-in", str(other_path), "--resume", str(out),
                              "--out", str(out)])
    assert out.read_text() == before
    # a start that trained to other weights: refused, the file untouched
    doc = json.loads(before)
    doc["models"]["wukong:tiny"]["start"]["digest"] = "sha256:0"
    out.write_text(json.dumps(doc))
    with pytest.raises(SystemExit, match="started from another start"):
        script.main(common + ["--plan-in", str(plan_out), "--resume", str(out),
                              "--out", str(out)])
    assert json.loads(out.read_text()) == doc
    # the same start resumes: every check made before is reused
    out.write_text(before)
    again = tmp_path / "again.json"
    assert script.main(common + ["--plan-in", str(plan_out), "--resume", str(out),
                                 "--out", str(again)]) == 0
    twice = json.loads(again.read_text())["models"]["wukong:tiny"]
    assert twice["start"]["digest"] == row["start"]["digest"]
    assert not any(": cost " in line or line.endswith(" moved back")
                   for line in twice["progress"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        script.main(common[:-2] + ["--seeds", f"0,{script.START_SEED}", "--out", str(again)])
    assert "checkpoint start's own stream" in capsys.readouterr().err
    # horizon arms of 9 steps with a 3-step cache request: the cache holds all 9
    hout = tmp_path / "h.json"
    assert script.main(["--mode", "horizon", "--models", "wukong:tiny", "--steps", "3",
                        "--eval-batches", "2", "--eval-batch", "128", "--batch-size", "32",
                        "--seeds", "0,1", "--cache-batches", "--start-steps", "3",
                        "--horizons", "9", "--out", str(hout)]) == 0
    assert "from 3 steps, 9 more" in json.loads(hout.read_text())["models"]["wukong:tiny"]["rows"]


def test_plan_mode_stops_on_a_baseline_that_did_not_learn(tmp_path):
    """A baseline no better than the base rate (here: two steps of the tiny model) makes
    every NE change meaningless. From scratch the short cost arms are not held to it, the
    checks' baselines are: the run stops before any check's plan arm, saying so. From a
    checkpoint even the cost arms' baseline must have learned: the run stops before any
    cost. The file keeps the reason (and, from a checkpoint, the baselines' NE)."""
    script = _script()
    out = tmp_path / "ne.json"
    args = ["--mode", "plan", "--models", "wukong:tiny", "--steps", "2", "--cost-steps", "2",
            "--eval-batches", "2", "--eval-batch", "128", "--batch-size", "32", "--seeds",
            "0,1", "--cache-batches", "--out", str(out)]
    with pytest.raises(SystemExit, match="stopped: the baseline did not learn in 2 steps "
                                         "\\(seed 0: NE"):
        script.main(args)
    row = json.loads(out.read_text())["models"]["wukong:tiny"]
    assert "did not learn" in row["error"] and row["costs"] and row["check_results"] == {}
    assert not any("moved back" in line for line in row["progress"])

    with pytest.raises(SystemExit, match="stopped: the baseline did not learn in 2 steps"):
        script.main(args + ["--start-steps", "2"])
    row = json.loads(out.read_text())["models"]["wukong:tiny"]
    assert row["costs"] == [] and list(row["baseline_ne"]) == ["2 steps, seed 0"]
    assert row["baseline_ne"]["2 steps, seed 0"] >= 1.0
    assert not any(": cost " in line for line in row.get("progress", []))
    with pytest.raises(SystemExit):
        script.main(args + ["--warmup-steps", "-1"])


def test_head_sites_must_be_a_count(capsys):
    script = _script()
    with pytest.raises(SystemExit) as e:
        script.main(["--mode", "plan", "--head-sites", "-1", "--out", "x.json"])
    assert e.value.code == 2
    assert "expected an integer >= 0" in capsys.readouterr().err


def test_a_default_plan_without_fp8_stops_before_any_arm(tmp_path):
    import torch

    from loka.assembly import build_reference
    from loka.config import LinearConfig
    script = _script()
    model = build_reference("wukong", "tiny", None, torch.device("cpu"), seed=0, table_rows=100)
    path, out = tmp_path / "bf16.json", tmp_path / "ne.json"
    Plan.uniform(model, LinearConfig.uniform("bf16")).save(path)
    assert script.main(["--mode", "plan", "--models", "wukong:tiny", "--steps", "2",
                        "--plan-in", str(path), "--out", str(out)]) == 0
    row = json.loads(out.read_text())["models"]["wukong:tiny"]
    assert row["plan"]["fp8_site_roles"] == 0
    assert row["stopped"] == "the default plan has no FP8 site-role: no NE to check"
    assert "costs" not in row and "budget" not in row
