"""The ``loka`` command line: its frozen surface, its errors, and each subcommand's work."""

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch

import loka
import loka.config
from loka import cli
from loka.cli import args as cli_args
from loka.cli import commands
from loka.dispatch import Plan
from loka.probe.report import ProbeReport

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Changing the CLI is a decision: update this literal with it (torchtitan's frozen-CLI test).
COMMON = ["--debug", "--device"]
SURFACE = {
    "apply": COMMON + ["--check", "--data", "--inference", "--model", "--mods", "--preset",
                       "<plan>"],
    "audit": COMMON + ["--json", "<plan>", "<report>"],
    "bench": COMMON + ["--batch-size", "--batch-sizes", "--infer-variants", "--max-error", "--min-speedup",
                       "--model", "--no-compile", "--no-plot", "--out", "--plan",
                       "--plans", "--preset", "--probe-kernels", "--profile", "--profile-ops", "--steps",
                       "--train-variants", "--warmup"],
    "demo": COMMON + ["--batch-size", "--max-error", "--model", "--out", "--preset",
                      "--probe-steps", "--quick", "--seed", "--steps"],
    "kernels": COMMON + ["--json"],
    "optimize": COMMON + ["--batch-size", "--checkpoint", "--compile-mode", "--data", "--inference",
                          "--kernels", "--max-error", "--max-trials", "--min-speedup", "--mods",
                          "--no-compile", "--num-samples", "--out", "--preset", "--report",
                          "--rounds", "--seed", "--steps", "-o", "<model>"],
    "plan": COMMON + ["--assign", "--assume-fast", "--kernels", "--max-error", "--metric",
                      "--min-speedup", "--out", "--replace", "--role-budget", "--site-budget", "-o", "<report>"],
    "probe": COMMON + ["--batch-size", "--bootstrap", "--checkpoint", "--data", "--every-n-steps",
                       "--kernels", "--lr", "--max-error", "--min-speedup", "--mods",
                       "--module-filter", "--no-naive", "--no-timing", "--num-samples", "--out",
                       "--preset", "--roles", "--sample-rows", "--seed", "--source", "--steps",
                       "-o", "<model>"],
    "report": COMMON + ["--curves", "--html", "--markdown", "--metric", "--tensorboard",
                        "--title", "<files>"],
    "train": COMMON + ["--batch-size", "--checkpoint-every", "--data", "--eval-every",
                       "--eval-steps", "--lr", "--model", "--mods", "--out", "--plan", "--preset",
                       "--resume", "--seed", "--steps"],
}
TOP = ["--debug", "--device", "--version"]


def _surface(parser):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, p in sub.choices.items():
        opts = []
        for a in p._actions:
            if not isinstance(a, argparse._HelpAction):
                opts += a.option_strings or [f"<{a.dest}>"]
        out[name] = sorted(opts)
    top = sorted(o for a in parser._actions
                 if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))
                 for o in a.option_strings)
    return top, out


def test_cli_surface_is_frozen():
    top, surface = _surface(cli.build_parser())
    assert top == TOP
    assert surface == {k: sorted(v) for k, v in SURFACE.items()}


# ... and what each command takes when an option is left out, so that moving an option (to
# another module, another parser) cannot change its default unnoticed
REQUIRED = {"apply": ["PLAN"], "audit": ["PLAN", "REPORT"], "plan": ["REPORT"], "optimize": ["MODEL"],
            "probe": ["MODEL"], "report": ["FILE"]}
