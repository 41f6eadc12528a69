"""The ``loka`` command line: its frozen surface, its errors, and each subcommand's work."""

import argparse
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
import time
import zipfile

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
    "apply": COMMON + ["--check", "--data", "--inference", "--model", "--mods", "--tables", "--preset",
                       "<plan>"],
    "audit": COMMON + ["--json", "<plan>", "<report>"],
    "bench": COMMON + ["--batch-size", "--batch-sizes", "--eval-args", "--eval-set",
                       "--infer-variants", "--max-error", "--min-speedup",
                       "--model", "--no-compile", "--no-plot", "--out", "--plan",
                       "--plans", "--preset", "--probe-kernels", "--profile", "--profile-ops", "--steps",
                       "--train-variants", "--warmup"],
    "demo": COMMON + ["--batch-size", "--max-error", "--model", "--out", "--preset",
                      "--probe-steps", "--quick", "--seed", "--steps"],
    "evaluate": COMMON + ["--batch-size", "--checkpoint", "--data", "--eval-steps", "--model",
                          "--mods", "--tables", "--out", "--plan", "--preset", "--seed", "--skip-bad-lines",
                          "-o"],
    "kernels": COMMON + ["--json"],
    "optimize": COMMON + ["--batch-size", "--budget-batches", "--capture-steps", "--checkpoint",
                          "--compile-mode",
                          "--data", "--delayed-decay", "--delayed-scaling", "--head-sites",
                          "--host-slowdown", "--inductor-config", "--inference",
                          "--kernels", "--max-error", "--max-ne-change", "--max-trials", "--min-speedup",
                          "--mods", "--tables",
                          "--no-compile", "--num-samples", "--out", "--paired-trials", "--preset", "--report",
                          "--rounds", "--seed", "--skip-bad-lines", "--static-margin",
                          "--static-scales", "--steps", "--synchronized-steps", "-o", "<model>"],
    "plan": COMMON + ["--assign", "--assume-fast", "--delayed-decay", "--delayed-scaling", "--head-sites",
                      "--inference", "--kernels", "--max-error", "--metric", "--static-margin",
                      "--static-scales",
                      "--min-speedup", "--out", "--replace", "--role-budget", "--site-budget", "-o", "<report>"],
    "probe": COMMON + ["--autotune-from", "--batch-size", "--bootstrap", "--checkpoint", "--cold-cache", "--data", "--every-n-steps",
                       "--head-sites",
                       "--kernels", "--lr", "--max-error", "--min-speedup", "--mods", "--tables",
                       "--module-filter", "--naive", "--no-naive", "--no-timing", "--num-samples", "--out",
                       "--no-roofline", "--preset", "--roles", "--sample-rows", "--seed",
                       "--skip-bad-lines", "--source", "--steps", "--time-unsafe", "-o", "<model>"],
    "quality": COMMON + ["--batch-size", "--bootstrap", "--checkpoint", "--confidence",
                         "--control", "--cost-steps", "--data", "--eval-steps", "--logit-scale",
                         "--lr", "--max-baseline-ne", "--max-ne-change", "--model", "--mods",
                         "--tables", "--out", "--plan", "--plan-out", "--preset", "--seeds",
                         "--skip-bad-lines", "--steps", "--warmup-steps", "-o"],
    "report": COMMON + ["--curves", "--html", "--markdown", "--metric", "--tensorboard",
                        "--title", "<files>"],
    "train": COMMON + ["--batch-size", "--checkpoint-every", "--data", "--eval-every",
                       "--eval-steps", "--lr", "--model", "--mods", "--tables", "--out", "--plan", "--preset",
                       "--resume", "--seed", "--skip-bad-lines", "--steps", "--warmup-steps"],
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
            "evaluate": ["--checkpoint", "CKPT"],
            "probe": ["MODEL"], "report": ["FILE"]}
