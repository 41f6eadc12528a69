"""The evaluation set (bench/evalset/) and its benchmark (bench/eval_set.py) on the CPU:
the models are what their papers and ANCHORS.md describe, LoKA's public path works on
each of them, the benchmark writes its rows, and nothing under loka/ recognises them.
No time is asserted: CPU timings say nothing about FP8 on a GPU."""

import ast
import copy
import importlib.util
import inspect
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import loka

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import evalset  # noqa: E402  (bench/ is not a package)
from evalset import EVAL_MODELS, loss_fn  # noqa: E402

# one intra-op thread (conftest's one_thread): on 2 shared cores a second thread stalls
pytestmark = pytest.mark.usefixtures("one_thread")
NAMES = sorted(EVAL_MODELS)
PROBE = loka.ProbeConfig(kernels=("bf16", "emulated-rowwise-e4m3"), num_samples=4, timing=False,
                         compare_naive=False, bootstrap=50, progress=False)


def _linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def _paper(name):
    with torch.device("meta"):
        return EVAL_MODELS[name]("paper")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def _load_eval_set():
    """The harness (``loka.bench.evalset``; bench/eval_set.py runs it on bench/evalset/)."""
    from loka.bench import evalset as harness

    return harness


# ------------------------------------------------------------------ the models

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_forward_backward_finite(name, dtype):
    model = EVAL_MODELS[name]("tiny").to(dtype)
    inputs, labels = model.make_batch(32, "cpu", dtype, seed=0)
    assert all(x.dtype == dtype for x in inputs) and labels.dtype == torch.float32
    logits = model(*inputs)
    assert logits.shape == (32,) and logits.dtype == dtype
    loss = loss_fn(model, (inputs, labels))
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", NAMES)
def test_batches_are_seeded_and_labels_are_binary(name):
    model = EVAL_MODELS[name]("tiny")
    (x1, y1), (x2, y2) = model.make_batch(64, seed=3), model.make_batch(64, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(x1, x2)) and torch.equal(y1, y2)
    assert not torch.equal(model.make_batch(64, seed=4)[0][-1], x1[-1])
    assert set(y1.unique().tolist()) <= {0.0, 1.0} and 0 < y1.mean() < 1


@pytest.mark.parametrize("name", NAMES)
def test_mods_are_built_in(name):
    """No bias but the logit's, block norms and hard swish: the model as written is the
    paper's bf16 + Mods baseline."""
    model = _paper(name)
    lins = _linears(model)
    assert [m.bias is not None for m in lins] == [False] * (len(lins) - 1) + [True]
    assert lins[-1].out_features == 1
    kinds = {type(m).__name__ for m in model.modules()}
    assert {"RowBlockNorm", "HSwish"} <= kinds
    assert not kinds & {"LayerNorm", "SiLU", "ReLU", "GELU"}


def test_paper_wukong_is_the_reference_step():
    model = _paper("wukong")
    shapes = [(m.in_features, m.out_features) for m in _linears(model)]
    assert len(shapes) == 19
    assert shapes.count((64, 32)) == 8                 # FM projection and LCB, 4 layers
    assert shapes.count((2048, 2048)) == 4 and shapes.count((2048, 8192)) == 4  # FM MLPs
    assert shapes[-3:] == [(16384, 2048), (2048, 1024), (1024, 1)]             # top MLP
    # the block norms: 256 features per block, the layer norm over d = 256
    assert {m.block for m in model.modules() if type(m).__name__ == "RowBlockNorm"} == {256}


def test_paper_dcnv2_and_dlrm_shapes():
    dcn = [(m.in_features, m.out_features) for m in _linears(_paper("dcnv2"))]
    assert dcn == [(8, 64), (27 * 64, 2048)] + [(2048, 2048)] * 3 + [
        (2048, 1024), (1024, 1024), (1024, 512), (512, 1)]
    dlrm = [(m.in_features, m.out_features) for m in _linears(_paper("dlrm"))]
    # 27 embeddings of 256: 351 dots + 256, padded to 608
    assert dlrm == [(512, 1024), (1024, 512), (512, 256), (608, 2048), (2048, 2048),
                    (2048, 1024), (1024, 1)]


@pytest.mark.parametrize("name", NAMES)
def test_paper_scale_forward_on_meta(name):
    """The paper-scale shapes compose: a forward on the meta device (no memory, no time)."""
    model = _paper(name)
    tiny = EVAL_MODELS[name]("tiny")
    shapes = [tuple(x.shape) for x in tiny.make_batch(2)[0]]
    spec = model.spec
    if name == "wukong":
        full = [(4096, spec.num_embeddings, spec.dim)]
    elif name == "dcnv2":
        full = [(4096, spec.num_dense), (4096, spec.num_sparse, spec.embedding_dim)]
    else:
        full = [(4096, spec.num_dense), (4096, spec.num_sparse, spec.bottom[-1])]
    assert [len(s) for s in shapes] == [len(s) for s in full]
    out = model(*(torch.empty(s, device="meta", dtype=torch.bfloat16) for s in full))
    assert out.shape == (4096,)


def test_registry():
    assert set(EVAL_MODELS) == {"wukong", "dcnv2", "dlrm"}
    for name, cls in EVAL_MODELS.items():
        assert cls("tiny").scale == "tiny"
        with pytest.raises(ValueError):
            cls("huge")


# ------------------------------------------------------------------ LoKA's public path

@pytest.fixture(scope="module")
def probed():
    """name -> (model, batches, report): one Probe per tiny model."""
    out, threads = {}, torch.get_num_threads()
    torch.set_num_threads(1)  # a module fixture runs before the tests' one_thread
    try:
        for name in NAMES:
            torch.manual_seed(0)
            model = EVAL_MODELS[name]("tiny")
            batches = [model.make_batch(64, seed=i) for i in range(2)]
            out[name] = (model, batches, loka.probe(model, batches, loss_fn, config=PROBE))
    finally:
        torch.set_num_threads(threads)
    return out