DEFAULTS = {
    "apply": {"check": False, "data": "synthetic", "inference": False, "model": "wukong",
              "mods": "none", "plan": "PLAN", "preset": "tiny"},
    "audit": {"json": False, "plan": "PLAN", "report": "REPORT"},
    "bench": {"batch_size": None, "batch_sizes": None, "infer_variants": None, "max_error": 0.2,
              "min_speedup": 1.05, "model": "wukong", "no_compile": False, "no_plot": False,
              "out": None, "plan": None, "plans": "", "preset": None, "probe_kernels": None,
              "profile": "", "profile_ops": False, "steps": 30, "train_variants": None,
              "warmup": 5},
    "demo": {"batch_size": None, "max_error": 0.2, "model": "wukong", "out": "./loka-demo",
             "preset": None, "probe_steps": None, "quick": False, "seed": 0, "steps": None},
    "kernels": {"json": False},
    "optimize": {"batch_size": None, "checkpoint": None, "compile_mode": None, "data": "synthetic",
                 "inference": False, "kernels": None, "max_error": 0.2, "max_trials": 16,
                 "min_speedup": 1.05, "model": "MODEL", "mods": "none", "no_compile": False,
                 "num_samples": 16, "out": "plan.json", "preset": "tiny", "report": None,
                 "rounds": 3, "seed": 0, "steps": 8},
    "plan": {"assign": [], "assume_fast": False, "kernels": None, "max_error": 0.2,
             "metric": "mere", "min_speedup": 1.05, "out": "plan.json", "replace": [],
             "report": "REPORT", "role_budget": None, "site_budget": None},
    "probe": {"batch_size": None, "bootstrap": 1000, "checkpoint": None, "data": "synthetic",
              "every_n_steps": 5, "kernels": None, "lr": 0.001, "max_error": 0.2,
              "min_speedup": 1.05, "model": "MODEL", "mods": "none", "module_filter": None,
              "no_naive": False, "no_timing": False, "num_samples": 64, "out": "report.json",
              "preset": "tiny", "roles": None, "sample_rows": None, "seed": 0,
              "source": "learned", "steps": 20},
    "report": {"curves": None, "files": ["FILE"], "html": None, "markdown": None,
               "metric": "mere", "tensorboard": None, "title": "LoKA report"},
    "train": {"batch_size": None, "checkpoint_every": 0, "data": "synthetic", "eval_every": 0,
              "eval_steps": 20, "lr": 0.001, "model": "wukong", "mods": "none",
              "out": "runs/loka", "plan": None, "preset": "tiny", "resume": False, "seed": 0,
              "steps": 200},
}


@pytest.mark.parametrize("command", sorted(SURFACE))
def test_cli_defaults_are_frozen(command):
    args = vars(cli.build_parser().parse_args([command] + REQUIRED.get(command, [])))
    assert args == dict(DEFAULTS[command], command=command, debug=False, device=None)
    assert callable(getattr(commands, f"cmd_{command}"))  # what main runs for it


def run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", sorted(SURFACE))
def test_help_has_examples(command, capsys):
    code, out, _ = run([command, "--help"], capsys)
    assert code == 0
    assert "examples:" in out and f"loka {command}" in out


def test_no_command_is_a_usage_error(capsys):
    code, _, err = run([], capsys)
    assert code == 2 and "usage: loka" in err and "demo" in err