DEFAULTS = {
    "apply": {"check": False, "data": "synthetic", "inference": False, "model": "wukong",
              "mods": "none", "tables": "torch", "plan": "PLAN", "preset": "tiny"},
    "audit": {"json": False, "plan": "PLAN", "report": "REPORT"},
    "bench": {"batch_size": None, "batch_sizes": None, "eval_args": "", "eval_set": None,
              "infer_variants": None, "max_error": 0.2,
              "min_speedup": 1.05, "model": "wukong", "no_compile": False, "no_plot": False,
              "out": None, "plan": None, "plans": "", "preset": None, "probe_kernels": None,
              "profile": "", "profile_ops": False, "steps": 30, "train_variants": None,
              "warmup": 5},
    "demo": {"batch_size": None, "max_error": 0.2, "model": "wukong", "out": "./loka-demo",
             "preset": None, "probe_steps": None, "quick": False, "seed": 0, "steps": None},
    "evaluate": {"batch_size": None, "checkpoint": "CKPT", "data": "synthetic", "eval_steps": None,
                 "model": "wukong", "mods": "none", "tables": "torch", "out": None, "plan": None, "preset": "tiny",
                 "seed": 0, "skip_bad_lines": False},
    "kernels": {"json": False},
    "optimize": {"batch_size": None, "budget_batches": None, "capture_steps": False,
                 "checkpoint": None, "compile_mode": None,
                 "data": "synthetic", "max_ne_change": None,
                 "delayed_decay": None, "delayed_scaling": False, "head_sites": 3,
                 "host_slowdown": None, "inductor_config": [],
                 "inference": False, "kernels": None, "max_error": 0.2, "max_trials": 16,
                 "min_speedup": 1.05, "model": "MODEL", "mods": "none", "tables": "torch", "no_compile": False,
                 "num_samples": 16, "out": "plan.json", "paired_trials": False, "preset": "tiny",
                 "report": None, "rounds": 3, "seed": 0, "skip_bad_lines": False, "static_margin": None,
                 "static_scales": False, "steps": 8, "synchronized_steps": False},
    "plan": {"assign": [], "assume_fast": False, "delayed_decay": None, "delayed_scaling": False, "head_sites": 3,
             "inference": False, "kernels": None, "max_error": 0.2, "static_margin": None,
             "static_scales": False,
             "metric": "mere", "min_speedup": 1.05, "out": "plan.json", "replace": [],
             "report": "REPORT", "role_budget": None, "site_budget": None},
    "probe": {"batch_size": None, "bootstrap": 1000, "checkpoint": None, "data": "synthetic",
              "every_n_steps": 5, "kernels": None, "lr": 0.001, "max_error": 0.2,
              "min_speedup": 1.05, "model": "MODEL", "mods": "none", "tables": "torch", "module_filter": None,
              "naive": False, "no_timing": False, "num_samples": 16, "out": "report.json",
              "preset": "tiny", "roles": None, "sample_rows": None, "seed": 0,
              "skip_bad_lines": False, "source": "learned", "steps": 20, "time_unsafe": False,
              "no_roofline": False, "autotune_from": None, "cold_cache": False,
              "head_sites": 3},
    "quality": {"batch_size": None, "bootstrap": 0, "checkpoint": None, "confidence": 0.95,
                "control": False, "cost_steps": None, "data": "synthetic", "eval_steps": None,
                "logit_scale": 1.0, "lr": 0.001, "max_ne_change": None, "model": "wukong",
                "mods": "none", "tables": "torch", "out": "quality.json", "plan": None, "plan_out": "plan.ne.json",
                "preset": "tiny", "seeds": "0", "skip_bad_lines": False, "steps": 100,
                "max_baseline_ne": 1.0, "warmup_steps": 0},
    "report": {"curves": None, "files": ["FILE"], "html": None, "markdown": None,
               "metric": "mere", "tensorboard": None, "title": "LoKA report"},
    "train": {"batch_size": None, "checkpoint_every": 0, "data": "synthetic", "eval_every": 0,
              "eval_steps": None, "lr": 0.001, "model": "wukong", "mods": "none", "tables": "torch",
              "out": "runs/loka", "plan": None, "preset": "tiny", "resume": False, "seed": 0,
              "skip_bad_lines": False, "steps": 200, "warmup_steps": 0},
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
    # a truncated plan where a report belongs: named by what its header says it is
    (["plan", "{d}/corrupt.json"], 1, ["corrupt.json is not a loka.probe-report file",
                                       "schema: 'loka.plan'"]),
    (["plan", "{d}/foreign.json"], 1, ["is not a loka.probe-report file (schema: 'something.else')"]),
    (["plan", "{d}/wukong-plan.json"], 1, ["is not a loka.probe-report file (schema: 'loka.plan')"]),
    (["plan", "{d}/noschema.json"], 1, ["noschema.json is not a loka.probe-report file",
                                        "does not hold a JSON object"]),
    (["plan", "{d}"], 1, ["is a directory"]),
    (["plan", "{d}/empty-report.json", "--role-budget", "wgrad"], 2, ["expected KEY=VALUE"]),
    (["plan", "{d}/empty-report.json", "--role-budget", "sideways=0.1"], 2, ["unknown role"]),
    (["plan", "{d}/empty-report.json", "--role-budget", "wgrad=lots"], 2, ["is not a number"]),
    (["plan", "{d}/empty-report.json", "--site-budget", "(x=0.1"], 2, ["not a regular expression"]),
    (["plan", "{d}/empty-report.json", "--kernels", "nope"], 2, ["unknown kernel(s) ['nope']"]),
    (["plan", "{d}/empty-report.json", "--max-error", "-1"], 2,
     ["loka plan: argument --max-error: expected a finite number >= 0", "loka plan --help"]),
    (["plan", "{d}/empty-report.json", "--min-speedup", "0"], 2, ["use --assume-fast"]),
    (["plan", "{d}/empty-report.json", "--metric", "vibes"], 2, ["invalid choice: 'vibes'"]),
    (["optimize", "wukong", "--inference", "--delayed-scaling"], 2,
     ["--delayed-scaling is for training"]),
    (["optimize", "wukong", "--max-ne-change", "2e-4"], 2,
     ["--max-ne-change holds a serving plan to a bound: add --inference", "loka quality"]),
    (["optimize", "wukong", "--inference", "--max-ne-change", "0"], 2,
     ["--max-ne-change: expected a finite number > 0, got 0"]),
    (["optimize", "wukong", "--inference", "--max-ne-change", "inf"], 2,
     ["--max-ne-change: expected a finite number > 0, got inf"]),
    (["optimize", "wukong", "--inference", "--max-ne-change", "nan"], 2,
     ["--max-ne-change: expected a finite number > 0, got nan"]),
    (["optimize", "wukong", "--inference", "--max-ne-change", "lots"], 2,
     ["--max-ne-change: expected a number, got 'lots'"]),
    (["optimize", "wukong", "--inference", "--budget-batches", "4"], 2,
     ["--budget-batches needs --max-ne-change"]),
    (["optimize", "wukong", "--inference", "--max-ne-change", "1e-4", "--budget-batches", "0"], 2,
     ["--budget-batches must be >= 1"]),
    (["plan", "{d}/empty-report.json", "--delayed-decay", "0.5"], 2,
     ["--delayed-decay needs --delayed-scaling"]),
    (["plan", "{d}/empty-report.json", "--delayed-decay", "1.5"], 2,
     ["--delayed-decay: expected a decay in (0, 1], got 1.5"]),
    (["plan", "{d}/empty-report.json", "--delayed-decay", "soon"], 2,
     ["--delayed-decay: expected a number, got 'soon'"]),
    (["bench", "--device", "cpu", "--batch-sizes", "64,big"], 2, ["--batch-sizes takes integers"]),
    (["bench", "--device", "cpu", "--batch-sizes", "0"], 2, ["batch sizes must be positive"]),
    (["bench", "--device", "cpu", "--eval-set", "{d}/nowhere"], 2, ["not an evaluation set"]),
    (["bench", "--device", "cpu", "--eval-set", "{d}/empty-report.json"], 2,
     ["not an evaluation set"]),
    (["bench", "--device", "cpu", "--eval-set", "bench/evalset", "--eval-args", "'--models"], 2,
     ["--eval-args: No closing quotation"]),
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


def test_the_probes_pruning_switches_reach_its_config():
    parse = cli.build_parser().parse_args
    default = cli_args.probe_config(parse(["probe", "wukong"]))
    assert default.time_unsafe is False and default.roofline_prune is True
    assert default.cold_cache is False
    cfg = cli_args.probe_config(parse(["probe", "wukong", "--time-unsafe", "--no-roofline",
                                       "--autotune-from", "old.json", "--cold-cache"]))
    assert cfg.time_unsafe is True and cfg.roofline_prune is False and cfg.cold_cache is True
    assert default.autotune_from is None and cfg.autotune_from == "old.json"
    assert default.head_sites == 3
    assert cli_args.probe_config(parse(["probe", "wukong", "--head-sites", "0"])).head_sites == 0
    with pytest.raises(SystemExit):
        parse(["probe", "wukong", "--head-sites", "-1"])


def test_the_probes_kernel_set_reaches_its_config():
    """--kernels: a list as given; 'all' every available kernel (on a GPU too); none: the
    default set on a GPU, every kernel on the CPU; --naive turns the N(0, 1) comparison on."""
    parse = cli.build_parser().parse_args
    default = cli_args.probe_config(parse(["probe", "wukong"]))
    assert default.kernels is None and default.all_kernels is False
    assert default.compare_naive is False and default.num_samples == 16
    every = cli_args.probe_config(parse(["probe", "wukong", "--kernels", "all", "--naive"]))
    assert every.kernels is None and every.all_kernels is True and every.compare_naive is True
    some = cli_args.probe_config(parse(["probe", "wukong", "--kernels", "bf16, cublas-rowwise"]))
    assert some.kernels == ("bf16", "cublas-rowwise") and some.all_kernels is False
    assert cli_args.probe_kernels("all") == (None, True)
    assert cli_args.probe_kernels(None) == (None, False)


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


def test_probe_says_which_sites_it_measured_forwards_only(workflow, tmp_path, capsys):
    report = ProbeReport.load(workflow / "report.json")
    head = report.meta["head_forwards_only"]
    fwd_only = {loka.config.Role.FWD}
    assert 1 <= len(head) <= 3 and all(set(report.sites[n].roles) == fwd_only for n in head)
    out = tmp_path / "r.json"
    code = cli.main(["probe", "wukong", "--preset", "tiny", "--steps", "2", "--every-n-steps", "1",
                     "--batch-size", "64", "--num-samples", "2", "--sample-rows", "32",
                     "--bootstrap", "10", "--no-naive", "--no-timing", "--kernels",
                     "bf16,emulated-rowwise-e4m3", "--device", "cpu", "--head-sites", "1",
                     "-o", str(out)])
    assert code == 0
    again = ProbeReport.load(out)
    assert again.meta["head_forwards_only"] == head[-1:]
    printed = capsys.readouterr().out
    assert f"forwards only at the 1 site(s) nearest the loss, which a training plan keeps on " \
           f"bf16: {head[-1]} (--head-sites 0 measures every role)" in printed


def test_plan_with_delayed_scaling_writes_it_and_says_so(workflow, tmp_path, capsys):
    out = tmp_path / "delayed.json"
    code = cli.main(["plan", str(workflow / "report.json"), "-o", str(out), "--assume-fast",
                     "--kernels", "emulated-rowwise-e4m3", "--delayed-scaling"])
    assert code == 0
    assert "delayed tensorwise scaling, decay 0.9" in capsys.readouterr().out
    assert Plan.load(out).delayed_scaling == 0.9
    code = cli.main(["plan", "--delayed-scaling", str(workflow / "report.json"), "-o", str(out),
                     "--assume-fast", "--kernels", "emulated-rowwise-e4m3", "--delayed-decay",
                     "0.5"])
    assert code == 0 and Plan.load(out).delayed_scaling == 0.5
    assert Plan.load(workflow / "plan.json").delayed_scaling is None


def test_plan_for_serving_with_static_scales(workflow, tmp_path, capsys):
    """``--inference --static-scales [--static-margin X]``: a serving plan carrying the
    observed input amax (times X) of each FP8 forward; bad combinations are usage errors."""
    report = ProbeReport.load(workflow / "report.json")
    out = tmp_path / "static.json"
    code = cli.main(["plan", str(workflow / "report.json"), "-o", str(out), "--assume-fast",
                     "--kernels", "emulated-rowwise-e4m3", "--inference", "--static-scales",
                     "--static-margin", "2"])
    assert code == 0 and "static input scales" in capsys.readouterr().out
    plan = Plan.load(out)
    assert plan.budget["inference"] is True and plan.budget["static_margin"] == 2.0
    fp8 = [n for n, sp in plan.sites.items() if sp.kernel("fwd") != "bf16"]
    assert fp8 and sorted(plan.static_scales) == sorted(fp8)
    for n in fp8:
        assert plan.static_scales[n] == pytest.approx(2 * report.sites[n].stats["act"]["amax"])
    for bad in (["--static-scales"], ["--inference", "--static-margin", "2"],
                ["--inference", "--static-scales", "--static-margin", "0.5"]):
        try:  # argparse's own refusals exit; the command's return the usage status
            code = cli.main(["plan", str(workflow / "report.json"), "-o", str(out), *bad])
        except SystemExit as e:
            code = e.code
        assert code == 2
        assert "static" in capsys.readouterr().err


def test_a_reference_model_with_torchrec_tables_is_probed_and_its_plan_applies(workflow,
                                                                                tmp_path, capsys):
    """``--tables torchrec``: the same model with its tables in one torchrec
    EmbeddingBagCollection; LoKA acts on the same dense Linears, by the same names, so the
    plan made on the default tables applies to it."""
    pytest.importorskip("torchrec", reason="torchrec is not installed (README: optional "
                                           "dependencies)")
    report = tmp_path / "report.json"
    code = cli.main(["probe", "wukong", "--preset", "tiny", "--tables", "torchrec", "--steps", "2",
                     "--every-n-steps", "1", "--batch-size", "64", "--num-samples", "2",
                     "--sample-rows", "32", "--bootstrap", "10", "--no-naive", "--no-timing",
                     "--kernels", "bf16,emulated-rowwise-e4m3", "--device", "cpu", "-o", str(report)])
    assert code == 0
    rep = ProbeReport.load(report)
    assert rep.meta["model"] == "wukong/tiny (torchrec tables)"
    assert set(rep.sites) == set(ProbeReport.load(workflow / "report.json").sites)
    code, out, _ = run(["apply", "--check", str(workflow / "plan.json"), "--model", "wukong",
                        "--preset", "tiny", "--tables", "torchrec", "--device", "cpu"], capsys)
    assert code == 0 and "fits wukong/tiny (torchrec tables)" in out
    assert "nothing was modified" in out and "swap" in out


def test_torchrec_tables_are_refused_for_your_own_model(capsys):
    code, _, err = run(["probe", "os.path:join", "--tables", "torchrec", "--device", "cpu"], capsys)
    assert code == 2 and "is your own" in err and len(err.strip().splitlines()) <= 2


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
    # the Probe measures two kernels (tests/test_bench.py checks that the default list
    # reaches the Probe)
    code = cli.main(["bench", "--device", "cpu", "--preset", "tiny", "--steps", "1", "--warmup",
                     "1", "--train-variants", "bf16,bf16+mods,loka+mods", "--infer-variants",
                     "bf16,loka+mods", "--probe-kernels", "bf16,emulated-rowwise-e4m3",
                     "--out", str(out), "--no-plot"])
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
    # (torch 2.11's build has no rowwise _scaled_mm on the CPU: its emulated twin)
    rw = ("cublas-rowwise" if loka.kernels.get("cublas-rowwise").device_ok("cpu")
          else "emulated-rowwise-e4m3")
    code, out, err = run(["optimize", "wukong", "--preset", "tiny", "--device", "cpu",
                          "--steps", "2", "--num-samples", "4", "--kernels", f"bf16,{rw}",
                          "-o", str(plan_path), "--report", str(report_path)], capsys)
    assert code == 0, err
    plan, report = loka.Plan.load(plan_path), loka.ProbeReport.load(report_path)
    assert set(plan.sites) == set(report.sites) and plan.fp8_sites()
    assert all(sp.kernel(r, plan.baseline) in ("bf16", rw)
               for sp in plan.sites.values() for r in loka.config.ROLES)
    assert "not timed" in out and report.meta["model"] == "wukong/tiny"


def test_optimize_holds_a_serving_plan_to_an_ne_budget(tmp_path, capsys, monkeypatch):
    """``loka optimize --inference --static-scales --max-ne-change X`` on a trained
    checkpoint: the serving NE budget (loka.quality.serve_ne_budget) measured on
    --budget-batches held-out batches before any timing, recorded in the plan; a model
    that has not learned is a one-line error."""
    run_dir = tmp_path / "run"
    code, _, err = run(["train", "--model", "dlrm", "--preset", "tiny", "--steps", "600",
                        "--batch-size", "256", "--lr", "3e-3", "--eval-steps", "2",
                        "--device", "cpu", "--out", str(run_dir)], capsys)
    assert code == 0, err
    base = ["optimize", "dlrm", "--preset", "tiny", "--device", "cpu", "--steps", "2",
            "--num-samples", "4", "--kernels", "bf16,emulated-tensorwise-e4m3", "--inference",
            "--static-scales", "--budget-batches", "3"]
    loose = tmp_path / "loose.json"
    code, out, err = run(base + ["--checkpoint", str(run_dir / "checkpoint.pt"),
                                 "--max-ne-change", "1.0", "-o", str(loose)], capsys)
    assert code == 0, err
    plan = loka.Plan.load(loose)
    got = plan.budget["serve_ne_budget"]
    assert got["examples"] == 3 * 256 and got["moved_back"] == [] and got["fp8_forwards"] > 0
    assert 0 < got["baseline_ne"] < 1 and len(got["checks"]) == 1
    assert got["rel_ne_change"] == got["checks"][0]["rel_ne_change"] < got["upper"] <= 1.0
    assert "serve NE budget: 0 of" in out and plan.static_scales
    # a budget no interval on 768 examples can certify: every forward back, and it says why
    tight = tmp_path / "tight.json"
    code, out, err = run(base + ["--checkpoint", str(run_dir / "checkpoint.pt"),
                                 "--max-ne-change", "1e-9", "-o", str(tight)], capsys)
    assert code == 0, err
    plan = loka.Plan.load(tight)
    assert not plan.fp8_sites() and "measure on more examples" in out
    # a plan timed on a GPU may come back from the whole-step tuning changed: the plan
    # written is checked again. Stand-in: optimize returns the plan as made from the report,
    # every site in FP8, as if timed; a budget that holds none of them moves them back
    from loka.cli import commands

    real = commands.optimize

    def timed_optimize(*a, **k):
        res = real(*a, **k)
        res.timed, res.plan = True, res.untuned.copy()
        return res
    monkeypatch.setattr(commands, "optimize", timed_optimize)
    after = tmp_path / "after.json"
    code, out, err = run(base + ["--checkpoint", str(run_dir / "checkpoint.pt"),
                                 "--max-ne-change", "1e-9", "-o", str(after)], capsys)
    assert code == 0, err
    assert "after timing: serve NE budget" in out
    plan = loka.Plan.load(after)
    assert not plan.fp8_sites() and plan.budget["serve_ne_budget"]["moved_back"]
    # a timed plan as the budget left it is not checked again: the learned check, the budget
    calls = []
    real_budget = commands.serve_ne_budget

    def counted(*a, **k):
        calls.append(1)
        return real_budget(*a, **k)

    def unchanged_optimize(*a, **k):
        res = real(*a, **k)
        res.timed = True
        return res
    monkeypatch.setattr(commands, "optimize", unchanged_optimize)
    monkeypatch.setattr(commands, "serve_ne_budget", counted)
    code, out, err = run(base + ["--checkpoint", str(run_dir / "checkpoint.pt"),
                                 "--max-ne-change", "1.0", "-o", str(after)], capsys)
    assert code == 0, err
    assert len(calls) == 2 and "after timing" not in out
    assert loka.Plan.load(after).budget["serve_ne_budget"]["moved_back"] == []
    monkeypatch.undo()
    # no checkpoint: the model has not learned
    code, _, err = run(base + ["--max-ne-change", "2e-4", "-o", str(tmp_path / "x.json")],
                       capsys)
    _expect_error(code, err, 1, "not below 1.0")
    assert "trained --checkpoint" in err and not (tmp_path / "x.json").exists()


def test_optimize_refuses_an_unknown_kernel(capsys):
    code, _, err = run(["optimize", "wukong", "--kernels", "bf16,cublas-nope"], capsys)
    assert code == 2 and "unknown kernel" in err


def test_optimize_passes_inductor_options_to_its_timed_steps(capsys, monkeypatch):
    """``--inductor-config KEY=VALUE`` reaches loka.optimize as compile_options; a key that is
    not an Inductor option, a VALUE that is not JSON, or the option with --no-compile is a
    usage error before any work."""
    import loka.cli.commands as commands

    got = {}

    def fake_optimize(*args, **kw):
        got.update(kw)
        raise cli.CliError("stopped here")
    monkeypatch.setattr(commands, "optimize", fake_optimize)
    code, _, err = run(["optimize", "wukong", "--preset", "tiny", "--device", "cpu", "--steps",
                        "1", "--inductor-config", "cpp_wrapper=true", "--inductor-config",
                        "realize_reads_threshold=3"], capsys)
    assert code == 1 and "stopped here" in err
    assert got["compile_options"] == {"cpp_wrapper": True, "realize_reads_threshold": 3}
    for argv, msg in ((["--inductor-config", "nope=1"], "an option of torch._inductor.config"),
                      (["--inductor-config", "cpp_wrapper=yes"], "VALUE must be JSON"),
                      (["--inductor-config", "cpp_wrapper=true", "--no-compile"],
                       "drop --no-compile")):
        code, _, err = run(["optimize", "wukong", "--preset", "tiny", *argv], capsys)
        assert code == 2 and msg in err, err


def test_optimize_passes_the_host_slowdown_and_refuses_one_below_one(capsys, monkeypatch):
    """``--host-slowdown F`` reaches loka.optimize as host_slowdown (left out: optimize's
    default); a value below 1, not finite or not a number is a usage error."""
    import loka.cli.commands as commands

    got = []

    def fake_optimize(*args, **kw):
        got.append(kw)
        raise cli.CliError("stopped here")
    monkeypatch.setattr(commands, "optimize", fake_optimize)
    base = ["optimize", "wukong", "--preset", "tiny", "--device", "cpu", "--steps", "1"]
    for extra in (["--host-slowdown", "2"], []):
        code, _, err = run(base + extra, capsys)
        assert code == 1 and "stopped here" in err
    assert got[0]["host_slowdown"] == 2.0 and "host_slowdown" not in got[1]
    for bad in ("0.5", "inf", "nan", "fast"):
        code, _, err = run(base + ["--host-slowdown", bad], capsys)
        assert code == 2 and "--host-slowdown" in err, err


def test_optimizes_last_line_says_whether_the_timed_plan_was_kept():
    """The A/B line: the ratio of the plan kept; where none was kept (its rounds lost, or
    the host check), it says the ratio is the timed plan's and that nothing was kept;
    nothing without rounds."""
    from types import SimpleNamespace

    import loka.cli.commands as commands

    def result(sites, speedup, timing):
        plan = SimpleNamespace(fp8_sites=lambda: sites,
                               budget={"optimize": {"ab_timing": {"timing": timing}}})
        return SimpleNamespace(plan=plan, speedup=speedup, rounds=[{}, {}, {}])
    assert commands.whole_step_line(result(["a"], 1.2341, "paired")) == (
        "whole step: 1.234x of the step without FP8 (median of 3 A/B rounds, the model and "
        "its planned copy timed in turn)")
    assert commands.whole_step_line(result([], 1.05, "recompiled")) == (
        "whole step: the plan timed ran at 1.050x of the step without FP8 (median of 3 A/B "
        "rounds); no FP8 site kept, see the plan's notes")
    assert commands.whole_step_line(result([], None, "paired")) is None


def test_optimize_refuses_synchronized_steps_where_it_times_no_step(capsys):
    code, _, err = run(["optimize", "wukong", "--preset", "tiny", "--device", "cpu",
                        "--synchronized-steps"], capsys)
    assert code == 2 and "--synchronized-steps is how a GPU's steps are timed" in err


def test_optimize_capture_steps_refusals_and_pass_through(capsys, monkeypatch):
    """``--capture-steps``: refused beside Inductor's CUDA graphs (a compile mode that has
    them, or ``triton.cudagraphs``) and on a device that times no step; on a CUDA device it
    reaches loka.optimize as capture_steps, and left out optimize is told not to capture."""
    import loka.cli.commands as commands

    base = ["optimize", "wukong", "--preset", "tiny", "--capture-steps"]
    for extra in (["--compile-mode", "reduce-overhead"], ["--compile-mode", "max-autotune"],
                  ["--inductor-config", "triton.cudagraphs=true"]):
        code, _, err = run(base + extra, capsys)
        assert code == 2 and "adds Inductor's CUDA graphs inside it" in err, err
    code, _, err = run(base + ["--device", "cpu"], capsys)
    assert code == 2 and "--capture-steps captures steps in CUDA graphs: on cpu" in err, err
    got = []

    def fake_optimize(*args, **kw):
        got.append(kw)
        raise cli.CliError("stopped here")
    monkeypatch.setattr(commands, "optimize", fake_optimize)
    code, _, err = run(base[:-1] + ["--device", "cpu", "--steps", "1"], capsys)
    assert code == 1 and "stopped here" in err
    assert got[-1]["capture_steps"] is False  # left out: the steps are not captured
    # on a CUDA device (stood in for: the model and its batches are built on the CPU)
    real = commands._model_and_stream
    monkeypatch.setattr(commands, "resolve_device", lambda args: torch.device("cuda"))
    monkeypatch.setattr(commands, "_model_and_stream",
                        lambda args, device: real(args, torch.device("cpu")))
    monkeypatch.setattr(commands, "device_batches", lambda stream, device: iter(()))
    code, _, err = run(base + ["--steps", "1", "--no-compile", "--compile-mode",
                               "reduce-overhead"], capsys)
    assert code == 1 and "stopped here" in err, err  # eager steps have no Inductor graphs
    assert got[-1]["capture_steps"] is True and got[-1]["compile"] is False


# -- runs: damaged checkpoints, a locked --out, a finished run, plans, file modes ----------
TRAIN = ["train", "--preset", "tiny", "--batch-size", "32", "--eval-steps", "1", "--device",
         "cpu"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A ``loka train`` run directory of 2 steps."""
    out = tmp_path_factory.mktemp("run") / "r"
    assert cli.main(TRAIN + ["--steps", "2", "--out", str(out)]) == 0
    return out


def _flip_a_tensor_byte(path):
    with zipfile.ZipFile(path) as z:
        info = max(z.infolist(), key=lambda i: i.file_size)
    raw = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
    raw[info.header_offset + 30 + name_len + extra_len + info.file_size // 3] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage, needle", [
    ("empty", "empty file (0 bytes)"), ("foreign", "not a LoKA checkpoint (no 'optimizers' entry)"),
    ("flipped", "checksum mismatch")])
def test_train_refuses_a_damaged_checkpoint_in_one_line(damage, needle, finished_run, tmp_path,
                                                        capsys):
    out = tmp_path / "r"
    shutil.copytree(finished_run, out)
    ckpt = out / "checkpoint.pt"
    if damage == "empty":
        ckpt.write_bytes(b"")
    elif damage == "foreign":
        torch.save({"model": {}}, ckpt)
    else:
        _flip_a_tensor_byte(ckpt)
    code, _, err = run(TRAIN + ["--steps", "4", "--out", str(out), "--resume"], capsys)
    _expect_error(code, err, 1, str(ckpt), needle, "restore the file")
    code, _, err = run(["probe", "wukong", "--checkpoint", str(ckpt), "--device", "cpu"], capsys)
    assert code == 1 and str(ckpt) in err and "Traceback" not in err


def test_a_second_train_into_a_run_refuses_to_overwrite_it(finished_run, tmp_path, capsys):
    out = tmp_path / "r"
    shutil.copytree(finished_run, out)
    before = (out / "checkpoint.pt").read_bytes()
    code, _, err = run(TRAIN + ["--steps", "3", "--out", str(out)], capsys)
    _expect_error(code, err, 2, f"{out} already holds a run", "--resume")
    assert (out / "checkpoint.pt").read_bytes() == before


def test_two_train_runs_into_one_out_cannot_both_run(tmp_path, capsys):
    out = tmp_path / "r"
    first = subprocess.Popen([sys.executable, "-m", "loka"] + TRAIN + [
        "--steps", "100000", "--checkpoint-every", "1", "--out", str(out)], cwd=REPO,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists() and time.monotonic() < deadline:
            assert first.poll() is None
            time.sleep(0.1)
        code, _, err = run(TRAIN + ["--steps", "3", "--out", str(out), "--resume"], capsys)
        _expect_error(code, err, 1, f"in use by another loka run (pid {first.pid})", "another --out")
    finally:
        first.kill()
        first.wait()


def test_an_fp8_run_resumes_on_its_plan_with_the_guard_and_refuses_another(files, tmp_path,
                                                                           capsys):
    out, plan = tmp_path / "r", files / "wukong-plan.json"
    old = os.umask(0o022)
    try:
        code, text, err = run(TRAIN + ["--steps", "2", "--out", str(out), "--plan", str(plan)],
                              capsys)
    finally:
        os.umask(old)
    assert code == 0, err
    assert "Guard on" in text and "the Guard switched 0" in text
    first = json.loads((out / "metrics.json").read_text())
    assert first["fp8_sites"] == Plan.load(plan).fp8_sites() and first["fallbacks"] == []
    for name in ("checkpoint.pt", "metrics.json"):  # the umask's mode, not mkstemp's 0600
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o644, name
    code, _, err = run(TRAIN + ["--steps", "3", "--out", str(out), "--resume"], capsys)
    assert code == 0, err
    assert "resuming with the plan recorded in the checkpoint" in err
    assert json.loads((out / "metrics.json").read_text())["fp8_sites"] == first["fp8_sites"]
    other = tmp_path / "other.json"
    torch.manual_seed(0)
    Plan.uniform(loka.models.build("wukong", "tiny"), "emulated-tensorwise-e4m3",
                 device="cpu").save(other)
    code, _, err = run(TRAIN + ["--steps", "4", "--out", str(out), "--resume", "--plan",
                                str(other)], capsys)
    _expect_error(code, err, 1, "trained with another plan", "resume without --plan")


def test_a_plan_written_under_a_022_umask_is_0644(workflow, tmp_path, capsys):
    old = os.umask(0o022)
    try:
        code, _, _ = run(["plan", str(workflow / "report.json"), "-o", str(tmp_path / "p.json")],
                         capsys)
    finally:
        os.umask(old)
    assert code == 0 and stat.S_IMODE(os.stat(tmp_path / "p.json").st_mode) == 0o644


# -- honest output: unknown names, bad data, budgets, what a CPU measured -----------------
ALL_KERNELS_LISTED = "triton-tensorwise-cublas-fastacc"  # in the full list, near nothing asked


@pytest.fixture(scope="module")
def misspelt_plan(files):
    d = json.loads((files / "wukong-plan.json").read_text())
    site = next(iter(d["sites"]))
    d["sites"][site]["roles"]["fwd"]["kernel"] = "cublas-rowwse"
    path = files / "misspelt-plan.json"
    path.write_text(json.dumps(d))
    return path, site


@pytest.mark.parametrize("argv", [
    ["probe", "wukong", "--kernels", "bf16,cublas-rowwse"],
    ["optimize", "wukong", "--kernels", "bf16,cublas-rowwse"],
    ["plan", "{d}/empty-report.json", "--kernels", "cublas-rowwse"],
    ["plan", "{d}/empty-report.json", "--replace", "bf16=cublas-rowwse"],
])
def test_an_unknown_kernel_name_gets_the_nearest_names(argv, files, capsys):
    code, _, err = run([a.replace("{d}", str(files)) for a in argv], capsys)
    _expect_error(code, err, 2, "unknown kernel(s) ['cublas-rowwse']",
                  "did you mean 'cublas-rowwise'", "loka kernels")
    assert ALL_KERNELS_LISTED not in err


@pytest.mark.parametrize("command", [["train", "--steps", "1", "--device", "cpu"],
                                     ["apply", "--check"]])
def test_a_plan_naming_an_unknown_kernel_says_which_and_the_nearest(command, misspelt_plan,
                                                                     tmp_path, capsys):
    path, site = misspelt_plan
    argv = command + (["--plan", str(path), "--out", str(tmp_path / "r")]
                      if command[0] == "train" else [str(path)])
    code, _, err = run(argv, capsys)
    _expect_error(code, err, 1, f"{path}: unknown kernel 'cublas-rowwse' ({site} fwd)",
                  "did you mean 'cublas-rowwise'")
    assert ALL_KERNELS_LISTED not in err and "another model" not in err


@pytest.fixture(scope="module")
def bad_tsv(tmp_path_factory):
    from loka.data import sample_path

    lines = open(sample_path()).read().splitlines()
    lines.insert(4, "1\tnot\tenough\tfields")
    path = tmp_path_factory.mktemp("tsv") / "bad.tsv"
    path.write_text("\n".join(lines) + "\n")
    return path


PROBE_QUICK = ["--preset", "tiny", "--steps", "1", "--every-n-steps", "1", "--batch-size", "16",
               "--num-samples", "2", "--sample-rows", "16", "--bootstrap", "10", "--no-naive",
               "--no-timing", "--kernels", "bf16,emulated-rowwise-e4m3", "--device", "cpu"]


def test_a_malformed_data_line_is_named_and_can_be_skipped(bad_tsv, tmp_path, capsys):
    data = f"criteo:{bad_tsv}"
    code, _, err = run(["probe", "dlrm", "--data", data, "-o", str(tmp_path / "r.json")]
                       + PROBE_QUICK, capsys)
    _expect_error(code, err, 1, f"{bad_tsv}:5: expected 40 tab-separated fields",
                  "--skip-bad-lines")
    assert "--module-filter" not in err
    code, _, err = run(["train", "--model", "dlrm", "--preset", "tiny", "--data", data,
                        "--steps", "1", "--batch-size", "16", "--device", "cpu",
                        "--out", str(tmp_path / "t")], capsys)
    err = err[err.index("error: "):]  # after the progress bar of the steps before the line
    _expect_error(code, err, 1, f"{bad_tsv}:5:", "--skip-bad-lines")
    code, _, err = run(["probe", "dlrm", "--data", data, "-o", str(tmp_path / "r.json"),
                        "--skip-bad-lines"] + PROBE_QUICK, capsys)
    assert code == 0, err
    assert f"skipped 1 malformed line(s) of {bad_tsv}" in err


def test_a_negative_budget_has_a_hint(files, capsys):
    code, _, err = run(["plan", str(files / "empty-report.json"), "--role-budget", "wgrad=-0.5"],
                       capsys)
    _expect_error(code, err, 2, "the budget must be a finite number >= 0",
                  "hint: a budget is a bound on the error metric", "--role-budget wgrad=0.1")


def _cpu_report(path):
    """A CPU report as `loka probe` writes one: wall-clock timings, float32 sites, fp32 the
    most accurate kernel, an FP8 kernel within the budget."""
    from loka.probe.report import ErrorStat, KernelResult, RoleReport, SiteReport

    def kr(name, hi, speed):
        return KernelResult(name, mere=ErrorStat(hi * 0.8, hi * 0.7, hi, 8), speedup=speed,
                            time_us=10.0 / speed, timing="cpu-wallclock", safe=hi < 0.2,
                            fast=speed > 1.05)

    roles = {r: RoleReport(r, loka.config.role_shape(r, 64, 64, 64), 10.0, {
        "bf16": kr("bf16", 1e-7, 1.0), "fp32": kr("fp32", 1e-8, 696.19),
        "emulated-rowwise-e4m3": kr("emulated-rowwise-e4m3", 0.05, 35.0)})
        for r in loka.config.ROLES}
    site = SiteReport("mlp.0", 64, 64, 64, dtype="float32", roles=roles)
    ProbeReport(sites={"mlp.0": site}, device="cpu").save(path)
    return path


def test_a_cpu_report_plans_fp8_on_error_alone_and_says_what_was_measured(tmp_path, capsys):
    report = _cpu_report(tmp_path / "cpu-report.json")
    code, out, _ = run(["plan", str(report), "-o", str(tmp_path / "p.json"), "--assume-fast"],
                       capsys)
    assert code == 0
    assert "1/1 sites with FP8" in out and "chosen on error alone" in out
    assert "speedup >= 1.05" not in out and "baseline bf16 ran fp32" in out
    assert Plan.load(tmp_path / "p.json").config("mlp.0") == \
        loka.config.LinearConfig.uniform("emulated-rowwise-e4m3")
    code, out, _ = run(["plan", str(report), "-o", str(tmp_path / "p.json")], capsys)
    assert code == 0 and "0/1 sites with FP8" in out
    assert "--assume-fast" in out  # the note names the CLI's flag
    # fp32 only when asked for by name
    code, out, _ = run(["plan", str(report), "-o", str(tmp_path / "p.json"), "--assume-fast",
                        "--kernels", "fp32"], capsys)
    assert code == 0 and Plan.load(tmp_path / "p.json").config("mlp.0").fwd == "fp32"
    table = ProbeReport.load(report).summary_table()
    assert "696" not in table and "35.00x" not in table
    assert "CPU timing, not a GPU speed" in table
    assert all(line.split()[-1] == "-" for line in table.splitlines()[2:5])