def _fake_rowwise_e4m3(linear, x):
    """An FP8 forward written here, not by LoKA: e4m3 per row of x and of W (scale =
    amax / 448), float32 accumulation, both scales applied after the reduction."""
    def quant(t):
        scale = t.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
        return (t.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float(), scale
    x2 = x.reshape(-1, x.shape[-1])
    qx, sx = quant(x2)
    qw, sw = quant(linear.weight)
    y = (qx @ qw.t()) * sx * sw.t()
    if linear.bias is not None:
        y = y + linear.bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("name", NAMES)
def test_loka_trains_each_model_through_the_public_path(probed, name):
    model, batches, report = probed[name]
    assert set(report.sites) == {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    plan = loka.plan(report, assume_fast=True)
    planned = copy.deepcopy(model)
    applied = loka.apply(planned, plan)
    assert any(c.action == "swap" for c in applied.changes)
    swapped = [n for n, m in planned.named_modules() if isinstance(m, loka.Linear)]
    assert swapped and all(isinstance(model.get_submodule(n), nn.Linear) for n in swapped)
    assert planned.state_dict().keys() == model.state_dict().keys()
    inputs = batches[0][0]
    with torch.no_grad():
        err = _rel(planned(*inputs), model(*inputs))
    # every planned forward in e4m3 in series: about 0.04 of output error per GEMM
    # (0.05-0.10 measured on these models); a broken swap gives errors near 1
    assert 0 < err < 0.15, err
    loss = loss_fn(planned, batches[1])
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for p in planned.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_loka_serving_plan_computes_what_its_kernels_say(probed, name):
    """``loka.apply(inference=True)`` gives the model exactly the FP8 forwards its plan
    names, at the sites it names: against a rowwise-e4m3 forward written here."""
    model, batches, report = probed[name]
    plan = loka.plan(report, assume_fast=True, inference=True)
    fp8 = {s for s, sp in plan.sites.items() if sp.roles[loka.Role.FWD].kernel != plan.baseline}
    assert fp8 and {sp.roles[loka.Role.FWD].kernel for s, sp in plan.sites.items()
                    if s in fp8} == {"emulated-rowwise-e4m3"}
    served, emulated = copy.deepcopy(model), copy.deepcopy(model)
    loka.apply(served, plan, inference=True)
    for site in fp8:
        lin = emulated.get_submodule(site)
        lin.forward = (lambda m: lambda x: _fake_rowwise_e4m3(m, x))(lin)
    inputs = batches[0][0]
    with torch.inference_mode():
        ref, out, emu = model(*inputs), served(*inputs), emulated(*inputs)
    assert _rel(out, emu) < 1e-3 < _rel(out, ref)


# ------------------------------------------------------------------ bench/eval_set.py

ROW_FIELDS = {"model", "scale", "batch_size", "mode", "variant", "graphs", "status", "reason",
              "compile_mode", "backend", "linears", "notes", "vs_bf16"}
OK_FIELDS = {"fp8_sites", "output_rel_err_vs_bf16", "step_ms", "step_ms_min", "step_ms_max",
             "first_step_s", "samples_per_s", "gpu_ms", "profile_ms", "top_kernels_ms",
             "wall_over_gpu", "peak_mem_gib", "loss_first_step", "inductor_code", "kernel_rates",
             "host_us_per_step", "host_top_us", "host_ms", "host_over_gpu"}


def test_eval_set_script_runs_on_the_cpu(tmp_path):
    out = tmp_path / "tmp.json"
    cmd = [sys.executable, str(BENCH / "eval_set.py"), "--scale", "tiny", "--models", "wukong",
           "--batch-sizes", "64", "--modes", "train", "--steps", "2", "--warmup", "1",
           "--no-graphs", "--out", str(out), "--paired-rounds", "2", "--paired-steps", "1",
           # Dynamo and AOTAutograd trace every row as under Inductor, without Inductor's
           # C++ compilation (over half a minute a row with a cold cache on 2 cores)
           "--backend", "aot_eager"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["schema"], doc["version"]) == ("loka.evalset", 1)
    env = doc["env"]
    assert env["timings_meaningful"] is False and "GPU" in env["note"]
    from loka.bench.env import source_digest
    assert env["source_sha1"] == source_digest()  # names the code that ran
    rows = {r["variant"]: r for r in doc["rows"]}
    assert list(rows) == ["bf16", "torchao-tensorwise", "torchao-rowwise",
                          "torchao-rowwise_with_gw_hp", "loka", "loka-optimize", "loka-delayed"]
    for r in doc["rows"]:
        assert ROW_FIELDS <= set(r), ROW_FIELDS - set(r)
        assert (r["model"], r["batch_size"], r["mode"], r["graphs"]) == ("wukong", 64, "train", False)
        if r["status"] != "ok":
            assert r["status"] == "skipped" and r["reason"], r   # torchao: missing or no CUDA
    bf16, lk = rows["bf16"], rows["loka"]
    for r in (bf16, lk):
        assert r["status"] == "ok", r["reason"]
        assert OK_FIELDS <= set(r), OK_FIELDS - set(r)
        assert r["step_ms"] > 0 and r["linears"] == 11 and r["gpu_ms"] is None
        # on the CPU the work runs inside the call: the host's time is all of the step's
        assert 0 < r["host_ms"] <= r["step_ms_max"] and r["host_over_gpu"] is None
        assert r["inductor_code"] is None and r["kernel_rates"] is None  # GPU rows only
        # the host's own time, on any device: the compiled graph's call among its events
        top = dict(r["host_top_us"])
        assert 0 < max(top.values()) <= r["host_us_per_step"] and len(top) <= 12
        assert any(k.startswith(("## Call CompiledFxGraph", "CompiledFunction",
                                 "Torch-Compiled")) for k in top), top
        assert not any(k.startswith("ProfilerStep") for k in top)
    assert bf16["fp8_sites"] == 0 and bf16["output_rel_err_vs_bf16"] < 1e-6
    assert lk["fp8_sites"] == len(lk["plan"]) > 0 and lk["probe_wall_s"] > 0
    assert 0 < lk["output_rel_err_vs_bf16"] < 0.15
    assert lk["vs_bf16"]["step"] == pytest.approx(bf16["step_ms"] / lk["step_ms"])
    assert doc["probes"][0]["probe_wall_s"] == lk["probe_wall_s"]
    # the Probe's prediction beside the measurement: untimed on a CPU, so it predicts the
    # bf16 step and lists every FP8 site-role as untimed
    pred = lk["prediction"]
    assert pred["baseline_step_ms"] == bf16["step_ms"] and pred["saved_ms"] == 0
    assert len(pred["untimed"]) >= lk["fp8_sites"] and pred["measured_step_ms"] == lk["step_ms"]
    assert pred["prediction_error"] == pytest.approx(lk["step_ms"] / bf16["step_ms"] - 1)
    assert pred["isolated_prediction_error"] == pred["prediction_error"]  # nothing timed
    assert pred["step_aware"] == []
    # no profile on a CPU: neither a GPU prediction nor a host-bound verdict
    assert pred["host_bound"] is None and "predicted_gpu_ms" not in pred
    # each LoKA row was timed again beside bf16's step, in alternating rounds
    paired = lk["paired_vs_bf16"]
    assert paired["rounds"] == 2 and paired["steps"] == 1, paired
    assert len(paired["round_ms"]["A"]) == len(paired["round_ms"]["B"]) == 2
    ratios = [a / b for a, b in zip(paired["round_ms"]["A"], paired["round_ms"]["B"])]
    assert paired["ratio_a_over_b"] == pytest.approx(sum(ratios) / 2)
    assert "paired_vs_bf16" not in bf16 and "_step" not in bf16 and "_step" not in lk
    cells = [c["loka"] for c in doc["summary"] if c["loka"] is not None]
    assert cells and cells[0]["prediction_error"] == pred["prediction_error"]
    assert bf16["prediction"] is None and "_plan" not in lk
    for f in doc["probes"][0]["files"].values():   # the Probe's report and plans load back
        assert Path(f).exists()
    loka.Plan.load(doc["probes"][0]["files"]["plan_train"])
    summary = doc["summary"][0]
    assert summary["loka"]["step_ms"] == lk["step_ms"] and summary["best_torchao"] is None
    # loka.optimize on the same report: untimed on a CPU, so the report's plan, and it says so
    opt = rows["loka-optimize"]
    assert opt["status"] == "ok" and opt["timed"] is False and opt["optimize_rounds"] == []
    assert opt["optimize_log"] == [] and opt["optimize_trials"] == 0  # no trial untimed
    assert opt["plan"] == lk["plan"] and opt["untuned_fp8_sites"] == lk["fp8_sites"]
    assert any("not timed" in n for n in opt["notes"])
    assert summary["loka_optimize"]["step_ms"] == opt["step_ms"]
    # the same report planned on its tensorwise kernels, trained with delayed scales
    dl = rows["loka-delayed"]
    assert dl["status"] == "ok", dl["reason"]
    assert dl["delayed_scaling"] == 0.9 and 0 < dl["fp8_sites"] == len(dl["plan"])
    assert any("delayed scaling (decay 0.9)" in n for n in dl["apply_notes"])
    assert 0 < dl["output_rel_err_vs_bf16"] < 0.15


@pytest.mark.parametrize("kernel, cls", [
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "gemm_bf16"),
    ("nvjet_qqtst_128x128_128x6_1x2_h_bz_coopA_TNT", "gemm_fp8"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x64", "gemm_fp8"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>",
     "gemm_bf16"),
    ("triton_tem_fused_mm_0", "gemm_bf16"),
    ("rowwise_gemm_kernel", "gemm_fp8"),
    ("rowwise_quant_kernel", "quantization"),
    ("triton_red_fused_abs_amax_0", "quantization"),
    ("triton_per_fused__scaled_mm__to_copy_abs_amax_clamp_clone_exp2_floor_log2_mul_"
     "reciprocal_t_transpose_view_0", "quantization"),                 # torchao, H200
    ("triton_poi_fused__scaled_mm__to_copy__unsafe_view_clamp_clone_exp2_floor_log2_mul_"
     "reciprocal_slice_t_transpose_view_26", "quantization"),
    ("triton_red_fused__scaled_mm__to_copy_abs_amax_mean_mul_pow_rsqrt_3", "triton"),
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_ovscale_TNT", "gemm_fp8"),
    ("nvjet_sm90_qrtst_128x128_128x6_2x1_v_bz_coopA_algo2_TNT", "gemm_fp8"),   # e4m3 x e5m2
    ("nvjet_sm90_tst_64x32_64x16_1x1_h_bz_splitK_NTT", "gemm_bf16"),
    ("triton_red_fused__to_copy__unsafe_view_add_cat_clone_mean_mul_pow_rsqrt_transpose_view_5",
     "triton"),
    ("triton_poi_fused_clone_transpose_3", "copies"),
    ("triton_poi_fused__to_copy_2", "copies"),
    ("triton_per_fused_cat_1", "copies"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_4", "triton"),
    ("triton_poi_fused_add_clamp_div_mul_5", "triton"),
    ("void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda>", "copies"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float4, 8>", "copies"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("void at::native::scatter_gather_elementwise_kernel<128, 4>", "other"),
    ("void at::native::reduce_kernel<512, 1>", "other"),
])
def test_kernel_classes(kernel, cls):
    assert _load_eval_set().kernel_class(kernel) == cls


# ------------------------------------------------------------------ LoKA never special-cases them

def _evalset_names():
    # the package's names and paths; EVAL_MODELS, SCALES and loss_fn are the contract of any
    # evaluation set (loka.bench.evalset loads one by its path), not a recognition of this one
    names = {"bench/evalset", "bench.evalset", "from evalset"}
    for mod in (evalset.common, evalset.wukong, evalset.dcnv2, evalset.dlrm):
        names |= {n for n, obj in vars(mod).items()
                  if inspect.isclass(obj) and obj.__module__ == mod.__name__}
    return names


def test_loka_does_not_know_the_eval_set():
    names = _evalset_names()
    assert {"WukongRec", "DCNv2Rec", "DLRMRec", "RowBlockNorm", "HSwish"} <= names
    pattern = re.compile(r"(?<![\w/.])(" + "|".join(sorted(map(re.escape, names))) + r")\b")
    hits = []
    for path in sorted((ROOT / "loka").rglob("*")):
        if path.is_file() and path.suffix in {".py", ".md", ".json", ".txt", ".toml", ".cfg"}:
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_the_eval_set_does_not_import_loka():
    for path in sorted((BENCH / "evalset").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] if node.level == 0 else []
            else:
                continue
            assert not any(m == "loka" or m.startswith("loka.") for m in mods), (path, mods)


# ------------------------------------------------------------------ loka bench --eval-set

TINY_SET = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

SCALES = ("small",)


class Tower(nn.Module):
    def __init__(self, scale):
        super().__init__()
        self.a, self.b = nn.Linear(32, 64, bias=False), nn.Linear(64, 1)

    def forward(self, x):
        return self.b(F.hardswish(self.a(x))).squeeze(-1)

    def make_batch(self, batch_size, device, dtype, seed=0):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, 32, generator=g).to(device, dtype)
        y = (torch.rand(batch_size, generator=g) < 0.3).float().to(device)
        return (x,), y


EVAL_MODELS = {"tower": Tower}


def loss_fn(model, batch):
    (x,), y = batch
    return F.binary_cross_entropy_with_logits(model(x).float(), y)
'''


def test_loka_bench_runs_a_users_eval_set_by_path(tmp_path, capsys):
    from loka.cli import main as cli_main

    path = tmp_path / "my_models.py"
    path.write_text(TINY_SET)
    out = tmp_path / "run.json"
    code = cli_main(["bench", "--eval-set", str(path), "--device", "cpu", "--batch-sizes", "64",
                     "--steps", "1", "--warmup", "1", "--out", str(out), "--eval-args",
                     "--modes serve --variants bf16,loka --backend aot_eager --no-save-plans "
                     "--inductor-config realize_reads_threshold=3"])
    assert code == 0
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"bf16", "loka"} and all(r["status"] == "ok" for r in rows.values())
    assert rows["bf16"]["linears"] == 2 and rows["bf16"]["fp8_sites"] == 0
    assert rows["loka"]["fp8_sites"] >= 1 and 0 < rows["loka"]["output_rel_err_vs_bf16"] < 0.2
    assert doc["env"]["eval_set"] == str(path)
    assert doc["env"]["inductor_config"] == {"realize_reads_threshold": 3}
    assert "wrote " + str(out) in capsys.readouterr().out
    from torch._inductor import config as inductor_config
    assert inductor_config.realize_reads_threshold == 4  # patched for the run only


def test_a_bad_inductor_option_is_refused_in_one_line(tmp_path, capsys):
    from loka.bench.evalset import parse_args

    for item, needle in (("nope=1", "KEY an option"), ("realize_reads_threshold=x", "JSON")):
        with pytest.raises(SystemExit) as e:
            parse_args(["--inductor-config", item, "--out", str(tmp_path / "x.json")],
                       BENCH / "evalset")
        assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("body, message", [
    ("SCALES = ('a',)\ndef loss_fn(m, b): pass\n", "EVAL_MODELS must be a non-empty dict"),
    ("EVAL_MODELS = {'m': object}\ndef loss_fn(m, b): pass\n", "SCALES must be a non-empty"),
    ("EVAL_MODELS = {'m': object}\nSCALES = ('a',)\n", "loss_fn(model, batch) is missing"),
    ("raise RuntimeError('broken model file')\n", "failed to import: RuntimeError: broken"),
])
def test_a_bad_eval_set_is_refused_in_one_line(tmp_path, body, message):
    from loka.bench.evalset import EvalSetError, load_eval_set

    path = tmp_path / "bad_set.py"
    path.write_text(body)
    with pytest.raises(EvalSetError, match=re.escape(message)) as err:
        load_eval_set(path)
    assert "\n" not in str(err.value)
    with pytest.raises(EvalSetError, match="not an evaluation set"):
        load_eval_set(tmp_path / "missing")


def test_the_repositorys_eval_set_loads_as_a_package():
    from loka.bench.evalset import load_eval_set

    es = load_eval_set(BENCH / "evalset")
    assert sorted(es.EVAL_MODELS) == NAMES and tuple(es.SCALES) == ("paper", "tiny")


def test_the_code_inventory_of_a_row_is_a_diagnostic_that_never_fails_the_row():
    from loka.bench.evalset import code_launches, kernel_rates
    code = ("def triton_poi_fused_relu_0(in_out_ptr0, xnumel, XBLOCK : tl.constexpr):\n    pass\n"
            "def call(args):\n"
            "    buf0 = empty_strided_cuda((128, 64), (64, 1), torch.bfloat16)\n"
            "    triton_poi_fused_relu_0.run(buf0, 8192, stream=raw_stream0)\n")
    launches = code_launches([code])
    assert [(l.name, l.bytes) for l in launches] == [("triton_poi_fused_relu_0", 2 * 8192 * 2)]
    got = kernel_rates({"triton_poi_fused_relu_0": 0.01}, launches)
    assert got["kernels"][0][4] == pytest.approx(2 * 8192 * 2 / 1e6 / 0.01, abs=0.1)
    assert code_launches([]) is None
    assert code_launches(["not wrapper code"]) is None
    assert kernel_rates({"k": 1.0}, None) is None
    assert kernel_rates({"k": 1.0}, ["not a launch"]) is None


# ------------------------------------------------------------------ bench/ab_steps.py

def test_ab_steps_alternates_the_two_compiled_steps(probed, tmp_path):
    """bf16 (A) and the plan (B) timed in rounds A B, B A, ...; the ratios and each
    variant's own spread from the round medians; the host's time of each (CPU: the times
    mean nothing, the plan is made with assume_fast)."""
    sys.path.insert(0, str(BENCH))
    import ab_steps

    assert ab_steps.round_order(3) == ["A", "B", "B", "A", "A", "B"]
    s = ab_steps.summarize({"A": [2.0, 4.0], "B": [1.0, 4.0]})
    assert s["ratio_a_over_b"] == pytest.approx(1.5) and s["a_spread"] == 2.0
    assert (s["ratio_min"], s["ratio_max"], s["b_spread"]) == (1.0, 2.0, 4.0)
    report = tmp_path / "r.json"
    probed["dlrm"][2].save(report)
    out = tmp_path / "ab.json"
    args = ["--model", "dlrm", "--scale", "tiny", "--batch-size", "64", "--mode", "serve",
            "--report", str(report), "--assume-fast", "--rounds", "2", "--steps", "2",
            "--warmup", "1", "--device", "cpu", "--backend", "aot_eager", "--out", str(out)]
    assert ab_steps.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["order"] == ["A", "B", "B", "A"] and doc["fp8_site_roles"]["B"] > 0
    assert doc["backend"] == "aot_eager"
    assert "A" not in doc["fp8_site_roles"]  # the model as written
    assert len(doc["round_ms"]["A"]) == len(doc["round_ms"]["B"]) == 2
    # two saved plans side by side: B's plan on A too, and a plan with no FP8 role on B
    plan = loka.plan(probed["dlrm"][2], inference=True, assume_fast=True)
    plan.save(tmp_path / "p.json")
    none = loka.plan(probed["dlrm"][2], inference=True)  # untimed on the CPU: all bf16
    none.save(tmp_path / "none.json")
    assert ab_steps.main(args + ["--plan-a", str(tmp_path / "p.json"),
                                 "--plan-b", str(tmp_path / "none.json")]) == 0
    two = json.loads(out.read_text())
    assert two["fp8_site_roles"] == {"A": doc["fp8_site_roles"]["B"], "B": 0}
    assert ab_steps.main(args + ["--plan-b", str(tmp_path / "p.json"), "--static-b"]) == 0
    assert json.loads(out.read_text())["static_b"] is True
    with pytest.raises(SystemExit):  # training takes dynamic scales
        ab_steps.main([a if a != "serve" else "train" for a in args] + ["--static-b"])
    assert doc["ratio_a_over_b"] > 0 and doc["a_ms"] > 0 and "gpu_ms" not in doc
    assert set(doc["host"]) == {"A", "B"} and doc["host"]["B"]["host_us_per_step"] > 0
    with pytest.raises(SystemExit) as e:
        ab_steps.main(args[:1] + ["nope"] + args[2:])
    assert e.value.code == 2


def test_guard_cost_counts_and_times_the_guards_a_plan_adds(probed, tmp_path):
    """bench/guard_cost.py: the compiled frame's guards, as written and with a serving plan
    applied; the plan's traced path adds guards (its kernels, the loka modules read)."""
    sys.path.insert(0, str(BENCH))
    import guard_cost

    plan = loka.plan(probed["dlrm"][2], inference=True, assume_fast=True)
    assert sum(c.kernel != plan.baseline for sp in plan.sites.values() for c in sp.roles.values())
    for sp in plan.sites.values():  # the cuBLAS twin of the CPU Probe's emulated choice
        for c in sp.roles.values():
            if c.kernel == "emulated-rowwise-e4m3":
                c.kernel = "cublas-rowwise"
    plan_path, out = tmp_path / "p.json", tmp_path / "g.json"
    plan.save(plan_path)
    # (the guards are Dynamo's: aot_eager spares the test Inductor's C++ compilation)
    args = ["--model", "dlrm", "--scale", "tiny", "--plan", str(plan_path), "--repeats", "2",
            "--backend", "aot_eager", "--out", str(out)]
    assert guard_cost.main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"as written", "plan"} and rows["plan"]["fp8_site_roles"] > 0
    assert rows["plan"]["guard_lines"] > rows["as written"]["guard_lines"] > 0
    assert all(r["check_us"] > 0 and r["profiled_lookup_us"] > 0 for r in rows.values())
    # no Python-evaluated aliasing check beyond the model's own: LoKA's traced code reads
    # torch, its enums and QTensor by one path each
    assert rows["plan"]["lambda_guards"] == rows["as written"]["lambda_guards"]
    assert json.loads(out.read_text())["grad_mode"] == "inference_mode"
    assert json.loads(out.read_text())["backend"] == "aot_eager"
    # the same forward under no_grad, as loka.optimize's timer runs it by default
    assert guard_cost.main(args + ["--no-grad"]) == 0
    doc = json.loads(out.read_text())
    assert doc["grad_mode"] == "no_grad" and doc["rows"]["plan"]["guard_lines"] > 0
    # a training step's guards (the plan's FP8 forwards applied for training)
    assert guard_cost.main(args + ["--train"]) == 0
    doc = json.loads(out.read_text())
    assert doc["mode"] == "train"
    rows = doc["rows"]
    assert rows["plan"]["guard_lines"] > rows["as written"]["guard_lines"] > 0
    # in training, Dynamo's autograd-Function wrapper adds its own check of torch
    assert rows["plan"]["lambda_guards"] <= rows["as written"]["lambda_guards"] + 1
    with pytest.raises(SystemExit) as e:
        guard_cost.main(args[:1] + ["nope"] + args[2:])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        guard_cost.main(args + ["--train", "--no-grad"])
    assert e.value.code == 2


def test_time_steps_splits_the_hosts_time_from_the_wait_for_the_device(monkeypatch):
    """host_ms is the step's call alone; the wall time adds the wait in synchronize (a
    scripted device: each step's call takes 2 ms of host time, its sync 5 ms more)."""
    import time as _time
    from loka.bench import evalset as lev

    clock = [0.0]
    monkeypatch.setattr(_time, "perf_counter", lambda: clock[0])

    def step():
        clock[0] += 0.002
        return torch.zeros(1)

    def sync(device):
        clock[0] += 0.005
    monkeypatch.setattr(lev, "synchronize", sync)
    t = lev.time_steps(step, torch.device("cpu"), warmup=2, steps=4)
    assert t["host_ms"] == pytest.approx(2.0) and t["step_ms"] == pytest.approx(7.0)
    assert t["step_ms_min"] == pytest.approx(7.0) and t["first_value"] == 0.0


def test_paired_rounds_hold_the_ratio_where_the_host_drifts(monkeypatch):
    """A scripted host that slows down 5% with every step: step A takes 2 units, B 1. Timed
    one after the other (as rows are), B's steps come later and slower, and the ratio
    drifts away from 2; in alternating rounds each round's ratio stays within the drift of
    one round."""
    import time as _time
    from loka.bench import evalset as lev

    clock, speed = [0.0], [1.0]
    monkeypatch.setattr(_time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(lev, "synchronize", lambda device: None)

    def step(cost):
        def run():
            clock[0] += cost * speed[0]
            speed[0] *= 1.05
            return None
        return run

    a, b, cpu = step(2.0), step(1.0), torch.device("cpu")
    seq = (lev.time_steps(a, cpu, 1, 8)["step_ms"], lev.time_steps(b, cpu, 1, 8)["step_ms"])
    assert seq[0] / seq[1] < 1.5  # the drift, not the steps, sets the sequential ratio
    speed[0] = 1.0
    paired = lev.paired_rounds(a, b, cpu, rounds=6, steps=3)
    assert lev.round_order(6) == ["A", "B", "B", "A", "A", "B", "B", "A", "A", "B", "B", "A"]
    assert paired["ratio_a_over_b"] == pytest.approx(2.0, rel=0.25)
    assert paired["ratio_min"] <= paired["ratio_a_over_b"] <= paired["ratio_max"]
    assert paired["a_spread"] > 1.5  # each variant drifted a lot against itself ...
    assert abs(paired["ratio_a_over_b"] - 2.0) < abs(seq[0] / seq[1] - 2.0)  # ... not the ratio
    assert len(paired["round_ms"]["A"]) == 6 and (paired["rounds"], paired["steps"]) == (6, 3)


def test_pipelined_steps_pay_the_synchronization_once_per_block(monkeypatch):
    """Steps issued back to back: a scripted step of 2 ms of host time whose device work
    ends 5 ms after the last call (the sync's wait) costs (n * 2 + 5) / n per step, where
    time_steps pays 2 + 5 for each; the paired variant alternates blocks and gives bf16's
    (A's) time over the other's."""
    import time as _time
    from loka.bench import evalset as lev

    clock = [0.0]
    monkeypatch.setattr(_time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(lev, "synchronize", lambda device: clock.__setitem__(0, clock[0] + 0.005))

    def step(cost):
        def run():
            clock[0] += cost
        return run

    cpu = torch.device("cpu")
    p = lev.time_pipelined(step(0.002), cpu, steps=10, repeats=3)
    # the first synchronize (an idle device) adds 5 ms before the first block only
    assert p["pipelined_ms"] == pytest.approx((10 * 2 + 5) / 10)
    assert p["pipelined_ms_max"] == pytest.approx(p["pipelined_ms"]) and p["pipelined_steps"] == 10
    assert lev.time_steps(step(0.002), cpu, 1, 4)["step_ms"] == pytest.approx(7.0)
    paired = lev.paired_pipelined(step(0.004), step(0.002), cpu, rounds=2, steps=5)
    assert paired["ratio_a_over_b"] == pytest.approx((5 * 4 + 5) / (5 * 2 + 5))
    assert len(paired["round_ms"]["A"]) == len(paired["round_ms"]["B"]) == 2


@pytest.mark.parametrize("argv", [["--paired-rounds", "1"], ["--paired-rounds", "-2"],
                                  ["--paired-rounds", "2", "--paired-steps", "0"]])
def test_bad_paired_options_are_refused(argv, tmp_path, capsys):
    from loka.bench import evalset as lev
    with pytest.raises(SystemExit):
        lev.parse_args(["--out", str(tmp_path / "o.json")] + argv, BENCH / "evalset")
    assert "--paired-rounds must be 0 (off) or >= 2" in capsys.readouterr().err


def test_the_host_slowdown_option_takes_a_finite_number_not_below_one(tmp_path, capsys):
    from loka.bench import evalset as lev

    out = ["--out", str(tmp_path / "o.json")]
    assert lev.parse_args(out, BENCH / "evalset")[0].optimize_host_slowdown is None
    assert lev.parse_args(out + ["--optimize-host-slowdown", "2"],
                          BENCH / "evalset")[0].optimize_host_slowdown == 2.0
    for bad in ("0.5", "nan", "inf", "fast"):
        with pytest.raises(SystemExit):
            lev.parse_args(out + ["--optimize-host-slowdown", bad], BENCH / "evalset")
        assert "--optimize-host-slowdown" in capsys.readouterr().err


def test_host_syncs_lists_what_one_step_waits_for_and_restores_the_mode(monkeypatch):
    """A scripted CUDA: the step warns once per synchronizing call while the debug mode is
    'warn' (as torch does), and the mode goes back to what it was, even when the step
    raises. Off CUDA there is nothing to check."""
    import warnings as _warnings
    from loka.bench import evalset as lev

    mode = ["0"]
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode[0])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.__setitem__(0, m))
    monkeypatch.setattr(lev, "synchronize", lambda device: None)

    def step(n_syncs, fail=False):
        def run():
            for i in range(n_syncs):
                if mode[0] == "warn":
                    _warnings.warn(f"called a synchronizing CUDA operation ({i})")
            _warnings.warn("an unrelated warning")
            _warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                           "detect all synchronizing operations")
            if fail:
                raise RuntimeError("boom")
        return run

    cuda = torch.device("cuda")
    assert lev.host_syncs(step(0), cuda) == []
    found = lev.host_syncs(step(2), cuda)
    assert found == ["called a synchronizing CUDA operation (0)",
                     "called a synchronizing CUDA operation (1)"]
    assert mode[0] == "0"
    with pytest.raises(RuntimeError, match="boom"):
        lev.host_syncs(step(1, fail=True), cuda)
    assert mode[0] == "0"
    assert lev.host_syncs(step(3), torch.device("cpu")) is None


# ------------------------------------------------------------------ bench/reprice.py

def _gpu_like(report, kernel="cublas-rowwise-fastacc"):
    """``report`` as a GPU Probe would have written it for one compiled FP8 kernel: every
    forward's bf16 100 us, the call 97 us, the GEMM alone 60 us, the weight-quantized
    forward 85 us, all old producers 'pointwise' (as priced before 'blocked' existed)."""
    from loka.probe.report import ErrorStat, KernelResult

    rep = copy.deepcopy(report)
    rep.device, ok = "cuda:0", ErrorStat(0.01, 0.009, 0.011, 16)
    for site in rep.sites.values():
        site.producers = {"x": "pointwise", "dy": "pointwise"}
        rr = site.roles[loka.Role.FWD]
        rr.baseline_us = 100.0
        rr.kernels = {kernel: KernelResult(
            kernel, mere=ok, time_us=97.0, speedup=100 / 97, timing="cuda-graph+compiled",
            time_us_weight_q=85.0, speedup_weight_q=100 / 85, safe=True, fast=True,
            time_us_gemm=60.0, step_us=97 - 25 * 2 / 3,
            step_speedup=100 / (97 - 25 * 2 / 3))}
        site.roles = {loka.Role.FWD: rr}
    return rep


def test_reprice_prices_recorded_timings_with_the_producers_read_now(probed, tmp_path):
    """bench/reprice.py: the DCNv2's producers read again (a cross layer whose input adds a
    GEMM's output to the block norm's fuses; the block norm's own output does not), the
    report's timings priced with them, the plans compared, and each LoKA row's measured GPU
    saving set beside both predictions."""
    sys.path.insert(0, str(BENCH))
    import reprice

    model, batches, report = probed["dcnv2"]
    producers = reprice.read_producers(model, batches[0], loss_fn)
    assert producers["cross.0.weight"]["x"] == "blocked"
    assert producers["cross.1.weight"]["x"] == "pointwise"
    before = _gpu_like(report)
    after = reprice.reprice(before, producers)
    fused = after.sites["cross.1.weight"].roles[loka.Role.FWD].kernels["cublas-rowwise-fastacc"]
    blocked = after.sites["cross.0.weight"].roles[loka.Role.FWD].kernels["cublas-rowwise-fastacc"]
    assert fused.step_us == pytest.approx(97 - 25 * 2 / 3)  # x's pass: 85 - 60
    assert fused.serve_us == pytest.approx(85 - 25 * 2 / 3)
    assert blocked.step_us is blocked.serve_us is blocked.step_speedup is None
    # the cross layer's input also feeds the residual: read by more than its Linear
    assert reprice.changed_kinds(before, after)["cross.0.weight"] == {
        "x": "pointwise -> blocked", "x_users": "None -> shared", "x_layout": "None -> rows"}
    with reprice.planning_off_device():
        old, new = loka.plan(before), loka.plan(after)
    changes = reprice.plan_changes(old, new)
    assert changes["cross.0.weight:fwd"] == "cublas-rowwise-fastacc -> bf16"  # 100/97 < 1.05
    assert "cross.1.weight:fwd" not in changes
    # a measured pair of rows: bf16 at 2.0 ms of GPU time, LoKA at 1.9
    rows = [{"status": "ok", "model": "dcnv2", "variant": v, "mode": "train", "graphs": False,
             "batch_size": 64, "gpu_ms": ms} for v, ms in (("bf16", 2.0), ("loka", 1.9))]
    (row,) = reprice.compare_rows(rows, "dcnv2", {"train": old}, before, after)
    fp8 = sum(c.kernel != old.baseline for sp in old.sites.values() for c in sp.roles.values())
    assert row["measured_saved_ms"] == pytest.approx(0.1)
    assert row["recorded_saved_ms"] == pytest.approx(fp8 * (100 - (97 - 25 * 2 / 3)) / 1e3)
    assert row["repriced_saved_ms"] < row["recorded_saved_ms"]
    # the script: report and eval JSON in, one document out; bad input in one line
    rpath, epath, out = tmp_path / "r.json", tmp_path / "e.json", tmp_path / "o.json"
    before.save(rpath)
    epath.write_text(json.dumps({"rows": rows}))
    args = ["--model", "dcnv2", "--scale", "tiny", "--report", str(rpath), "--eval",
            str(epath), "--out", str(out)]
    assert reprice.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["plan_changes"]["train"] == changes and len(doc["rows"]) == 1
    assert reprice.main(args[:1] + ["wukong"] + args[2:]) == 2  # not the report's model
    epath.write_text("{not json")
    assert reprice.main(args) == 2


def test_the_prediction_is_also_made_on_gpu_time_and_says_when_the_host_bounds_the_step(
        probed):
    """add_prediction predicts the LoKA row from the bf16 row's wall time and, where both
    rows were profiled, from its GPU time, which is what the Probe prices; host_bound is
    the bf16 row's host time against its GPU time. Savings beyond the GPU time leave a
    note and no GPU prediction."""
    import reprice
    from loka.bench import evalset as lev
    from loka.dispatch import predict_step

    _, _, report = probed["dcnv2"]
    rep = _gpu_like(report)
    with reprice.planning_off_device():
        plan = loka.plan(rep, inference=True)
    assert sum(c.kernel != plan.baseline for sp in plan.sites.values()
               for c in sp.roles.values()) > 0

    def rows(host_ms, bf16_gpu_ms=2.0):
        common = {"status": "ok", "model": "dcnv2", "mode": "serve", "graphs": False,
                  "batch_size": 64}
        bf16 = dict(common, variant="bf16", step_ms=3.0, gpu_ms=bf16_gpu_ms, host_ms=host_ms)
        lk = dict(common, variant="loka", step_ms=2.9, gpu_ms=1.9, host_ms=host_ms, _plan=plan)
        return [bf16, lk], lk

    group, lk = rows(host_ms=1.0)
    lev.add_prediction(group, lk, rep)
    pred = lk["prediction"]
    want = predict_step(plan, rep, 2.0, inference=True).predicted_step_ms
    assert want < 2.0 and pred["predicted_gpu_ms"] == pytest.approx(want)
    assert pred["gpu_prediction_error"] == pytest.approx(1.9 / want - 1)
    assert pred["prediction_error"] == pytest.approx(
        2.9 / predict_step(plan, rep, 3.0, inference=True).predicted_step_ms - 1)
    assert pred["host_bound"] is False
    # the ceiling of the same step: on the bf16 row's GPU time, serving, no head kept back
    ceil = lk["ceiling"]
    from loka.dispatch import fp8_ceiling
    want_c = fp8_ceiling(rep, 2.0, inference=True, head_sites=plan.budget["head_sites"])
    assert ceil["on"] == "gpu" and ceil["head"] == []
    assert ceil["measured_speedup"] == pytest.approx(want_c.measured_speedup, rel=1e-12)
    assert ceil["measured_speedup"] >= 2.0 / want - 1e-9  # no plan beats the ceiling
    assert ceil["gemm_ms"] == pytest.approx(sum(
        rr.baseline_us for sr in rep.sites.values() for role, rr in sr.roles.items()
        if role.value == "fwd") / 1e3)
    (summary,) = lev.summarize(group)
    cell = summary["loka"]
    assert cell["ceiling"]["measured_speedup"] == ceil["measured_speedup"]
    # the host-speed control: bf16's host time beside its GPU time, per group and per cell
    assert summary["host_bound"] is False and summary["bf16"]["host_ms"] == 1.0
    assert "gpu_idle_us" not in cell  # no idle profile in these rows
    lk["gpu_idle"] = {"idle_us": 123.0}
    assert lev.summarize(group)[0]["loka"]["gpu_idle_us"] == 123.0
    assert "ceil x" in lev.table(group).splitlines()[0]
    # the graph setting's column: no graphs, Inductor's, or whole steps captured
    for graphs, capture, label in ((False, None, "False"), (True, "trees", "True"),
                                   (True, "step", "step")):
        shown = lev.table([dict(lk, graphs=graphs, graph_capture=capture)]).splitlines()[-1]
        assert shown.split()[4] == label
    group, lk = rows(host_ms=2.5)  # the host takes longer than the GPU
    lev.add_prediction(group, lk, rep)
    assert lk["prediction"]["host_bound"] is True
    group, lk = rows(host_ms=1.0, bf16_gpu_ms=1e-6)  # less GPU time than the plan saves
    lev.add_prediction(group, lk, rep)
    assert "predicted_gpu_ms" not in lk["prediction"]
    assert "gpu_prediction_note" in lk["prediction"]
    (summary,) = lev.summarize(group)
    cell = summary["loka"]
    assert cell["gpu_prediction_error"] is None and cell["host_bound"] is True
    assert summary["host_bound"] is True  # bf16: 1.0 ms of host time against 1e-6 of GPU
    group[0]["gpu_ms"] = None  # not profiled (a CPU row): no control
    assert lev.summarize(group)[0]["host_bound"] is None


# ------------------------------------------------------------------ bench/blockwise_fusion.py
def test_blockwise_fusion_regions_run_on_the_cpu_and_agree_with_float64(tmp_path):
    """bench/blockwise_fusion.py's CPU smoke run: each region's output (block norm, Hard
    Swish, then the GEMM) against the float64 product of the same producer output: bf16
    within bf16 rounding, FP8 within e4m3's; a 1x256 scale (the norm's block) expanded to
    the 1x128 the GEMM reads gives the same product as its own 1x256 dequantization."""
    sys.path.insert(0, str(BENCH))
    import blockwise_fusion as bf
    out = tmp_path / "bf.json"
    variants = "bf16,g256-emul,tensorwise-static-fastacc,g256-nothing"
    assert bf.main(["--device", "cpu", "--batch", "64", "--sites", "top.1.0", "--variants",
                    variants, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["sites"]["top.1.0"]["variants"]
    assert rows["bf16"]["rel_err"] < 8e-3
    assert 5e-3 < rows["g256-emul"]["rel_err"] < 0.06
    assert 5e-3 < rows["tensorwise-static-fastacc"]["rel_err"] < 0.06
    assert "unknown variant" in rows["g256-nothing"]["error"]  # recorded, the run went on
    scale = torch.tensor([[2.0, 0.5]])
    assert torch.equal(bf.expand_scales(scale, 256), torch.tensor([[2.0, 2.0, 0.5, 0.5]]))
    assert bf.expand_scales(scale, 128) is scale


def test_the_static_row_serves_the_plan_with_the_amax_the_probe_saw(probed):
    """``loka-static``: ``loka.plan(report, inference=True, static_scales=True)``, each FP8
    forward whose kernel takes a static scale quantizing x with the input amax the report
    observed, as the plan carries it; the same as ``evalset.static_scales`` gives the
    dynamic serving plan's sites."""
    from loka.bench import evalset as lev
    from loka.dispatch.static import amax_from_report

    model, batches, report = probed["dlrm"]
    plan = loka.plan(report, inference=True, assume_fast=True)
    static = loka.plan(report, inference=True, assume_fast=True, static_scales=True)
    scales = static.static_scales
    fp8 = {n for n, sp in static.sites.items()
           if sp.roles[loka.Role.FWD].kernel != static.baseline}
    assert scales and set(scales) <= fp8
    observed = amax_from_report(report)
    assert all(scales[n] == observed[n] > 0 for n in scales)
    assert lev.static_scales(report, plan) == scales  # (untimed: the same kernels)
    case = lev.Case("dlrm", 64, model, batches[0], {}, 0, report=report,
                    plans={"train": plan, "serve": plan, "static": static})
    served = copy.deepcopy(model)
    sites, _, extra = lev.convert(served, "loka-static", "serve", case, torch.device("cpu"))
    assert sites == len(fp8) and extra["static_sites"] == sorted(scales)
    for name in scales:
        assert float(served.get_submodule(name).input_amax) == pytest.approx(scales[name])
    inputs = batches[0][0]
    with torch.no_grad():
        assert 0 < _rel(served.eval()(*inputs), model.eval()(*inputs)) < 0.15
    none = lev.Case("dlrm", 64, model, batches[0], {}, 0)  # no Probe ran
    with pytest.raises(lev.Skip, match="no plan"):
        lev.convert(copy.deepcopy(model), "loka-static", "serve", none, torch.device("cpu"))


def test_the_optimize_static_row_takes_the_static_plan_through_loka_optimize(probed, monkeypatch):
    """``loka-optimize-static``: ``loka.optimize(..., inference=True, static_scales=True)``
    on the case's report. Untimed on a CPU, it returns the static plan as made from the
    report (the same sites and amax as the ``loka-static`` row) and says it was not timed;
    in training it is no variant at all."""
    from types import SimpleNamespace

    from loka.bench import evalset as lev

    model, batches, report = probed["dlrm"]
    static = loka.plan(report, inference=True, assume_fast=True, static_scales=True)
    case = lev.Case("dlrm", 64, model, batches[0], {}, 0, report=report,
                    plans={"train": static, "serve": static, "static": static})
    args = SimpleNamespace(eval_set=SimpleNamespace(loss_fn=loss_fn), optimize_trials=2,
                           optimize_rounds=1)
    served = copy.deepcopy(model)
    sites, notes, extra = lev.convert(served, "loka-optimize-static", "serve", case,
                                      torch.device("cpu"), args=args)
    assert extra["timed"] is False and extra["optimize_rounds"] == []
    assert any("not timed" in n for n in notes)
    assert extra["static_sites"] == sorted(static.static_scales) and static.static_scales
    assert sites == len(static.fp8_sites()) == len(extra["plan"])
    for name, amax in static.static_scales.items():
        assert float(served.get_submodule(name).input_amax) == pytest.approx(amax)
    assert extra["optimize_synchronized"] is False
    # --optimize-synchronized reaches loka.optimize
    seen = {}
    real = lev.optimize_plan

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)
    monkeypatch.setattr(lev, "optimize_plan", spy)
    args.optimize_synchronized = True
    _, _, again = lev.convert(copy.deepcopy(model), "loka-optimize-static", "serve", case,
                              torch.device("cpu"), args=args)
    assert seen["synchronized_steps"] is True and again["optimize_synchronized"] is True
    assert "host_slowdown" not in seen and again["optimize_host_check"] is None  # untimed
    # --optimize-host-slowdown reaches it too
    args.optimize_host_slowdown = 2.0
    lev.convert(copy.deepcopy(model), "loka-optimize-static", "serve", case,
                torch.device("cpu"), args=args)
    assert seen["host_slowdown"] == 2.0
    assert seen["capture_steps"] is False and seen["compile_mode"] is None  # no graphs
    # the CUDA-graph rows: Inductor's graphs, or with --graph-capture step whole steps
    for capture, mode, steps in (("trees", "reduce-overhead", False), ("step", None, True)):
        args.graph_capture = capture
        lev.convert(copy.deepcopy(model), "loka-optimize-static", "serve", case,
                    torch.device("cpu"), graphs=True, args=args)
        assert (seen["compile_mode"], seen["capture_steps"]) == (mode, steps)
    del args.graph_capture

    def paired_log(*a, **kw):  # a paired trial's two timings stay in the row's log
        result = real(*a, **kw)
        result.trials = [{"sites": ["a", "b"], "removed": None, "time": 1.0, "raw_time": 1.1,
                          "baseline_time": 1.2, "paired_with": "copy", "other": 5}]
        return result
    monkeypatch.setattr(lev, "optimize_plan", paired_log)
    _, _, logged = lev.convert(copy.deepcopy(model), "loka-optimize-static", "serve", case,
                               torch.device("cpu"), args=args)
    assert logged["optimize_log"] == [{"sites": 2, "removed": None, "time": 1.0,
                                       "raw_time": 1.1, "baseline_time": 1.2,
                                       "paired_with": "copy"}]
    inputs = batches[0][0]
    with torch.no_grad():
        assert 0 < _rel(served.eval()(*inputs), model.eval()(*inputs)) < 0.15
    with pytest.raises(lev.Skip, match="serving"):
        lev.convert(copy.deepcopy(model), "loka-optimize-static", "train", case,
                    torch.device("cpu"), args=args)
    assert "loka-optimize-static" in lev.VARIANTS["serve"]
    assert "loka-optimize-static" not in lev.VARIANTS["train"]


def _serve_tiny_dlrm(out, variants: str, *extra: str) -> int:
    """``bench/eval_set.py``'s main in this process: the tiny DLRM's serving rows at batch
    32, one untimed and one timed step, no CUDA graphs, ``variants`` and ``extra``."""
    from loka.bench import evalset as lev

    return lev.main(["--scale", "tiny", "--models", "dlrm", "--batch-sizes", "32", "--modes",
                     "serve", "--variants", variants, "--steps", "1", "--warmup", "1",
                     "--no-graphs", "--out", str(out), *extra], eval_set=str(BENCH / "evalset"))


def test_the_probe_runs_before_any_row_of_its_case(tmp_path, monkeypatch):
    """Every row of a case, the bf16 baseline's included, is timed after its Probe: a host
    the Probe leaves slower for a while slows every row alike, not the LoKA rows alone.
    Each row records the host's load average when it started (a diagnostic)."""
    from loka.bench import evalset as lev

    order = []
    real_probe, real_row = lev.probe_case, lev.run_row

    def probe_case(case, *a, **k):
        order.append(("probe", case.name))
        return real_probe(case, *a, **k)

    def run_row(case, variant, mode, *a, **k):
        order.append((variant, mode))
        return real_row(case, variant, mode, *a, **k)
    monkeypatch.setattr(lev, "probe_case", probe_case)
    monkeypatch.setattr(lev, "run_row", run_row)
    out = tmp_path / "e.json"
    assert _serve_tiny_dlrm(out, "bf16,loka-static", "--backend", "aot_eager") == 0
    assert order == [("probe", "dlrm"), ("bf16", "serve"), ("loka-static", "serve")]
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok", "ok"], [r["reason"] for r in rows]
    assert all(r["loadavg_1m"] >= 0 for r in rows)
    # only baselines asked for: no Probe at all
    order.clear()
    assert _serve_tiny_dlrm(out, "bf16", "--backend", "aot_eager") == 0
    assert order == [("bf16", "serve")]
    # CUDA-graph rows alone need a CUDA device; with --no-graphs they contradict each other
    bads = [["--graphs-only", "--no-graphs"], ["--graph-capture", "step", "--no-graphs"],
            ["--graph-capture", "module"],
            ["--graph-capture", "step", "--inductor-config", "triton.cudagraphs=true"]] + ([] if torch.cuda.is_available()
                                                 else [["--graphs-only"]])
    for bad in bads:
        with pytest.raises(SystemExit):
            lev.main(["--scale", "tiny", "--models", "dlrm", "--out", str(out)] + bad,
                     eval_set=str(BENCH / "evalset"))


def test_graph_rows_mark_steps_for_inductors_graphs_or_capture_whole_steps(monkeypatch):
    """make_step: without graphs a plain step; with Inductor's graphs (trees) each step marks
    a new one; with ``capture`` the whole step (forward, loss, backward, the optimizer's
    update) is a :class:`CapturedStep` that marks nothing, its optimizer capturable on CUDA."""
    from loka.bench import evalset as lev

    marks, wrapped = [], []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))

    class Captured:
        def __init__(self, step, device):
            wrapped.append(device)
            self.step = step

        def __call__(self):
            return self.step()
    monkeypatch.setattr(lev, "CapturedStep", Captured)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    batch = ((torch.randn(16, 8),), torch.rand(16, 1))

    def loss(m, b):
        return nn.functional.binary_cross_entropy_with_logits(m(*b[0]), b[1])
    cpu = torch.device("cpu")
    for mode in ("train", "serve"):
        for graphs, capture, n_marks, n_wrapped in ((False, False, 0, 0), (True, False, 1, 0),
                                                    (True, True, 0, 1)):
            marks.clear(), wrapped.clear()
            before = model.weight.detach().clone()
            step = lev.make_step(model, model, mode, batch, graphs, cpu, loss, capture=capture)
            assert isinstance(step, Captured) is bool(n_wrapped)
            out = step()
            assert (len(marks), len(wrapped)) == (n_marks, n_wrapped)
            assert wrapped == [cpu] * n_wrapped
            if mode == "train":  # a training step: the loss, and the weights moved
                assert out.ndim == 0 and not torch.equal(model.weight, before)
                assert all(p.grad is None for p in model.parameters())
            else:
                assert out.shape == (16, 1) and torch.equal(model.weight, before)


# ------------------------------------------------------------- bench/evalset_quality.py
def test_evalset_quality_scores_serving_plans_paired_against_bf16(tmp_path):
    """bench/evalset_quality.py on the CPU: a tiny evaluation-set DLRM trained, served in
    bf16 and with FP8 plans (dynamic, static, static under the serving NE budget), each
    arm's change paired against bf16 serving on the same held-out examples."""
    sys.path.insert(0, str(BENCH))
    import evalset_quality as eq
    out = tmp_path / "q.json"
    assert eq.main(["--models", "dlrm:tiny:3e-3", "--seeds", "0", "--steps", "120",
                    "--batch-size", "128", "--eval-batch", "256", "--eval-batches", "4",
                    "--margins", "1", "--ne-budget", "1e-9", "--device", "cpu",
                    "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "loka.evalset-quality" and doc["kernel"] == "emulated-tensorwise-e4m3"
    run = doc["models"]["dlrm:tiny:3e-3"]["seeds"][0]
    assert 0 < run["ne_bf16"] < 1 and run["linears"] == 7
    arms = run["arms"]
    assert set(arms) == {"dynamic", "static x1", "static x1 budget"}
    for arm in arms.values():
        lo, hi = arm["interval"]
        assert lo <= arm["rel_ne_change"] <= hi and hi - lo < 0.05
    assert arms["dynamic"]["static_sites"] == 0 < arms["static x1"]["static_sites"]
    assert arms["static x1"]["fp8_sites"] == arms["dynamic"]["fp8_sites"] > 0
    # a budget no 1024 validation examples can certify: every forward back, no change at all
    budget = arms["static x1 budget"]
    assert budget["fp8_sites"] == 0 and budget["rel_ne_change"] == 0.0
    assert budget["budget"]["examples"] == 1024
    assert len(budget["budget"]["moved_back"]) == arms["static x1"]["fp8_sites"]
    assert eq.main(["--models", "nope:tiny", "--out", str(out)]) == 2
    # training batches whose seeds would reach the probe and held-out streams
    assert eq.main(["--models", "dlrm:tiny", "--steps", "6000", "--out", str(out)]) == 2


# ------------------------------------------------------------------ bench/step_host.py
def test_step_host_profiles_both_variants_and_refuses_a_bad_plan(tmp_path):
    """bench/step_host.py on the CPU: a tiny DCNv2's compiled serving step, bf16 and a
    static tensorwise plan: wall, issue and guard times, the profiler's and cProfile's top
    entries; the plan's guard tree is larger than bf16's (FP8 weights, scale tables)."""
    sys.path.insert(0, str(BENCH))
    import step_host
    model = EVAL_MODELS["dcnv2"]("tiny")
    plan = loka.Plan.uniform(model, "cublas-tensorwise")
    plan.static_scales = {name: 4.0 for name in plan.sites}
    plan.device = "cpu"
    ppath, out = tmp_path / "plan.json", tmp_path / "host.json"
    plan.save(str(ppath))
    assert step_host.main(["--model", "dcnv2", "--scale", "tiny", "--batch-size", "16",
                           "--plan", str(ppath), "--steps", "3", "--warmup", "2",
                           "--rounds", "2",
                           "--profile-steps", "2", "--top", "5", "--device", "cpu",
                           "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    for name in ("bf16", "plan"):
        v = doc["variants"][name]
        assert len(v["wall_rounds_ms"]) == 2 == len(v["issue_rounds_ms"])  # A B B A: 2 each
        assert v["wall_ms"] == pytest.approx(sum(v["wall_rounds_ms"]) / 2)
        assert 0 < v["issue_ms"] and v["guard_us"] > 0 and v["guard_check_us"] > 0
        assert len(v["profile_top"]) == 5 and len(v["python_top"]) == 5
        assert all(r[1] >= 0 for r in v["python_top"])
    # (times are not compared: a loaded host moves them; the guard trees' sizes are fixed)
    assert doc["variants"]["plan"]["guard_lines"] > doc["variants"]["bf16"]["guard_lines"]
    assert doc["variants"]["plan"]["tensor_guards"] > doc["variants"]["bf16"]["tensor_guards"]
    assert doc["paired"]["issue_ms"] == pytest.approx(
        doc["variants"]["bf16"]["issue_ms"] / doc["variants"]["plan"]["issue_ms"])
    (tmp_path / "bad.json").write_text("{not json")
    assert step_host.main(["--plan", str(tmp_path / "bad.json"), "--out", str(out),
                           "--device", "cpu", "--scale", "tiny"]) == 2


def test_step_host_bisects_a_plan_by_site_and_against_the_general_path(tmp_path):
    """--prefix-sites keeps the plan's first k FP8 sites; --compare-general runs the same
    plan on loka.Linear's general path; --skip-guards times the rounds again without
    Dynamo's guards. Every variant is timed in each round, in rotated order."""
    sys.path.insert(0, str(BENCH))
    import step_host
    assert step_host.rotated_order(["a", "b"], 4) == ["a", "b", "b", "a"] * 2
    order = step_host.rotated_order(["a", "b", "c"], 3)
    assert order == ["a", "b", "c", "a", "c", "b", "c", "a", "b"]
    model = EVAL_MODELS["dcnv2"]("tiny")
    plan = loka.Plan.uniform(model, "cublas-tensorwise")
    plan.static_scales = {name: 4.0 + i for i, name in enumerate(plan.sites)}
    plan.device = "cpu"
    fp8_sites = [n for n, s in plan.sites.items()
                 if any(c.kernel != plan.baseline for c in s.roles.values())]
    first = step_host.prefix_plan(plan, 2)
    kept = [n for n, s in first.sites.items()
            if any(c.kernel != first.baseline for c in s.roles.values())]
    assert kept == fp8_sites[:2] and set(first.static_scales) <= set(kept)
    with pytest.raises(ValueError, match="FP8 sites"):
        step_host.prefix_plan(plan, len(fp8_sites) + 1)
    ppath, out = tmp_path / "plan.json", tmp_path / "host.json"
    plan.save(str(ppath))
    assert step_host.main(["--model", "dcnv2", "--scale", "tiny", "--batch-size", "16",
                           "--plan", str(ppath), "--steps", "2", "--warmup", "2",
                           "--rounds", "2", "--prefix-sites", "1", "--compare-general",
                           "--skip-guards", "--mode-per-step", "--profile-steps", "2", "--top", "3",
                           "--device", "cpu", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert list(doc["variants"]) == ["bf16", "plan", "plan@1", "plan-general"]
    for name, v in doc["variants"].items():
        assert len(v["issue_rounds_ms"]) == 2 == len(v["issue_noguard_rounds_ms"])
        assert v["tensor_guards"] > 0 and v["guard_lines"] > v["tensor_guards"]
    v = doc["variants"]
    # the general path guards more than the short one; one site fewer tensors than all
    assert v["plan-general"]["guard_lines"] > v["plan"]["guard_lines"]
    assert v["plan@1"]["tensor_guards"] < v["plan"]["tensor_guards"]
    assert set(doc["paired_by_variant"]) == {"plan", "plan@1", "plan-general"}
    assert doc["paired"] == doc["paired_by_variant"]["plan"]
    assert step_host.main(["--plan", str(ppath), "--prefix-sites", "x", "--out", str(out),
                           "--device", "cpu", "--scale", "tiny"]) == 2


# ------------------------------------------------------------------ bench/probe_time.py
def test_probe_time_profiles_a_probe_on_fresh_caches(tmp_path):
    """bench/probe_time.py on the CPU, in a process of its own (the fresh caches are set
    before torch is imported): the Probe's wall time, its phases, cProfile's top rows and
    the named groups; the caches it names are new folders its compiles could fill."""
    out = tmp_path / "pt.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(BENCH / "probe_time.py"), "--fresh-caches",
                           "--scale", "tiny", "--batch-size", "32", "--probe-batches", "2",
                           "--device", "cpu", "--top", "7", "--report-out",
                           str(tmp_path / "r.json"), "--probe-config",
                           '{"num_samples": 2, "progress": false, '
                           '"kernels": ["bf16", "emulated-rowwise-e4m3"]}', "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "loka.bench.probe_time" and doc["sites"] == 11
    saved = loka.ProbeReport.load(str(tmp_path / "r.json"))
    assert len(saved.sites) == 11 and saved.meta["phases_s"] == doc["meta"]["phases_s"]
    assert doc["meta"]["spent"]["fxgraph_bypasses"] == 0 == doc["meta"]["spent"]["aot_bypasses"]
    assert doc["cache_bypass_reasons"] == {}
    caches = doc["fresh_caches"]
    assert set(caches) == {"TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"}
    assert all(os.path.isdir(d) and "loka-probe-time-" in d for d in caches.values())
    assert doc["probe_config"]["num_samples"] == 2
    phases = doc["meta"]["phases_s"]
    assert phases["errors"] > 0 and phases["timing"] > 0
    assert doc["probe_wall_s"] >= phases["errors"] + phases["timing"]
    assert len(doc["top_cumulative"]) == 7 == len(doc["top_own"])
    cum = [r["cumulative_s"] for r in doc["top_cumulative"]]
    assert cum == sorted(cum, reverse=True) and cum[0] <= doc["probe_wall_s"] * 1.01
    assert any(r["function"].endswith(":probe") for r in doc["top_cumulative"])
    groups = doc["groups_s"]
    assert set(groups) >= {"dynamo", "triton_compile", "precompile_wait", "cuda_synchronize"}
    assert all(0 <= v <= doc["probe_wall_s"] for v in groups.values())
    assert groups["precompile_wait"] == 0 == groups["triton_compile"]  # no child, no Triton


def test_probe_time_counts_why_graphs_bypass_the_caches():
    """The filter counts the caches' 'Bypassing' records by reason, passes on only what the
    loggers' levels before let through, and leaves the loggers as it found them."""
    import logging

    sys.path.insert(0, str(BENCH))
    import probe_time

    fx = logging.getLogger("torch._inductor.codecache")
    aot = logging.getLogger("torch._functorch._aot_autograd.autograd_cache")
    passed = []

    class Keep(logging.Handler):
        def emit(self, record):
            passed.append(record.getMessage())
    keep, level = Keep(logging.DEBUG), fx.level
    fx.addHandler(keep)
    try:
        for before, through in ((logging.WARNING, 0), (logging.INFO, 3)):
            fx.setLevel(before)
            passed.clear()
            with probe_time._Bypasses() as seen:
                for _ in range(2):
                    fx.info("Bypassing FX Graph Cache because '%s'", "Unsupported custom pass")
                fx.info("FX graph cache hit for key %s", "abc")
                aot.info("Bypassing autograd cache due to: %s", "no shape env")
            assert seen.reasons == {
                "torch._inductor.codecache: Bypassing FX Graph Cache because "
                "'Unsupported custom pass'": 2,
                "torch._functorch._aot_autograd.autograd_cache: Bypassing autograd cache due "
                "to: no shape env": 1}
            assert len(passed) == through  # fx's own 3 records, where INFO was on before
            assert fx.level == before and seen not in fx.filters and seen not in aot.filters
    finally:
        fx.removeHandler(keep)
        fx.setLevel(level)


def test_probe_time_refuses_bad_input(tmp_path, capsys):
    sys.path.insert(0, str(BENCH))
    import probe_time
    out = str(tmp_path / "x.json")
    for argv, message in ((["--probe-config", "{bad"], "--probe-config: not JSON"),
                          (["--probe-config", "[1]"], "expected a JSON object"),
                          (["--probe-config", '{"num_samples": 0}'], "--probe-config:"),
                          (["--probe-config", '{"nope": 1}'], "--probe-config:"),
                          (["--batch-size", "0"], "must be >= 1"),
                          (["--fresh"], "unrecognized arguments: --fresh"),
                          (["--fresh-caches"], "must be on the command line")):
        with pytest.raises(SystemExit) as e:
            probe_time.main([*argv, "--device", "cpu", "--out", out])
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert probe_time.main(["--model", "nope", "--device", "cpu", "--scale", "tiny",
                            "--out", out]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_aoti_serving_rows_run_the_model_as_a_package(tmp_path, monkeypatch):
    """``--serve-runtime aoti``: the serving row's step calls the AOTInductor package
    (``loka.aot_compile``), recorded as the row's runtime and compile mode; its package's
    output matches the eager model's; the packages are removed when the run ends."""
    import tempfile

    from loka.bench import evalset as lev

    folders = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*a, **k):
        folders.append(real_mkdtemp(*a, **k))
        return folders[-1]
    monkeypatch.setattr(lev.tempfile, "mkdtemp", mkdtemp)
    made = []
    real = lev.aot_compile

    def spy(model, example, path, **kw):
        made.append(os.path.exists(os.path.dirname(path)))
        return real(model, example, path, **kw)
    monkeypatch.setattr(lev, "aot_compile", spy)
    out = tmp_path / "e.json"
    assert _serve_tiny_dlrm(out, "bf16", "--serve-runtime", "aoti") == 0
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["status"] == "ok", row["reason"]
    assert made == [True]
    assert (row["runtime"], row["compile_mode"], row["graphs"]) == ("aoti", "aoti", False)
    # float32 on the CPU: Inductor's fused arithmetic against eager, to rounding
    assert 0 <= row["aot_check"]["rel_err_vs_eager"] < 1e-5
    assert row["aot_compile_s"] > 0 and row["step_ms"] > 0
    assert doc["env"]["serve_runtime"] == "aoti" and doc["summary"][0]["runtime"] == "aoti"
    assert lev.graphs_label(row) == "aoti"
    assert lev.graphs_label(dict(row, graphs=True, graph_capture="step")) == "aoti-s"
    assert lev.graphs_label(dict(row, runtime="compile", graphs=True, graph_capture="step")) \
        == "step"
    # the package's folder went with the run
    mine = [f for f in folders if os.path.basename(f).startswith("loka-aot-")]
    assert len(mine) == 1 and not os.path.exists(mine[0])


def test_the_aoti_runtime_refuses_what_it_cannot_run(tmp_path, capsys):
    from loka.bench import evalset as lev

    out = ["--out", str(tmp_path / "o.json"), "--serve-runtime", "aoti"]
    cases = [(["--backend", "aot_eager"], "compiles with Inductor"),
             (["--device", "cuda"], "add --graph-capture step, or --no-graphs"),
             (["--modes", "train"], "--modes has none")]
    for argv, msg in cases:
        with pytest.raises(SystemExit):
            lev.parse_args(out + argv, BENCH / "evalset")
        assert msg in capsys.readouterr().err
    for argv in (["--device", "cuda", "--no-graphs"],
                 ["--device", "cuda", "--graph-capture", "step"],
                 ["--device", "cuda", "--modes", "train,serve", "--no-graphs"]):
        args, _ = lev.parse_args(out + argv, BENCH / "evalset")
        assert args.serve_runtime == "aoti"
    assert lev.aoti_row(args, "serve") and not lev.aoti_row(args, "train")


def test_an_aoti_row_has_loka_optimize_time_captured_steps_on_a_gpu(probed, monkeypatch):
    """The package runs with little host time per call, so ``loka-optimize`` rows of an
    AOTInductor run judge plans by captured whole steps (a GPU), not by ``torch.compile``'s
    Python-issued steps."""
    from types import SimpleNamespace

    from loka.bench import evalset as lev

    model, batches, report = probed["dlrm"]
    static = loka.plan(report, inference=True, assume_fast=True, static_scales=True)
    case = lev.Case("dlrm", 64, model, batches[0], {}, 0, report=report,
                    plans={"train": static, "serve": static, "static": static})
    seen = []

    class Stop(Exception):
        pass

    def spy(*a, **kw):
        seen.append((kw["capture_steps"], kw["compile_mode"]))
        raise Stop
    monkeypatch.setattr(lev, "optimize_plan", spy)
    for runtime, device, graphs, want in (
            ("aoti", "cuda", False, (True, None)), ("aoti", "cpu", False, (False, None)),
            ("compile", "cuda", False, (False, None)),
            ("compile", "cuda", True, (False, "reduce-overhead"))):
        args = SimpleNamespace(eval_set=SimpleNamespace(loss_fn=loss_fn), serve_runtime=runtime)
        with pytest.raises(Stop):
            lev.convert(copy.deepcopy(model), "loka-optimize-static", "serve", case,
                        torch.device(device), graphs, args=args)
        assert seen[-1] == want, (runtime, device, graphs)
