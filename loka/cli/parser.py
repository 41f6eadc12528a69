"""The ``loka`` argument parser: every subcommand, its options, help and examples.

The parsed namespace names its subcommand in ``command``; ``loka.cli.main`` runs
``commands.cmd_<command>``. Changing what the parser accepts changes the command line:
tests/test_cli.py pins every subcommand's options and defaults.
"""

from __future__ import annotations

import argparse
from importlib import metadata

from .. import bench
from ..config import DispatchConfig, ProbeConfig
from ..demo import DemoConfig
from ..dispatch.optimize import HOST_SLOWDOWN
from ..numerics.delayed import DEFAULT_DECAY
from .args import EXIT_USAGE, budget, decay, ne_change, positive, slowdown, speedup

__all__ = ["PROG", "EPILOGS", "build_parser", "version"]

PROG = "loka"


def version() -> str:
    """The installed distribution's version ('unknown' for a source tree never installed)."""
    try:
        return metadata.version("loka")
    except metadata.PackageNotFoundError:
        return "unknown"


class _Parser(argparse.ArgumentParser):
    """argparse with LoKA's error format: one line and a hint instead of the usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message}\n"
                              f"hint: run '{self.prog} --help' for the options and examples\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; defaults shown where there is one to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or "default:" in text or not action.option_strings
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def _common() -> argparse.ArgumentParser:
    # accepted after the subcommand too; SUPPRESS keeps a value given before it
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--device", default=argparse.SUPPRESS,
                   help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="show the traceback of a failure")
    return p


def _demo_args(p: argparse.ArgumentParser) -> None:
    """The ``loka demo`` options; their defaults are :class:`~loka.demo.DemoConfig`'s."""
    d = DemoConfig()
    p.add_argument("--quick", action="store_true", help="tiny preset and few steps (<1 min)")
    p.add_argument("--out", default="./loka-demo", help="where the files go")
    p.add_argument("--model", default=d.model, help="reference model")
    p.add_argument("--preset", default=None, help="model preset (default: small; tiny with --quick)")
    p.add_argument("--steps", type=positive(int, "--steps"), default=None,
                   help=f"steps per arm after the branch (default: {d.steps})")
    p.add_argument("--probe-steps", type=positive(int, "--probe-steps"), default=None,
                   help=f"steps trained under the Probe before the branch (default: {d.probe_steps})")
    p.add_argument("--batch-size", type=positive(int, "--batch-size"), default=None,
                   help="default: the preset's (512 for small)")
    p.add_argument("--max-error", type=budget, default=d.max_error, help="plan budget (MERE)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of model, data and sampler")


def _skip_bad_lines(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-bad-lines", action="store_true",
                   help="count and skip malformed lines of criteo data instead of stopping "
                        "at the first")


def _head_sites(p: argparse.ArgumentParser) -> None:
    default = DispatchConfig().head_sites
    p.add_argument("--head-sites", type=positive(int, "--head-sites", 0), default=default,
                   help="keep this many sites nearest the loss (the last to run) on bf16 "
                        f"(default {default}; 0: none)")


def _probe_kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", default=None,
                   help="comma list of kernels, or 'all' (default: on a GPU the default set, "
                        "loka.kernels.registry.PROBE_DEFAULT; on the CPU all available)")


def _model_args(p: argparse.ArgumentParser, positional: bool = False) -> None:
    if positional:
        p.add_argument("model", help="reference model (wukong, dcnv2, interformer, dlrm, "
                       "logreg) or module:factory returning your own nn.Module")
    else:
        p.add_argument("--model", default="wukong",
                       help="reference model name, or module:factory for your own")
    p.add_argument("--preset", default="tiny", help="model preset: tiny, small, paper")
    p.add_argument("--mods", default="none",
                   help="Mods: none, paper (no_bias,blocknorm=256,hardswish) or a comma list "
                        "of no_bias, blocknorm=N, hardswish, pad_to=N, merge_siblings, token_major")
    p.add_argument("--data", default="synthetic",
                   help="synthetic, or criteo:TRAIN.tsv[,EVAL.tsv] (criteo:sample: the "
                        "shipped sample)")
    p.add_argument("--tables", default="torch", choices=("torch", "torchrec"),
                   help="a reference model's embedding tables: torch (nn.EmbeddingBag) or "
                        "torchrec (one EmbeddingBagCollection; needs loka[torchrec])")