@pytest.mark.parametrize("module", ["loka.cli", "loka"])
def test_module_entry_point_runs(module):
    proc = subprocess.run([sys.executable, "-m", module, "--version"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("loka ")


def test_help_loads_no_model_code():
    """``loka --help`` needs no model: the commands, and the models they build (whose import
    loads torch.compile's machinery), load when a command runs."""
    code = ("import sys; from loka.cli import main; main(['--help']); "
            "print([m for m in ('loka.cli.commands', 'loka.assembly', 'loka.models', "
            "'torch._dynamo') if m in sys.modules])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


# -- files used by the error cases -------------------------------------------------------
@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "corrupt.json").write_text('{"schema": "loka.plan", "version": 1, "sites": ')
    (d / "foreign.json").write_text(json.dumps({"schema": "something.else", "version": 1}))
    (d / "noschema.json").write_text(json.dumps([1, 2, 3]))
    (d / "curves-bad.json").write_text(json.dumps({"arms": [1, 2]}))
    from loka import models

    torch.manual_seed(0)
    wukong = models.build("wukong", "tiny")
    Plan.uniform(wukong, "emulated-rowwise-e4m3", device="cpu").save(d / "wukong-plan.json")
    ProbeReport(device="cpu").save(d / "empty-report.json")
    return d


def _expect_error(code, err, want_code, *needles):
    lines = err.strip().splitlines()
    assert code == want_code, err
    assert lines and lines[0].startswith("error: "), err
    assert len(lines) <= 2 and (len(lines) == 1 or lines[1].startswith("hint: ")), err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, (n, err)


@pytest.mark.parametrize("argv,code,needles", [
    # demo
    (["demo", "--preset", "huge"], 2, ["unknown preset 'huge'", "presets: tiny"]),
    (["demo", "--model", "nope", "--quick"], 2, ["unknown model 'nope'", "wukong"]),
    (["demo", "--steps", "0"], 2, ["--steps"]),
    # train
    (["train", "--preset", "huge"], 2, ["unknown preset 'huge'"]),
    (["train", "--mods", "fancy"], 2, ["unknown Mod 'fancy'"]),
    (["train", "--mods", "blocknorm=abc"], 2, ["blocknorm needs an integer"]),
    (["train", "--data", "parquet:x"], 2, ["expected 'synthetic' or 'criteo:PATH'"]),
    (["train", "--data", "criteo:{d}/missing.tsv"], 1, ["no Criteo file"]),
    (["train", "--plan", "{d}/missing.json"], 1, ["no such file", "loka plan report.json"]),
    (["train", "--plan", "{d}/corrupt.json"], 1, ["not valid JSON"]),
    (["train", "--model", "dlrm", "--plan", "{d}/wukong-plan.json"], 1,
     ["plan does not match this model", "made for another model"]),
    # probe
    (["probe", "nosuchmodel"], 2, ["unknown model 'nosuchmodel'"]),
    (["probe", "wukong", "--preset", "huge"], 2, ["unknown preset"]),
    (["probe", "wukong", "--kernels", "bf16,warp-speed"], 2, ["unknown kernel(s) ['warp-speed']",
                                                              "loka kernels"]),
    (["probe", "wukong", "--roles", "fwd,sideways"], 2, ["unknown role 'sideways'"]),
    (["probe", "wukong", "--module-filter", "(unclosed"], 2, ["not a regular expression"]),
    (["probe", "no_such_module_xyz:factory"], 1, ["cannot import 'no_such_module_xyz'"]),
    (["probe", "os:getcwd"], 1, ["returned a str, not an nn.Module"]),
    (["probe", "os.path:join"], 1, ["the factory raised TypeError", "without arguments"]),
    (["probe", "os:no_such_factory"], 1, ["os has no attribute 'no_such_factory'"]),
    (["probe", "os:"], 2, ["expected a reference model name or module:factory"]),
    (["probe", "wukong", "--num-samples", "1"], 2, ["--num-samples must be >= 2"]),
    (["probe", "wukong", "--checkpoint", "{d}/missing.pt"], 1, ["no such file"]),
    (["probe", "wukong", "--checkpoint", "{d}/corrupt.json"], 1, ["not a loadable checkpoint"]),
    # plan
    (["plan", "{d}/missing.json"], 1, ["missing.json: no such file", "loka probe"]),
    (["plan", "{d}/corrupt.json"], 1, ["not valid JSON"]),
    (["plan", "{d}/foreign.json"], 1, ["is not a loka.probe-report file (schema: 'something.else')"]),
    (["plan", "{d}/wukong-plan.json"], 1, ["is not a loka.probe-report file (schema: 'loka.plan')"]),
    (["plan", "{d}/noschema.json"], 1, ["schema: 'list'"]),
    (["plan", "{d}"], 1, ["is a directory"]),
    (["plan", "{d}/empty-report.json", "--role-budget", "wgrad"], 2, ["expected KEY=VALUE"]),
    (["plan", "{d}/empty-report.json", "--role-budget", "sideways=0.1"], 2, ["unknown role"]),
    (["plan", "{d}/empty-report.json", "--role-budget", "wgrad=lots"], 2, ["is not a number"]),
    (["plan", "{d}/empty-report.json", "--site-budget", "(x=0.1"], 2, ["not a regular expression"]),
    (["plan", "{d}/empty-report.json", "--kernels", "nope"], 2, ["unregistered kernels"]),
    (["plan", "{d}/empty-report.json", "--max-error", "-1"], 2,
     ["loka plan: argument --max-error: expected a finite number >= 0", "loka plan --help"]),
    (["plan", "{d}/empty-report.json", "--min-speedup", "0"], 2, ["use --assume-fast"]),
    (["plan", "{d}/empty-report.json", "--metric", "vibes"], 2, ["invalid choice: 'vibes'"]),
    (["bench", "--device", "cpu", "--batch-sizes", "64,big"], 2, ["--batch-sizes takes integers"]),
    (["bench", "--device", "cpu", "--batch-sizes", "0"], 2, ["batch sizes must be positive"]),
    (["plan", "{d}/empty-report.json", "--replace", "bf16"], 2, ["--replace 'bf16': expected KEY=VALUE"]),
    (["plan", "{d}/empty-report.json", "--assign", "x:fwd=cublas-rowwise"], 2,
     ["'x' matches no site of the plan"]),
    (["plan", "{d}/empty-report.json", "--replace", "bf16=warp-drive"], 2,
     ["unknown kernel", "loka kernels"]),
    (["plan"], 2, ["the following arguments are required: report"]),
    (["kernels", "--colour"], 2, ["unrecognized arguments: --colour"]),
    (["warp"], 2, ["invalid choice: 'warp'"]),
    # apply
    (["apply", "{d}/wukong-plan.json"], 2, ["only checks a plan (--check)", "loka train --plan"]),
    (["apply", "--check", "{d}/missing.json"], 1, ["no such file", "loka plan report.json"]),
    (["apply", "--check", "{d}/corrupt.json"], 1, ["not valid JSON"]),
    (["apply", "--check", "{d}/empty-report.json"], 1, ["is not a loka.plan file"]),
    (["apply", "--check", "{d}/wukong-plan.json", "--model", "dlrm"], 1,
     ["does not fit dlrm/tiny", "not in the model", "made for another model"]),
    (["apply", "--check", "{d}/wukong-plan.json", "--preset", "small"], 1,
     ["does not fit wukong/small", "shape mismatch"]),
    # report
    (["report", "{d}/missing.json"], 1, ["no such file"]),
    (["report", "{d}/corrupt.json"], 1, ["not valid JSON"]),
    (["report", "{d}/foreign.json"], 1, ["is not a loka.probe-report or loka.plan file"]),
    (["report", "{d}/empty-report.json", "{d}/empty-report.json"], 2, ["two reports given"]),
    (["report", "{d}/wukong-plan.json", "--curves", "{d}/curves-bad.json"], 1,
     ["not a curves file"]),
    (["report", "{d}/wukong-plan.json", "--curves", "{d}/corrupt.json"], 1, ["not valid JSON"]),
    # bench, kernels, global
    (["bench", "--train-variants", "warp", "--device", "cpu"], 2, ["unknown variant(s) ['warp']"]),
    (["kernels", "--device", "tpu"], 2, ["is not a device"]),
    (["--device", "not-a-device", "kernels"], 2, ["is not a device"]),
])
def test_bad_input_gives_one_line_error(argv, code, needles, files, capsys, tmp_path,
                                        monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a failing command writes lands in the repo
    argv = [a.replace("{d}", str(files)) for a in argv]
    got, _, err = run(argv, capsys)
    _expect_error(got, err, code, *needles)


def test_cuda_device_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    got, _, err = run(["kernels", "--device", "cuda"], capsys)
    _expect_error(got, err, 2, "CUDA is not available", "--device cpu")


def test_debug_shows_the_traceback(files):
    with pytest.raises(cli.CliError, match="no such file"):
        cli.main(["plan", str(files / "missing.json"), "--debug"])
    with pytest.raises(cli.CliError):
        cli.main(["--debug", "plan", str(files / "missing.json")])


def test_unexpected_failure_is_one_line(monkeypatch, capsys):
    def boom(args):
        raise ZeroDivisionError("the kernel table divided by zero\nsecond line")
    monkeypatch.setattr(commands, "cmd_kernels", boom)
    got, _, err = run(["kernels"], capsys)
    _expect_error(got, err, 1, "ZeroDivisionError: the kernel table divided by zero",
                  "--debug")
    assert "second line" not in err


@pytest.mark.parametrize("text,expected", [
    ("none", {}), ("paper", {"no_bias": True, "blocknorm": 256, "hardswish": True}),
    ("no_bias,hardswish", {"no_bias": True, "hardswish": True}),
    ("blocknorm", {"blocknorm": 256}), ("blocknorm=64,pad-to=16", {"blocknorm": 64, "pad_to": 16}),
])
def test_parse_mods(text, expected):
    from loka.config import ModsConfig

    assert cli_args.parse_mods(text) == ModsConfig(**expected)


def test_parse_budgets():
    assert cli_args.parse_budgets(["wgrad=0.1", "fwd=0.3"], "role-budget", ["fwd", "dgrad", "wgrad"]) == {
        "wgrad": 0.1, "fwd": 0.3}
    # a site pattern may itself contain '='
    assert cli_args.parse_budgets([r"a=b\.c=0.05"], "site-budget") == {r"a=b\.c": 0.05}
    with pytest.raises(cli_args.CliError) as e:
        cli_args.parse_budgets(["wgrad=inf"], "role-budget", ["wgrad"])
    assert e.value.code == 2


# -- the commands doing their work -----------------------------------------------------------
def test_kernels_lists_every_registered_kernel(capsys):
    from loka import kernels

    code, out, _ = run(["kernels", "--device", "cpu"], capsys)
    assert code == 0
    rows = {l.split()[0]: l for l in out.splitlines() if l and l.split()[0] in
            {k.name for k in kernels.all_kernels()}}
    assert set(rows) == {k.name for k in kernels.all_kernels()}
    for k in kernels.all_kernels():
        ok = k.device_ok("cpu")
        assert (" yes" in rows[k.name]) == bool(ok)
        if not ok:
            assert ok.reason in rows[k.name]
    assert "e4m3 x e4m3" in rows["emulated-rowwise-e4m3"] and "rowwise" in rows["emulated-rowwise-e4m3"]
    assert "runs on cuda, not cpu" in rows["tf32"]
    code, out, _ = run(["kernels", "--device", "cpu", "--json"], capsys)
    data = json.loads(out)
    assert data["device"] == "cpu" and len(data["kernels"]) == len(kernels.all_kernels())
    assert data["capabilities"]["cuda_capability"] is None


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """probe -> plan on Wukong tiny with the cheapest settings, through the CLI."""
    d = tmp_path_factory.mktemp("flow")
    report, plan = d / "report.json", d / "plan.json"
    code = cli.main(["probe", "wukong", "--preset", "tiny", "--steps", "2", "--every-n-steps", "1",
                     "--batch-size", "64", "--num-samples", "2", "--sample-rows", "32",
                     "--bootstrap", "10", "--no-naive", "--no-timing", "--kernels",
                     "bf16,emulated-rowwise-e4m3", "--device", "cpu", "-o", str(report)])
    assert code == 0
    code = cli.main(["plan", str(report), "-o", str(plan), "--assume-fast", "--kernels",
                     "emulated-rowwise-e4m3", "--role-budget", "wgrad=0.5"])
    assert code == 0
    return d


def test_probe_and_plan_files(workflow):
    report = ProbeReport.load(workflow / "report.json")
    assert report.meta["model"] == "wukong/tiny" and report.meta["batch_size"] == 64
    assert report.config["num_samples"] == 2 and report.config["timing"] is False
    assert set(report.kernel_names()) == {"bf16", "emulated-rowwise-e4m3"}
    plan = Plan.load(workflow / "plan.json")
    assert set(plan.sites) == set(report.sites)
    assert plan.budget["role_budgets"] == {"wgrad": 0.5} and plan.budget["assume_fast"] is True
    kernels = {sp.kernel(r) for sp in plan.sites.values() for r in ("fwd", "dgrad", "wgrad")}
    assert "emulated-rowwise-e4m3" in kernels  # FP8 where the budget allows, on error only


def test_apply_check_touches_nothing(workflow, capsys):
    code, out, _ = run(["apply", "--check", str(workflow / "plan.json"), "--model", "wukong",
                        "--preset", "tiny"], capsys)
    assert code == 0
    assert "fits wukong/tiny" in out and "nothing was modified" in out
    assert "swap" in out and "emulated-rowwise-e4m3" in out


def test_report_renders_text_html_markdown(workflow, capsys):
    html, md = workflow / "r.html", workflow / "r.md"
    code, out, _ = run(["report", str(workflow / "plan.json"), str(workflow / "report.json"),
                        "--html", str(html), "--markdown", str(md)], capsys)
    assert code == 0
    assert "probe report:" in out and "emulated-rowwise-e4m3" in out
    assert html.read_text().startswith("<!DOCTYPE html>")
    assert "**Plan:**" in md.read_text()
    code, out, _ = run(["report", str(workflow / "plan.json")], capsys)
    assert code == 0 and out.startswith("plan:")


def test_report_tensorboard_message(workflow, capsys):
    from loka import reporting

    code, out, err = run(["report", str(workflow / "report.json"), "--tensorboard",
                          str(workflow / "tb")], capsys)
    if reporting.tensorboard_available():
        assert code == 0 and "TensorBoard scalars" in out
    else:
        _expect_error(code, err, 1, "needs the tensorboard package")


def test_train_then_resume(tmp_path, capsys):
    out = tmp_path / "run"
    base = ["train", "--preset", "tiny", "--batch-size", "32", "--eval-steps", "2",
            "--out", str(out), "--device", "cpu"]
    code, text, _ = run(base + ["--steps", "3"], capsys)
    assert code == 0 and "held-out NE" in text
    first = json.loads((out / "metrics.json").read_text())
    assert first["steps"] == 3 and first["resumed_from"] is None
    code, _, _ = run(base + ["--steps", "5", "--resume"], capsys)
    assert code == 0
    second = json.loads((out / "metrics.json").read_text())
    assert second["steps"] == 5 and second["resumed_from"] == 3
    assert 0 < second["final"]["ne"] < 2
    # resuming another model's checkpoint is a one-line error
    code, _, err = run(["train", "--model", "dlrm", "--preset", "tiny", "--steps", "6",
                        "--resume", "--out", str(out), "--device", "cpu"], capsys)
    _expect_error(code, err, 1, "holds another model's weights")


def test_bench_on_the_cpu_end_to_end(tmp_path, capsys):
    out = tmp_path / "b.json"
    code = cli.main(["bench", "--device", "cpu", "--preset", "tiny", "--steps", "1", "--warmup",
                     "1", "--train-variants", "bf16,bf16+mods,loka+mods", "--infer-variants",
                     "bf16,loka+mods", "--out", str(out), "--no-plot"])
    assert code == 0
    text = capsys.readouterr().out
    assert "== train (wukong tiny, cpu) ==" in text and f"wrote {out}" in text
    result = json.loads(out.read_text())
    assert [r["variant"] for r in result["train"]] == ["bf16", "bf16+mods", "loka+mods"]
    assert all(r["median_ms"] > 0 and "error" not in r for r in result["train"] + result["infer"])
    assert Plan.load(str(tmp_path / "b.plan.json")).sites


def test_audit_passes_the_plans_own_choices_and_flags_a_hand_edit(workflow, capsys, tmp_path):
    plan, report = str(workflow / "plan.json"), str(workflow / "report.json")
    code, out, _ = run(["audit", plan, report], capsys)
    n = sum(len(s.roles) for s in ProbeReport.load(report).sites.values())
    assert code == 0 and f"{n} site-role(s) checked" in out and "every choice within its budget" in out
    d = json.loads(open(plan).read())
    site, roles = next((s, r) for s, r in ((s, v["roles"]) for s, v in d["sites"].items())
                       if r["fwd"]["kernel"] != "bf16")
    roles["fwd"]["budget"] = 0.0  # the chosen kernel is now outside its budget
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(d))
    code, out, _ = run(["audit", str(edited), report, "--json"], capsys)
    res = json.loads(out)
    assert code == 1 and not res["ok"]
    assert [(v["site"], v["role"]) for v in res["violations"]] == [(site, "fwd")]


def test_optimize_writes_a_plan_and_its_report_and_says_it_was_not_timed_on_a_cpu(tmp_path, capsys):
    plan_path, report_path = tmp_path / "plan.json", tmp_path / "report.json"
    code, out, err = run(["optimize", "wukong", "--preset", "tiny", "--device", "cpu",
                          "--steps", "2", "--num-samples", "4", "--kernels", "bf16,cublas-rowwise",
                          "-o", str(plan_path), "--report", str(report_path)], capsys)
    assert code == 0, err
    plan, report = loka.Plan.load(plan_path), loka.ProbeReport.load(report_path)
    assert set(plan.sites) == set(report.sites) and plan.fp8_sites()
    assert all(sp.kernel(r, plan.baseline) in ("bf16", "cublas-rowwise")
               for sp in plan.sites.values() for r in loka.config.ROLES)
    assert "not timed" in out and report.meta["model"] == "wukong/tiny"


def test_optimize_refuses_an_unknown_kernel(capsys):
    code, _, err = run(["optimize", "wukong", "--kernels", "bf16,cublas-nope"], capsys)
    assert code == 2 and "unknown kernel" in err