EPILOGS = {
    "demo": """examples:
  loka demo                      # Wukong small on synthetic CTR data, a few minutes on a CPU
  loka demo --quick              # tiny preset, few steps (CI smoke run)
  loka demo --out /tmp/demo --device cuda

writes report.json, plan.json, report.html, summary.md and curves.json to --out.""",
    "train": """examples:
  loka train --model wukong --preset small --steps 500 --out runs/wukong
  loka train --out runs/wukong --steps 1000 --resume        # continue that run
  loka train --plan plan.json --out runs/wukong-fp8         # train with a plan applied
  loka train --model dlrm --data criteo:day_0.tsv,day_1.tsv --out runs/dlrm

one run at a time per --out (it is locked); a run into an --out that holds a checkpoint
must --resume it. Checkpoints carry a checksum: a damaged one is refused, never loaded.""",
    "evaluate": """examples:
  loka evaluate --checkpoint runs/dlrm/checkpoint.pt --model dlrm --data criteo:day_0.tsv,day_1.tsv
  loka evaluate --checkpoint runs/w/checkpoint.pt --plan plan.json -o eval.json
  loka evaluate --checkpoint runs/w/checkpoint.pt --eval-steps 100    # synthetic: 100 batches

an evaluation file (the second of criteo:TRAIN,EVAL) is read exactly once unless
--eval-steps says otherwise; with a training file alone the NE is the training file's
(and says so). Prints how many examples it saw; an empty file is refused.""",
    "quality": """examples:
  loka quality --plan plan.json --steps 300 --seeds 0,1,2 -o quality.json
  loka quality --plan plan.json --control               # the plan against itself: exactly 0
  loka quality --plan plan.json --seeds 0,1,2 --max-ne-change 2e-4 --plan-out plan.ne.json
  loka quality --plan plan.json --checkpoint runs/w/checkpoint.pt --data criteo:train.tsv,test.tsv

both arms start from the same weights and train on the same batches with the same RNG
(deterministic algorithms on); each is scored once on the same evaluation examples. Reports
NE_plan / NE_base - 1 and the AUC change with intervals over examples (delta method;
--bootstrap for a paired bootstrap too) and over seeds (t, with several --seeds).""",
    "probe": """examples:
  loka probe wukong --preset tiny -o report.json
  loka probe wukong --preset small --checkpoint runs/wukong/checkpoint.pt --steps 50
  loka probe mypkg.models:make_model --data criteo:train.tsv --kernels bf16,cublas-rowwise
  loka probe dcnv2 --no-timing --num-samples 16 -o report.json

your own model (module:factory): factory() returns an nn.Module whose forward(batch)
returns logits (B,) for a loka.data.Batch; --data synthetic also needs a feature_spec.""",
    "plan": """examples:
  loka plan report.json -o plan.json
  loka plan report.json --max-error 0.1 --min-speedup 1.1 --role-budget wgrad=0.05
  loka plan report.json --site-budget 'over_arch\\..*'=0.05 --metric relfro
  loka plan cpu-report.json --assume-fast       # a CPU report: choose on error only
  loka plan report.json --replace triton-rowwise-cublas=cublas-rowwise
  loka plan report.json --assign 'over_arch.*:fwd=cublas-rowwise-fastacc'

--device names the device the plan is for (default: the report's).""",
    "optimize": """examples:
  loka optimize wukong --preset small -o plan.json          # training
  loka optimize wukong --preset paper --inference --compile-mode reduce-overhead
  loka optimize mypkg.models:make_model --data criteo:train.tsv --kernels bf16,cublas-rowwise

probes the model, plans under the error budget, then times whole compiled steps: FP8 sites
that do not make the step faster go back to bf16, and the plan is kept only if its step is
faster than the step without it in its A/B rounds (every one, or a sign test after a
lost one). Without a GPU nothing is timed and the plan is made on error alone (it says
so).""",
    "audit": """examples:
  loka audit plan.json report.json
  loka audit plan.json report.json --json

checks, at every site and role the report measured, that the chosen kernel's error bound
is within the plan's budget and that no kernel within the budget was measured faster
(weight-quantized speeds for an inference plan); exit status 1 when one is not. Needs no
GPU: a kernel the report timed ran where the report was measured.""",
    "apply": """examples:
  loka apply --check plan.json --model wukong --preset small
  loka apply --check plan.json --model mypkg.models:make_model --inference

prints what loka.apply(model, plan) would change, and touches nothing.""",
    "report": """examples:
  loka report report.json                       # text table
  loka report report.json plan.json --html report.html --markdown summary.md
  loka report plan.json
  loka report report.json plan.json --curves curves.json --tensorboard runs/tb""",
    "bench": """examples:
  loka bench --device cpu --preset tiny --steps 3 --warmup 1     # a smoke run
  loka bench --train-variants bf16,bf16+mods,loka+mods --infer-variants none

delegates to loka.bench (the harness behind bench/run_all.py).""",
    "kernels": """examples:
  loka kernels
  loka kernels --device cpu --json""",
}


def _static_scales(p) -> None:
    p.add_argument("--static-scales", action="store_true",
                   help="with --inference: static activation scales from the amax the Probe "
                        "observed (no amax pass; values beyond it saturate)")
    p.add_argument("--static-margin", type=positive(float, "--static-margin", 1.0), default=None,
                   metavar="X",
                   help="with --static-scales: multiply each observed amax by X (> 1 leaves "
                        "headroom)")


def build_parser() -> argparse.ArgumentParser:
    """The ``loka`` argument parser (every subcommand and option)."""
    parser = _Parser(
        prog=PROG, formatter_class=_Formatter,
        description="LoKA: FP8 that pays off in recommendation models. Probe where FP8 is "
                    "safe and fast, plan a kernel per GEMM role, apply it.",
        epilog="run 'loka COMMAND --help' for a command's options and examples; "
               "start with 'loka demo'.")
    parser.add_argument("--version", action="version", version=f"loka {version()}")
    parser.add_argument("--device", default=None,
                        help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of a failure")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    common = _common()

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_, epilog=EPILOGS[name],
                              formatter_class=_Formatter, parents=[common])

    p = add("demo", "train, probe, plan and apply end to end; compare bf16 with LoKA")
    _demo_args(p)

    p = add("train", "train a reference model (checkpoints, resume, optional plan)")
    _model_args(p)
    p.add_argument("--steps", type=positive(int, "--steps", 0), default=200,
                   help="total training steps (counting those before a --resume)")
    p.add_argument("--batch-size", type=positive(int, "--batch-size"), default=None,
                   help="default: the preset's")
    p.add_argument("--lr", type=positive(float, "--lr", 0), default=1e-3, help="learning rate")
    p.add_argument("--warmup-steps", type=positive(int, "--warmup-steps", 0), default=0,
                   help="linear learning-rate warm-up over the first N steps (0: none); wide "
                        "presets such as paper diverge without one at 1e-3")
    p.add_argument("--seed", type=int, default=0, help="model, data and RNG seed")
    p.add_argument("--out", default="runs/loka", help="directory of checkpoint.pt and metrics.json")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--eval-every", type=positive(int, "--eval-every", 0), default=0,
                   help="evaluate every N steps (0: at the end only)")
    p.add_argument("--eval-steps", type=positive(int, "--eval-steps"), default=None,
                   help="batches per evaluation (default: the whole evaluation file, once; "
                        "20 batches of the synthetic held-out stream)")
    p.add_argument("--checkpoint-every", type=positive(int, "--checkpoint-every", 0), default=0,
                   help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--plan", default=None,
                   help="train with this plan applied (loka.apply) and the Guard on; a run "
                        "that trained with a plan resumes with it")
    _skip_bad_lines(p)

    p = add("evaluate", "score a checkpoint on evaluation data: NE, AUC, log loss, examples seen")
    p.add_argument("--checkpoint", required=True,
                   help="the weights to score (a loka train checkpoint.pt or a state dict)")
    _model_args(p)
    p.add_argument("--plan", default=None,
                   help="evaluate with this plan applied (default: the plan the checkpoint's "
                        "run trained with, if any)")
    p.add_argument("--batch-size", type=positive(int, "--batch-size"), default=None,
                   help="default: the preset's")
    p.add_argument("--eval-steps", type=positive(int, "--eval-steps"), default=None,
                   help="batches to evaluate (default: the whole evaluation file, once; 20 "
                        "batches of the synthetic held-out stream)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic stream (the run's --seed: its held-out twin)")
    p.add_argument("-o", "--out", default=None, help="also write the result here as JSON")
    _skip_bad_lines(p)

    p = add("quality", "paired quality check: the plan against the baseline on identical "
                       "terms; relative NE and AUC change with intervals")
    _model_args(p)
    p.add_argument("--plan", default=None, help="the plan arm's plan (a plan.json)")
    p.add_argument("--control", action="store_true",
                   help="run the plan arm's configuration in both arms (the result must be 0)")
    p.add_argument("--checkpoint", default=None,
                   help="both arms start from these weights (default: fresh weights per seed)")
    p.add_argument("--steps", type=positive(int, "--steps", 0), default=100,
                   help="training steps per arm")
    p.add_argument("--seeds", default="0",
                   help="comma list of seeds, one paired comparison each (initial weights, "
                        "batches, RNG)")
    p.add_argument("--batch-size", type=positive(int, "--batch-size"), default=None,
                   help="default: the preset's")
    p.add_argument("--lr", type=positive(float, "--lr", 0), default=1e-3, help="learning rate")
    p.add_argument("--eval-steps", type=positive(int, "--eval-steps"), default=None,
                   help="evaluation batches (default: the whole evaluation file, once; 64 "
                        "batches of the synthetic held-out stream)")
    p.add_argument("--confidence", type=float, default=0.95, help="of every interval")
    p.add_argument("--bootstrap", type=positive(int, "--bootstrap", 0), default=0,
                   help="paired bootstrap resamples per seed (0: the delta method alone)")
    p.add_argument("--logit-scale", type=float, default=1.0,
                   help="test hook: multiply the plan arm's evaluation logits by this "
                        "(a perturbation of known size; 1: none)")
    p.add_argument("--max-ne-change", type=positive(float, "--max-ne-change", 0), default=None,
                   help="NE budget: move the plan's costliest FP8 site-roles back to the "
                        "baseline until the upper bound of the relative NE change is at most "
                        "this (2e-4: 0.02%%); writes the plan to --plan-out")
    p.add_argument("--plan-out", default="plan.ne.json",
                   help="where --max-ne-change writes the plan within the budget")
    p.add_argument("--cost-steps", type=positive(int, "--cost-steps", 0), default=None,
                   help="training steps of each site-role's cost arm (default: min(--steps, 20))")
    p.add_argument("--warmup-steps", type=positive(int, "--warmup-steps", 0), default=0,
                   help="linear learning-rate warm-up of every arm, in steps (0: none)")
    p.add_argument("--max-baseline-ne", type=budget,
                   default=1.0,
                   help="--max-ne-change: every seed's baseline must reach an NE below this "
                        "before any plan arm trains (1: the base rate's; 0: no check)")
    p.add_argument("-o", "--out", default="quality.json", help="the JSON result to write")
    _skip_bad_lines(p)

    p = add("probe", "learn each GEMM's distributions while training; measure every kernel")
    _model_args(p, positional=True)
    p.add_argument("-o", "--out", default="report.json", help="the report to write")
    p.add_argument("--steps", type=positive(int, "--steps"), default=20,
                   help="training steps observed")
    p.add_argument("--batch-size", type=positive(int, "--batch-size"), default=None,
                   help="default: the preset's")
    p.add_argument("--lr", type=positive(float, "--lr", 0), default=1e-3,
                   help="learning rate of the observed steps (0: weights fixed)")
    p.add_argument("--seed", type=int, default=0, help="model, data, sampler seed")
    p.add_argument("--checkpoint", default=None,
                   help="start from these weights (a loka train checkpoint.pt)")
    p.add_argument("--every-n-steps", type=positive(int, "--every-n-steps"), default=5,
                   help="take statistics every N steps")
    p.add_argument("--num-samples", type=positive(int, "--num-samples", 2), default=16,
                   help="synthetic operand pairs per site and role")
    p.add_argument("--sample-rows", type=positive(int, "--sample-rows"), default=None,
                   help="rows per synthetic sample (default: the site's, up to 4096)")
    p.add_argument("--source", choices=("learned", "captured"), default="learned",
                   help="operands drawn from learned statistics, or real captured tensors")
    _probe_kernels(p)
    p.add_argument("--roles", default=None, help="comma list of fwd,dgrad,wgrad (default: all)")
    head = ProbeConfig().head_sites
    p.add_argument("--head-sites", type=positive(int, "--head-sites", 0), default=head,
                   help="measure only the forward of this many sites nearest the loss, which "
                        f"a training plan keeps on bf16 (default {head}; 0: every role)")
    p.add_argument("--module-filter", default=None,
                   help="regular expression on Linear names to probe")
    p.add_argument("--bootstrap", type=positive(int, "--bootstrap", 0), default=1000,
                   help="bootstrap resamples of the confidence intervals")
    p.add_argument("--max-error", type=budget, default=0.2, help="the report's safe flag: MERE bound")
    p.add_argument("--min-speedup", type=speedup, default=1.05, help="the report's fast flag")
    p.add_argument("--naive", action=argparse.BooleanOptionalAction, default=False,
                   help="also measure every kernel on N(0, 1) operands (a diagnostic)")
    p.add_argument("--no-timing", action="store_true", help="errors only, no speed measurement")
    p.add_argument("--time-unsafe", action="store_true",
                   help="also time kernels over --max-error (default: they are no candidates "
                        "and are not timed)")
    p.add_argument("--no-roofline", action="store_true",
                   help="time every FP8 kernel, also those whose roofline bound cannot reach "
                        "--min-speedup on this GPU")
    p.add_argument("--autotune-from", default=None, metavar="REPORT",
                   help="load the Triton autotuning choices of an earlier report (same GPU "
                        "type): shapes it tuned are not tuned again")
    p.add_argument("--cold-cache", action="store_true",
                   help="on CUDA, evict the L2 cache before every timed call (operands read "
                        "from memory, not from the cache the previous call left warm)")
    _skip_bad_lines(p)

    p = add("plan", "choose a kernel per site and role under an accuracy budget")
    p.add_argument("report", help="a report.json written by 'loka probe'")
    p.add_argument("-o", "--out", default="plan.json", help="the plan to write")
    p.add_argument("--max-error", type=budget, default=0.2,
                   help="budget on the metric's upper 95%% bound")
    p.add_argument("--min-speedup", type=speedup, default=1.05,
                   help="a kernel must beat bf16 by this factor")
    p.add_argument("--metric", choices=("mere", "relfro", "neg_sqnr"), default="mere",
                   help="error metric of the budget")
    p.add_argument("--role-budget", action="append", metavar="ROLE=X",
                   help="per-role budget, e.g. wgrad=0.1 (repeatable)")
    p.add_argument("--site-budget", action="append", metavar="REGEX=X",
                   help="per-site budget by regular expression (repeatable; strictest wins)")
    _head_sites(p)
    p.add_argument("--kernels", default=None, help="comma list of allowed kernels")
    p.add_argument("--assume-fast", action="store_true",
                   help="where no GPU timing decides (CPU reports), choose the lowest-error "
                        "safe FP8 kernel instead of bf16")
    p.add_argument("--replace", action="append", metavar="OLD=NEW", default=[],
                   help="then move every role on kernel OLD to kernel NEW (repeatable; "
                        "NEW must meet the budget where the report measured it)")
    p.add_argument("--assign", action="append", metavar="SITE_GLOB:ROLE=KERNEL", default=[],
                   help="then put these roles on KERNEL (ROLE fwd, dgrad, wgrad or *; "
                        "repeatable; the budget is checked as for --replace)")
    p.add_argument("--delayed-scaling", action="store_true",
                   help="train with delayed tensorwise scales (the operands every FP8 role of "
                        "which scales tensorwise with PyTorch ops)")
    p.add_argument("--delayed-decay", type=decay, default=None, metavar="DECAY",
                   help="with --delayed-scaling: how fast an estimate above the amax seen "
                        f"shrinks per call, in (0, 1] (default {DEFAULT_DECAY})")
    p.add_argument("--inference", action="store_true",
                   help="plan serving: forwards only, judged with the weight quantized once")
    _static_scales(p)

    p = add("optimize", "probe, plan and keep only what makes the whole step faster")
    _model_args(p, positional=True)
    p.add_argument("-o", "--out", default="plan.json", help="the plan to write")
    p.add_argument("--report", default=None, help="also write the Probe's report here")
    p.add_argument("--steps", type=positive(int, "--steps"), default=8,
                   help="training steps the Probe observes")
    p.add_argument("--batch-size", type=positive(int, "--batch-size"), default=None,
                   help="default: the preset's")
    p.add_argument("--seed", type=int, default=0, help="model, data, sampler seed")
    p.add_argument("--checkpoint", default=None,
                   help="start from these weights (a loka train checkpoint.pt)")
    p.add_argument("--num-samples", type=positive(int, "--num-samples", 2), default=16,
                   help="synthetic operand pairs per site and role")
    _probe_kernels(p)
    p.add_argument("--max-error", type=budget, default=0.2,
                   help="budget on the error's upper 95%% bound")
    p.add_argument("--min-speedup", type=speedup, default=1.05,
                   help="a kernel must beat bf16 by this factor alone to be tried")
    _head_sites(p)
    p.add_argument("--inference", action="store_true", help="plan and time serving (forwards)")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of the timed steps, e.g. reduce-overhead (CUDA graphs)")
    p.add_argument("--no-compile", action="store_true", help="time eager steps")
    p.add_argument("--inductor-config", action="append", default=[], metavar="KEY=VALUE",
                   help="a torch._inductor.config option for the timed steps' compiles, as "
                        "your own steps will run (repeatable; VALUE is JSON, e.g. "
                        "cpp_wrapper=true)")
    p.add_argument("--synchronized-steps", action="store_true",
                   help="time each step from an idle GPU, as a caller that waits for each "
                        "result runs them (default: steps issued back to back)")
    p.add_argument("--capture-steps", action="store_true",
                   help="capture each timed step whole in one CUDA graph and replay it, as a "
                        "loop that captures its step runs it (not with --compile-mode "
                        "reduce-overhead)")
    p.add_argument("--paired-trials", action="store_true",
                   help="time the step without FP8 beside each tuning trial and compare by "
                        "ratio (a host whose speed drifts does not decide; twice the timings)")
    p.add_argument("--host-slowdown", type=slowdown, default=None, metavar="F",
                   help="keep a plan only if it would not be slower than none on a host F "
                        f"times slower (default {HOST_SLOWDOWN:g}; 1 turns the check off)")
    p.add_argument("--rounds", type=positive(int, "--rounds"), default=3,
                   help="final A/B rounds the plan must win (after a lost one, up to as many more "
                        "and a sign test)")
    p.add_argument("--max-trials", type=positive(int, "--max-trials", 2), default=16,
                   help="at most this many whole-step timings while tuning")
    p.add_argument("--delayed-scaling", action="store_true",
                   help="time and write plans trained with delayed tensorwise scales "
                        "(training only)")
    p.add_argument("--delayed-decay", type=decay, default=None, metavar="DECAY",
                   help=f"with --delayed-scaling: the decay, in (0, 1] (default {DEFAULT_DECAY})")
    _static_scales(p)
    p.add_argument("--max-ne-change", type=ne_change, default=None, metavar="X",
                   help="with --inference and a trained --checkpoint: move the costliest FP8 "
                        "forwards back until serving changes the held-out NE by at most X "
                        "(relative, upper 95%% bound; 2e-4 is 0.02%%), before any step is timed")
    p.add_argument("--budget-batches", type=positive(int, "--budget-batches"), default=None,
                   help="with --max-ne-change: held-out batches the NE change is measured on "
                        "(default 16)")
    _skip_bad_lines(p)

    p = add("audit", "check a plan against its Probe report: budgets kept, fastest chosen")
    p.add_argument("plan", help="a plan.json")
    p.add_argument("report", help="the report.json it was made from")
    p.add_argument("--json", action="store_true", help="print the result as JSON")

    p = add("apply", "check a plan against a model: what would change (touches nothing)")
    p.add_argument("plan", help="a plan.json written by 'loka plan'")
    p.add_argument("--check", action="store_true", help="dry run (required)")
    _model_args(p)
    p.add_argument("--inference", action="store_true", help="check the inference application")

    p = add("report", "render a report and/or plan: text, self-contained HTML, Markdown")
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="a report.json and/or a plan.json (in any order)")
    p.add_argument("--html", default=None, help="write a self-contained HTML page here")
    p.add_argument("--markdown", default=None, help="write a Markdown summary here")
    p.add_argument("--curves", default=None, help="training curves (the demo's curves.json)")
    p.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="also write TensorBoard scalars (needs tensorboard)")
    p.add_argument("--metric", choices=("mere", "relfro", "neg_sqnr"), default="mere",
                   help="error metric shown for a report without a plan")
    p.add_argument("--title", default="LoKA report", help="page title")

    p = add("bench", "benchmark bf16, torchao FP8 and LoKA side by side")
    bench.add_arguments(p)

    p = add("kernels", "every registered kernel: what runs on this machine and why not")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return parser
