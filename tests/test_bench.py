"""The benchmark harness (``loka bench``, bench/run_all.py) end to end on the CPU, and the
helpers that turn its output into tables. No time is asserted: CPU timings mean nothing
for FP8 on a GPU; what is checked is that every row is measured, the ratios are the ratios
of the rows, and the plan and report it writes load back."""

import dataclasses
import importlib.util
import json
import math
import os
import types

import pytest
import torch

import loka
from loka import bench
from loka.bench import Variant, baselines, rows, runner
from loka.dispatch import Plan
from loka.probe import ProbeReport
from loka.train import loss_fn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _mods(name):
    return Variant.parse(name).mods_config()


def _names(variants):
    return [v.name for v in variants]


def _cfg(tmp_path, **kw):
    base = dict(model="wukong", preset="tiny", device="cpu", steps=2, warmup=1, compile=False,
                train_variants=["bf16", "bf16+mods", "loka+mods"],
                infer_variants=["bf16", "loka+mods", "loka+mods+merge"],
                out=str(tmp_path / "run.json"),
                plot=False, probe_steps=2, probe_samples=4)
    base.update(kw)
    return bench.BenchConfig(**base)


FIXTURE_KERNELS = ("bf16", "emulated-tensorwise-e4m3", "emulated-rowwise-e4m3")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    # a shortlist without the CPU build's FP8 GEMM (slow here); what is checked here is the
    # harness (test_the_probe_shortlist_defaults_to_the_benchmarks checks the default)
    result = bench.run(_cfg(tmp, probe_kernels=FIXTURE_KERNELS), progress=lambda s: None)
    return tmp, result


def test_cpu_run_measures_every_row_and_writes_plan_and_report(first_run):
    tmp, result = first_run
    assert [r["variant"] for r in result["train"]] == ["bf16", "bf16+mods", "loka+mods"]
    assert [r["variant"] for r in result["infer"]] == ["bf16", "loka+mods", "loka+mods+merge"]
    for row in result["train"] + result["infer"]:
        assert "error" not in row, row.get("traceback")
        assert row["median_ms"] > 0 and row["min_ms"] <= row["median_ms"] <= row["max_ms"]
        assert row["timing"] == "cpu-wallclock"
    for mode in ("train", "infer"):
        rows = {r["variant"]: r for r in result[mode]}
        base = rows["bf16"]["median_ms"]
        assert rows["bf16"]["speedup_vs_bf16"] == 1.0
        for r in rows.values():
            assert r["speedup_vs_bf16"] == pytest.approx(base / r["median_ms"], rel=1e-12)
    train = {r["variant"]: r for r in result["train"]}
    assert train["loka+mods"]["speedup_vs_bf16+mods"] == pytest.approx(
        train["bf16+mods"]["median_ms"] / train["loka+mods"]["median_ms"], rel=1e-12)
    assert math.isfinite(train["loka+mods"]["final_loss"])
    assert train["loka+mods"]["probe_s"] > 0
    # the JSON on disk is the returned result; the plan and the report load and validate
    on_disk = json.load(open(tmp / "run.json"))
    assert [r["variant"] for r in on_disk["train"]] == ["bf16", "bf16+mods", "loka+mods"]
    plan = Plan.load(str(tmp / "run.plan.json"))
    report = ProbeReport.load(str(tmp / "run.report.json"))
    assert set(plan.sites) == set(report.sites)
    assert len(plan.sites) == 11  # Wukong tiny: 4 Linears in each of 2 layers, 2 top, the logit
    assert on_disk["loka_plan"] == plan.to_dict()
    # serving gets a plan of its own from the same report: forward only
    serve = Plan.load(str(tmp / "run.infer-plan.json"))
    assert set(serve.sites) == set(plan.sites) and serve.budget["inference"] is True
    assert all(sp.kernel(r) == "bf16" for sp in serve.sites.values() for r in ("dgrad", "wgrad"))
    assert on_disk["loka_infer_plan"] == serve.to_dict()
    infer = {r["variant"]: r for r in result["infer"]}
    assert infer["loka+mods"]["plan_fwd_fp8_sites"] == len(serve.fp8_sites())
    # the merged model (+merge: sibling Linears in one GEMM) has sites of its own, and
    # plans of its own
    merged = Plan.load(str(tmp / "run.merge.plan.json"))
    assert set(merged.sites) != set(plan.sites) and len(merged.sites) == 9  # 2 x 3 + 3
    assert any(".merged" in s for s in merged.sites)
    assert Plan.load(str(tmp / "run.merge.infer-plan.json")).budget["inference"] is True
    assert on_disk["loka_merge_plan"] == merged.to_dict()
    # the Probe measured the run's shortlist, all of it (each runs on the CPU)
    measured = {k for s in report.sites.values() for rr in s.roles.values() for k in rr.kernels}
    assert measured == set(FIXTURE_KERNELS)
    # each Probe-made plan audited against its report: every site-role it measured
    oracle = on_disk["checks"]["oracle"]
    assert set(oracle) == {"plain/train", "plain/infer", "merge/train", "merge/infer"}
    assert oracle["plain/train"]["site_roles"] == sum(len(s.roles) for s in report.sites.values())
    assert oracle["plain/infer"]["site_roles"] == sum("fwd" in [r.value for r in s.roles]
                                                      for s in report.sites.values())
    # every role of every site but the gradients of the head, which the Probe measures
    # forwards only (ProbeConfig.head_sites: 3, at most a quarter of the 11 sites)
    head = report.meta["head_forwards_only"]
    assert len(head) == 2 and all(n.startswith("over_arch.") for n in head), head
    assert oracle["plain/train"]["site_roles"] == 3 * len(plan.sites) - 2 * 2
    assert all(o["ok"] for o in oracle.values())
    assert on_disk["checks"]["search_gap"] == []  # no +search rows in this run


def test_the_probe_shortlist_defaults_to_the_benchmarks(tmp_path, monkeypatch):
    """Without ``probe_kernels``, the Probe gets the bench's shortlist, less what this
    device lacks (fbgemm and Triton's GPU kernels are absent on the CPU)."""
    from loka.bench import plans
    seen = {}

    class Stop(Exception):
        pass

    def fake_probe(model, batches, loss, config, optimizer):
        seen["kernels"], seen["all"] = config.kernels, config.all_kernels
        raise Stop
    monkeypatch.setattr(plans, "run_probe", fake_probe)
    cfg = _cfg(tmp_path)
    assert cfg.probe_kernels == bench.PROBE_KERNELS
    model = bench.build_model(cfg, _mods("loka+mods"), torch.device("cpu"))
    with pytest.raises(Stop):  # the batch reaches only the (faked) Probe
        plans.probe_and_plan(model, None, cfg, torch.device("cpu"), {})
    on_cpu = {k.name for k in loka.kernels.registry.available(torch.device("cpu"))}
    assert seen["all"] is False
    assert sorted(seen["kernels"]) == sorted(k for k in bench.PROBE_KERNELS if k in on_cpu)
    assert "cublas-tensorwise" in seen["kernels"] and "fbgemm-rowwise" not in seen["kernels"]


def test_checks_compare_each_tuned_row_with_its_search_twin():
    result = {"train": [{"variant": "loka+mods+tuned+graphs", "median_ms": 10.0},
                        {"variant": "loka+mods+search+graphs", "median_ms": 9.6},
                        {"variant": "loka+mods+search", "median_ms": 9.0},  # no tuned twin
                        {"variant": "loka+search", "error": "failed"}],
              "infer": [{"variant": "loka+tuned", "median_ms": 3.0},
                        {"variant": "loka+search", "median_ms": 3.3}]}
    gaps = bench.checks({}, result)["search_gap"]
    assert [(g["mode"], g["search"]) for g in gaps] == [("train", "loka+mods+search+graphs"),
                                                        ("infer", "loka+search")]
    assert gaps[0]["tuned_speed_vs_search"] == pytest.approx(0.96)
    assert gaps[0]["within_3pct"] is False
    assert gaps[1]["tuned_speed_vs_search"] == pytest.approx(1.1) and gaps[1]["within_3pct"]


def test_plan_file_replaces_the_probe(first_run, tmp_path):
    tmp, _ = first_run
    result = bench.run(_cfg(tmp_path, train_variants=["loka+mods"], infer_variants=[],
                            plan=str(tmp / "run.plan.json")), progress=lambda s: None)
    row = result["train"][0]
    assert "error" not in row, row.get("traceback")
    assert row["plan_source"] == str(tmp / "run.plan.json") and "probe_s" not in row
    assert row["report_source"] == str(tmp / "run.report.json")  # loaded beside the plan
    assert not (tmp_path / "run.report.json").exists()  # nothing was probed
    assert Plan.load(str(tmp_path / "run.plan.json")).to_dict() == \
        Plan.load(str(tmp / "run.plan.json")).to_dict()


def test_torchao_rows_are_skipped_with_a_note_when_absent(tmp_path, monkeypatch):
    monkeypatch.setattr(runner.caps, "torchao_available", lambda: False)
    result = bench.run(_cfg(tmp_path, train_variants=["bf16", "torchao-rowwise"],
                            infer_variants=["torchao-tensorwise"]), progress=lambda s: None)
    assert [r["variant"] for r in result["train"]] == ["bf16"] and result["infer"] == []
    assert result["notes"] == ["torchao is not installed: torchao rows skipped"]


def test_a_failing_variant_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    real = bench.build_model

    def broken(cfg, mods, device):
        if mods is not None:
            raise RuntimeError("boom")
        return real(cfg, mods, device)
    monkeypatch.setattr(rows, "build_model", broken)
    result = bench.run(_cfg(tmp_path, train_variants=["bf16+mods", "bf16"], infer_variants=[]),
                       progress=lambda s: None)
    bad, good = result["train"]
    assert bad["error"] == "RuntimeError: boom" and "median_ms" not in bad
    assert good["median_ms"] > 0 and good["speedup_vs_bf16"] == 1.0


def test_tuned_inference_variant_tunes_the_forward_plan(tmp_path):
    assert "loka+mods+merge+tuned+graphs" in bench.TRAIN_VARIANTS
    assert "loka+mods+merge+tuned+graphs" in bench.INFER_VARIANTS
    cfg = _cfg(tmp_path, train_variants=[], infer_variants=["loka+mods+tuned"], steps=1,
               warmup=1, plan=str(tmp_path / "uniform.plan.json"))
    model = bench.build_model(cfg, _mods("loka+mods"), torch.device("cpu"))
    Plan.uniform(model, "emulated-rowwise-e4m3").save(cfg.plan)
    lines = []
    row = bench.run(cfg, progress=lines.append)["infer"][0]
    assert "error" not in row, row.get("traceback")
    tuned = Plan.from_dict(row["tuned_plan"])
    trials = [ln for ln in lines if ln.strip().startswith("trial ")]
    assert len(trials) == len(row["tune_log"])  # every whole-step trial is reported
    assert trials[0].strip().startswith("trial 1: 0 FP8 site(s)")
    assert tuned.budget["speed_tuned"]["trials"] == len(row["tune_log"]) >= 2
    assert row["tune_log"][0]["sites"] == []
    assert row["fp8_sites"] == row["plan_fwd_fp8_sites"] == len(tuned.fp8_sites())
    # served as deployed: the bf16 weights of the FP8 forwards are freed
    assert row["hp_weights_dropped"] == row["fp8_sites"]


def test_named_plans_run_side_by_side(tmp_path):
    cfg = _cfg(tmp_path, train_variants=["loka@all+mods", "loka@none+mods"],
               infer_variants=["loka@all+mods"], steps=1, warmup=1)
    model = bench.build_model(cfg, _mods("loka+mods"), torch.device("cpu"))
    Plan.uniform(model, "emulated-rowwise-e4m3").save(tmp_path / "all.plan.json")
    Plan.uniform(model, "bf16").save(tmp_path / "none.plan.json")
    cfg.plans = {"all": str(tmp_path / "all.plan.json"), "none": str(tmp_path / "none.plan.json")}
    result = bench.run(cfg, progress=lambda s: None)
    (all_, none), (inf,) = result["train"], result["infer"]
    assert all_["fp8_sites"] == len(Plan.load(cfg.plans["all"]).fp8_sites()) > 0
    assert none["fp8_sites"] == 0 and 0 < inf["fp8_sites"] <= all_["fp8_sites"]
    # served as deployed: the bf16 weights of the FP8 forwards are freed
    assert inf["hp_weights_dropped"] == inf["plan_fwd_fp8_sites"] == inf["fp8_sites"]
    assert "graph_breaks" not in all_  # CPU runs are eager
    assert Variant.parse("loka@all+mods+graphs").plan == "all" and Variant.parse("loka+mods").plan == ""
    bad = bench.run(dataclasses.replace(cfg, train_variants=["loka@gone+mods"], infer_variants=[]),
                    progress=lambda s: None)["train"][0]
    assert "plan 'gone'" in bad["error"]
    with pytest.raises(ValueError, match="name=path"):
        bench.named_plans("all")
    assert bench.named_plans("a=x.json, b=y.json") == {"a": "x.json", "b": "y.json"}


def test_named_merged_plan_is_taken_as_given(tmp_path):
    """A +merge variant takes a plan whose name already says .merge as it is; a plain plan
    needs its .merge sibling beside it, and its absence is a clear error."""
    cfg = _cfg(tmp_path, train_variants=["loka@m+mods+merge", "loka@p+mods+merge"],
               infer_variants=[], steps=1, warmup=1)
    model = bench.build_model(cfg, _mods("loka+mods+merge"), torch.device("cpu"))
    Plan.uniform(model, "emulated-rowwise-e4m3").save(tmp_path / "m.merge.plan.json")
    Plan.uniform(model, "bf16").save(tmp_path / "p.plan.json")
    cfg.plans = {"m": str(tmp_path / "m.merge.plan.json"), "p": str(tmp_path / "p.plan.json")}
    merged, plain = bench.run(cfg, progress=lambda s: None)["train"]
    assert "error" not in merged, merged.get("traceback")
    assert merged["fp8_sites"] == len(Plan.load(cfg.plans["m"]).fp8_sites()) > 0
    assert "p.merge.plan.json" in plain["error"]


def test_profile_names_must_be_variants_of_the_run(tmp_path):
    cfg = _cfg(tmp_path, train_variants=["bf16"], infer_variants=["bf16+mods"])
    for ok in (("bf16",), ("train:bf16",), ("infer:bf16+mods",)):
        dataclasses.replace(cfg, profile=ok).check_profile()
    for bad in (("infer:bf16",), ("train:bf16+mods",), ("bf16+graphs",)):
        with pytest.raises(ValueError, match="names no variant"):
            bench.run(dataclasses.replace(cfg, profile=bad), progress=lambda s: None)


def test_unknown_variants_are_refused():
    with pytest.raises(ValueError, match="unknown variant"):
        bench.parse_variants("bf16,warp", bench.TRAIN_VARIANTS, bench.TRAIN_VARIANTS)
    assert bench.parse_variants("none", bench.TRAIN_VARIANTS, bench.TRAIN_VARIANTS) == []
    assert _names(bench.parse_variants("loka-uniform-cublas-rowwise-big+mods", bench.TRAIN_VARIANTS,
                                       bench.TRAIN_VARIANTS)) == ["loka-uniform-cublas-rowwise-big+mods"]


@pytest.mark.parametrize("modifier", bench.MODIFIERS)
def test_every_modifier_parses_to_its_field_and_back(modifier):
    base = "torchao-rowwise" if modifier == "plain-inductor" else "loka"
    name = f"{base}+{modifier}"
    v = Variant.parse(name)
    assert v.modifiers == (modifier,) and getattr(v, modifier.replace("-", "_")) is True
    assert v.name == str(v) == name and Variant.parse(v.name) == v
    others = [m for m in bench.MODIFIERS if m != modifier]
    assert not any(getattr(v, m.replace("-", "_")) for m in others)


@pytest.mark.parametrize("name, fields", [
    ("bf16", dict(base=bench.Base.BF16)),
    ("loka", dict(base=bench.Base.LOKA)),
    ("loka@fast+mods+graphs", dict(base=bench.Base.NAMED, plan="fast", mods=True, graphs=True)),
    ("loka-uniform-cublas-rowwise-big+mods", dict(base=bench.Base.UNIFORM, kernel="cublas-rowwise",
                                                  big_only=True, mods=True)),
    ("loka-uniform-triton-rowwise-cublas", dict(base=bench.Base.UNIFORM,
                                                kernel="triton-rowwise-cublas")),
    ("torchao-rowwise_with_gw_hp-auto+mods", dict(base=bench.Base.TORCHAO,
                                                  recipe="rowwise_with_gw_hp", auto=True, mods=True)),
    ("torchao-tensorwise+mods+plain-inductor", dict(base=bench.Base.TORCHAO, recipe="tensorwise",
                                                    mods=True, plain_inductor=True)),
    ("loka+mods+automerge+search+graphs+token-major+triton-emb+fused-norm+static",
     dict(base=bench.Base.LOKA, mods=True, automerge=True, search=True, graphs=True,
          token_major=True, triton_emb=True, fused_norm=True, static=True)),
])
def test_variant_bases_parse_to_a_typed_spec_and_round_trip(name, fields):
    v = Variant.parse(name)
    assert v == Variant(**fields)
    assert v.name == name and Variant(**fields).name == name


def test_every_listed_variant_round_trips():
    for name in bench.TRAIN_VARIANTS + bench.INFER_VARIANTS:
        assert Variant.parse(name).name == name
    cfg = bench.BenchConfig(train_variants=["loka+mods+merge+tuned+graphs"], infer_variants=[])
    assert cfg.train_variants == [Variant.parse("loka+mods+merge+tuned+graphs")]
    assert cfg.to_dict()["train_variants"] == ["loka+mods+merge+tuned+graphs"]


@pytest.mark.parametrize("name, message", [
    ("bf16+warp", r"unknown modifier \+warp"),
    ("loka+mods+fused", r"unknown modifier \+fused "),
    ("warp", r"the base 'warp'"),
    ("torchao-blockwise", r"torchao recipe 'blockwise'"),
    ("loka@+mods", r"needs a plan name"),
    ("loka-uniform-", r"name a kernel"),
    ("loka+mods+mods", r"\+mods twice"),
    ("loka+graphs+mods", r"out of order, write 'loka\+mods\+graphs'"),
    ("loka+mods+merge+automerge", r"\+merge and \+automerge exclude each other"),
    ("loka+mods+tuned+search", r"\+tuned and \+search exclude each other"),
])
def test_variants_outside_the_grammar_are_refused_in_one_line(name, message):
    with pytest.raises(bench.VariantError, match=message) as info:
        Variant.parse(name)
    assert "\n" not in str(info.value) and name in str(info.value)
    with pytest.raises(ValueError, match=r"unknown variant\(s\)"):
        bench.parse_variants(f"bf16,{name}", bench.TRAIN_VARIANTS, bench.TRAIN_VARIANTS)


def test_variant_fields_the_harness_reads():
    v = Variant.parse("loka@p+mods+merge+tuned+graphs+token-major+fused-norm")
    assert v.applies_plan and v.family == "loka" and v.structure == "merge"
    assert v.whole_step == "tuned" and v.plan == "p"
    assert v.graphs_on(torch.device("cuda")) and not v.graphs_on(torch.device("cpu"))
    mods = v.mods_config()
    assert mods.merge_siblings and mods.token_major and mods.fuse_norm_quant
    assert Variant.parse("bf16").mods_config() is None
    assert not Variant.parse("loka-uniform-k+mods").applies_plan
    assert Variant.parse("torchao-rowwise").family == "torchao"
    assert Variant.parse("loka+mods+automerge+search").structure == "automerge"
    assert Variant.parse("loka+mods+automerge+search").whole_step == "search"
    # what the command line's lists must hold: the variant without its free modifiers
    assert Variant.parse("loka+mods+automerge+tuned+graphs+static").listed().name == "loka+mods+merge+graphs"
    # a listed base with a free modifier is accepted; an unlisted base is not
    assert _names(bench.parse_variants("bf16+mods+triton-emb", bench.INFER_VARIANTS,
                                       bench.INFER_VARIANTS)) == ["bf16+mods+triton-emb"]
    with pytest.raises(ValueError, match=r"unknown variant\(s\) \['torchao-rowwise-auto'\]"):
        bench.parse_variants("torchao-rowwise-auto", bench.INFER_VARIANTS, bench.INFER_VARIANTS)


def test_whole_step_timer_reports_every_field_on_the_cpu():
    from loka.timing import time_steps

    calls = []
    r = time_steps(lambda: calls.append(1), torch.device("cpu"), steps=3, warmup=2)
    assert len(calls) == 5 and r["timing"] == "cpu-wallclock" and r["warmup_s"] >= 0
    assert 0 <= r["min_ms"] <= r["median_ms"] <= r["max_ms"]


def test_uniform_rows_put_one_kernel_on_every_eligible_linear(tmp_path):
    """loka-uniform-<kernel>: every Linear but the logit on the kernel (each role in
    training, the forward served with its weight quantized once); -big keeps the tiny
    model's Linears (all under 1024 wide) on bf16."""
    name = "loka-uniform-emulated-rowwise-e4m3+mods"
    result = bench.run(_cfg(tmp_path, train_variants=[name, "loka-uniform-emulated-rowwise-e4m3-big+mods"],
                            infer_variants=[name], steps=1, warmup=1), progress=lambda s: None)
    (train, big), (infer,) = result["train"], result["infer"]
    assert "error" not in train and "error" not in infer, (train.get("traceback"), infer.get("traceback"))
    model = bench.build_model(_cfg(tmp_path), _mods(name), torch.device("cpu"))
    align = loka.kernels.get("emulated-rowwise-e4m3").align
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    eligible = {n for n, m in linears[:-1] if m.in_features % align == 0 == m.out_features % align}
    assert 0 < len(eligible) < len(linears) - 1  # the tiny model's proj Linears do not align
    assert set(bench.uniform_plan(model, "emulated-rowwise-e4m3").fp8_sites()) == eligible
    assert train["fp8_sites"] == len(eligible)
    assert infer["fp8_sites"] == infer["plan_fwd_fp8_sites"] == infer["hp_weights_dropped"] == len(eligible)
    assert big["fp8_sites"] == 0


@pytest.mark.parametrize("name, cls", [
    ("nvjet_sm90_qqtst_128x128_64x4_1x2_h_bz_coopA_NNT", "gemm-fp8"),
    ("nvjet_sm90_tst_192x128_64x4_2x1_v_bz_coopB_TNN", "gemm"),
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm-fp8"),
    ("void f8f8bf16_rowwise_impl<128, 128>(...)", "gemm-fp8"),
    ("rowwise_quant_kernel", "quantize"),
    ("rowwise_cast_split_kernel", "quantize"),
    ("norm_act_quant_kernel", "quantize"),
    ("rowwise_gemm_kernel", "gemm-fp8"),
    ("void fbgemm_gpu::quantize_fp8_per_row_kernel<...>", "quantize"),
    ("void fbgemm_gpu::fused_quantize_rowwise<__nv_fp8_e4m3, fbgemm_gpu::FP8_E4M3_MAX>", "quantize"),
    ("triton_poi_fused_hardswish_triton_quantize_117", "triton"),
    ("triton_red_fused__scaled_mm__to_copy_abs_amax_clamp_div_hardswish_9", "triton"),
    ("triton_per_fused_abs_amax_clamp_div_0", "triton"),
    ("void at::native::(anonymous namespace)::embedding_bag_nbits_rowwise", "embedding"),
    ("void cub::DeviceRadixSortOnesweepKernel<radix_sort...>", "embedding"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
     "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>", "other"),
])
def test_kernel_classes(name, cls):
    assert bench.kernel_class(name) == cls


def test_benchmarks_md_renders_rows_ratios_and_profile(tmp_path):
    md = _load("make_benchmarks_md")
    result = {
        "env": {"device": "cuda", "gpu": "NVIDIA H200", "date": "2026-12-03T00:00:00",
                "commit": "abc1234", "torch": "2.11.0", "triton": "3.6.0", "torchao": "0.17.0"},
        "config": {"model": "wukong", "preset": "paper", "steps": 20},
        "train": [
            {"variant": "bf16+mods", "median_ms": 10.0, "fp8_sites": 0, "samples_per_s": 409600.0,
             "speedup_vs_bf16+mods": 1.0, "peak_mem_gb": 3.0,
             "profile": {"gpu_us_per_step": 9500.0, "by_class_us": {"gemm": 6000.0, "triton": 2500.0,
                                                                      "optimizer": 1000.0}}},
            {"variant": "loka+mods", "error": "RuntimeError: no GPU"},
        ],
        "infer": [], "notes": ["torchao is not installed: torchao rows skipped"],
        "checks": {"oracle": {"merge/train": {"site_roles": 45, "violations": [], "ok": True}},
                   "search_gap": [{"mode": "train", "tuned": "loka+tuned", "search": "loka+search",
                                   "tuned_ms": 10.0, "search_ms": 9.5,
                                   "tuned_speed_vs_search": 0.95, "within_3pct": False}]}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    text = md.bench_table(str(path))
    assert "| bf16+mods | 0 | 10.000 | 409,600 | - | 1.000 | - | - | 3.00 |" in text
    assert "| loka+mods | failed: RuntimeError: no GPU |" in text
    assert "| bf16+mods | 9.50 | 6.00 | 0.00 | 0.00 | 2.50 | 0.00 | 1.00 | 0.00 |" in text
    assert "- torchao is not installed: torchao rows skipped" in text
    assert ("- plan `merge/train` audited against its Probe report: 45 site-roles, no kernel "
            "within the budget faster than the one chosen") in text
    assert ("- train: `loka+tuned` 10.000 ms against the exhaustive search `loka+search` 9.500 ms: "
            "0.950 of its speed (not within 3%)") in text


def test_quality_summary_pairs_arms_by_seed(tmp_path):
    q = _load("quality_at_scale")
    runs = [{"arm": "bf16+mods", "seed": 0, "final": {"ne": 0.80, "auc": 0.70}},
            {"arm": "loka+mods", "seed": 0, "final": {"ne": 0.8008, "auc": 0.70}},
            {"arm": "bf16+mods", "seed": 1, "final": {"ne": 0.82, "auc": 0.72}},
            {"arm": "loka+mods", "seed": 1, "final": {"ne": 0.82, "auc": 0.72}}]
    s = q.summarize(runs)
    assert s["bf16+mods"]["ne_mean"] == pytest.approx(0.81)
    assert s["bf16+mods"]["ne_std"] == pytest.approx(0.0141421356, rel=1e-6)
    assert s["paired_ne_change_pct"]["per_seed"] == pytest.approx([0.1, 0.0])
    assert s["paired_ne_change_pct"]["mean"] == pytest.approx(0.05)
    assert s["seed_noise_pct"] == pytest.approx(100 * 0.0141421356 / 0.81, rel=1e-6)
    md = _load("make_benchmarks_md")
    path = tmp_path / "quality.json"
    path.write_text(json.dumps({"schema": "loka.quality", "env": {"device": "cpu", "commit": "abc"},
                                "config": {"model": "wukong", "preset": "small", "steps": 600},
                                "runs": runs[::-1], "summary": s}))
    text = md.render(str(path))
    assert "wukong `small` on cpu, 600 steps, 2 seed(s), commit abc" in text
    assert "| bf16+mods | 0.80000, 0.82000 | 0.81000 ± 0.01414 | 0.71000 |" in text
    assert "+0.100%, +0.000%; mean +0.050% ± 0.071%; seed noise of bf16 + Mods 1.746%" in text


def test_tuned_variant_times_whole_steps_and_keeps_the_model_it_started_from(tmp_path):
    cfg = _cfg(tmp_path, train_variants=["loka+mods+tuned"], infer_variants=[], steps=1,
               warmup=1, plan=str(tmp_path / "uniform.plan.json"))
    model = bench.build_model(cfg, _mods("loka+mods"), torch.device("cpu"))
    Plan.uniform(model, "emulated-rowwise-e4m3").save(cfg.plan)  # FP8 on every Linear
    result = bench.run(cfg, progress=lambda s: None)
    row = result["train"][0]
    assert "error" not in row, row.get("traceback")
    log = row["tune_log"]
    assert len(log) >= 2 and log[0]["sites"] == [] and all(e["time"] > 0 for e in log)
    tuned = Plan.from_dict(row["tuned_plan"])
    info = tuned.budget["speed_tuned"]
    assert info["trials"] == len(log) and info["baseline_time"] == log[0]["time"]
    assert set(tuned.fp8_sites()) <= set(Plan.load(cfg.plan).fp8_sites())
    assert len(log) > 2 and any(e["removed"] for e in log)  # groups were tried
    assert row["fp8_sites"] == len(tuned.fp8_sites())
    assert math.isfinite(row["final_loss"])


def test_op_breakdown_attributes_kernel_time_to_the_outermost_aten_op():
    from types import SimpleNamespace as NS

    k = lambda us: NS(duration=us)  # noqa: E731
    clone = NS(name="aten::clone", cpu_parent=NS(name="CompiledFunction", cpu_parent=None))
    copy = NS(name="aten::copy_", cpu_parent=clone, kernels=[k(30.0), k(10.0)],
              stack=["torch/_tensor.py(1): x", "/work/loka/dispatch/linear.py(171): backward"])
    mm = NS(name="aten::mm", cpu_parent=None, kernels=[k(100.0)], stack=[])
    idle = NS(name="aten::view", cpu_parent=None, kernels=[], stack=[])
    rows = bench.op_breakdown([copy, mm, idle, copy], steps=2)
    assert rows == [["aten::mm", "", 50.0],
                    ["aten::clone", "/work/loka/dispatch/linear.py(171): backward", 40.0]]


def test_search_variant_times_every_candidate_and_skips_unavailable_kernels(tmp_path, monkeypatch):
    from loka.config import LinearConfig

    # on the CPU: the emulated kernel runs, the CUDA-only one is skipped
    monkeypatch.setitem(bench.SEARCH_CANDIDATES, False,
                        ("emulated-rowwise-e4m3", LinearConfig(fwd="cublas-rowwise-fastacc")))
    cfg = _cfg(tmp_path, train_variants=["loka+mods+search"], infer_variants=[], steps=1,
               warmup=1, plan=str(tmp_path / "base.plan.json"))
    model = bench.build_model(cfg, _mods("loka+mods"), torch.device("cpu"))
    Plan.uniform(model, "bf16").save(cfg.plan)
    row = bench.run(cfg, progress=lambda s: None)["train"][0]
    assert "error" not in row, row.get("traceback")
    timed = [e for e in row["search_log"] if "time" in e]
    assert timed[0]["candidate"] is None  # the baseline first
    tried = {tuple(sorted(e["candidate"].items())) for e in timed[1:] if e["candidate"]}
    assert tried == {tuple(sorted(LinearConfig.uniform("emulated-rowwise-e4m3").to_dict().items()))}
    found = Plan.from_dict(row["search_plan"])
    assert found.budget["speed_searched"]["trials"] == len(timed)
    assert row["fp8_sites"] == len(found.fp8_sites())


def test_batch_size_sweep_runs_every_size_and_summarizes(tmp_path):
    cfg = _cfg(tmp_path, train_variants=["bf16", "bf16+mods"], infer_variants=["bf16"], steps=1,
               warmup=1, out=str(tmp_path / "sweep.json"), plot=True)
    sweep = bench.run_sweep(cfg, [32, 64], progress=lambda s: None)
    assert sweep["out"] == str(tmp_path / "sweep.json")
    assert set(sweep["runs"]) == {"32", "64"}
    for b in ("32", "64"):
        run = json.load(open(sweep["runs"][b]))
        assert run["config"]["batch_size"] == int(b)
        mods = sweep["train"]["bf16+mods"][b]
        row = next(r for r in run["train"] if r["variant"] == "bf16+mods")
        assert mods["median_ms"] == row["median_ms"] > 0
        assert mods["speedup_vs_bf16"] == pytest.approx(
            sweep["train"]["bf16"][b]["median_ms"] / mods["median_ms"])
    on_disk = json.load(open(tmp_path / "sweep.json"))
    assert on_disk["schema"] == "loka.bench-sweep" and on_disk["batch_sizes"] == [32, 64]
    text = _load("make_benchmarks_md").render(str(tmp_path / "sweep.json"))
    ms = sweep["train"]["bf16+mods"]["64"]["median_ms"]
    assert "| batch 32 | batch 64 |" in text and f"{ms:.3f} (1.000)" in text
    with pytest.raises(ValueError, match="positive"):
        bench.run_sweep(cfg, [])
    if importlib.util.find_spec("matplotlib") is not None:
        assert sweep["chart"] == str(tmp_path / "sweep.png")
        assert open(sweep["chart"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
        # inference ran bf16 alone: no speedup against bf16 + Mods there, so against bf16
        infer_only = {"train": {}, "infer": {"bf16": {"32": {"speedup_vs_bf16": 1.0}}}}
        assert bench.plot_sweep(infer_only, str(tmp_path / "i.png")) == str(tmp_path / "i.png")
        with pytest.raises(ValueError, match="nothing to plot"):
            bench.plot_sweep({"train": {}, "infer": {}}, str(tmp_path / "none.png"))


def test_source_digest_names_the_code_that_ran(tmp_path, monkeypatch):
    here = bench.source_digest()
    assert len(here) == 12 and here == bench.source_digest()  # deterministic
    assert bench.environment(torch.device("cpu"))["source_sha1"] == here
    # a copy of the package with one changed byte has another digest
    import shutil
    pkg = tmp_path / "loka"
    shutil.copytree(os.path.dirname(loka.__file__), pkg,
                    ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(bench.env, "PACKAGE_ROOT", str(pkg))
    assert bench.source_digest() == here
    (pkg / "config.py").write_text((pkg / "config.py").read_text() + "\n# changed\n")
    assert bench.source_digest() != here


def test_automerge_variant_merges_where_the_timing_says_so(tmp_path, monkeypatch):
    from loka.mods import shapes

    calls = []
    real = shapes.merge_pays

    def scripted(tokens, **kw):  # per role: apart 10 us, then merged 5 us: every group merges
        calls.append(kw.get("roles"))
        n = [0]

        def timer(fn):
            n[0] += 1
            return 10.0 if n[0] % 2 else 5.0
        return real(tokens, timer=timer, **kw)

    monkeypatch.setattr("loka.bench.models.merge_pays", scripted)
    # (the Probe of the loka row measures two kernels: the merge decisions are the test)
    cfg = _cfg(tmp_path, train_variants=["bf16+mods+automerge", "loka+mods+automerge"],
               infer_variants=["bf16+mods+automerge"], steps=1, warmup=1,
               probe_kernels=("bf16", "emulated-rowwise-e4m3"))
    result = bench.run(cfg, progress=lambda s: None)
    for row in result["train"] + result["infer"]:
        assert "error" not in row, row.get("traceback")
        assert row["automerge"]["merged"] == ["layers.0.fmb.proj", "layers.0.lcb.proj",
                                              "layers.1.fmb.proj", "layers.1.lcb.proj"]
        d = row["automerge"]["decisions"][0]
        # Wukong tiny: the n-axis Linears see B x d = 256 x 16 rows
        assert d["merge"] and d["tokens"] == 256 * 16 and d["merged_us"] == d["apart_us"] / 2
    assert calls == [("fwd", "dgrad", "wgrad")] * 2 + [("fwd",)]
    assert "layers.0.merged.linear" in Plan.from_dict(result["loka_automerge_plan"]).sites



def test_benchmarks_md_renders_a_kernel_sweep(tmp_path):
    md = _load("make_benchmarks_md")
    case = {"label": "wukong fm_mlp.1", "role": "fwd", "shape": [4096, 2048, 8192], "bf16_us": 177.6,
            "kernels": {}}
    sweep = {"device": "NVIDIA H200", "torch": "2.11.0", "seconds": 12.0, "timing": "compiled",
             "cases": [case], "unmeasured": [{"label": "grid"}],
             "winners": [{"label": "wukong fm_mlp.1", "role": "fwd", "shape": [4096, 2048, 8192],
                          "winner": "triton-rowwise-cublas-fastacc", "winner_speedup": 1.41,
                          "by_library": {"torchao": {"kernel": "torchao-rowwise-fastacc", "speedup": 1.24},
                                         "triton": {"kernel": "triton-rowwise-cublas-fastacc",
                                                    "speedup": 1.41}}}],
             "library_wins": {"triton": 1},
             "targets": {"wukong_fused_rowwise_vs_torchao_best": [
                 {"case": "wukong fm_mlp.1 fwd", "loka_vs_torchao": 1.14}],
                 "4096^3": {"bf16_us": 174.6, "weight_quantized_once": {
                     "kernel": "k", "us": 115.2, "speedup": 1.516, "target": 1.5, "met": True},
                     "both_quantized": {"kernel": "k", "us": 128.5, "speedup": 1.358}}}}
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(sweep))
    text = md.render(str(path))
    assert "1 cases measured in 12 s, 1 not reached" in text
    assert ("| wukong fm_mlp.1 | fwd | 4096, 2048, 8192 | 177.6 | triton-rowwise-cublas-fastacc | 1.41 | "
            "torchao 1.24 (`torchao-rowwise-fastacc`), triton 1.41 (`triton-rowwise-cublas-fastacc`) |") in text
    assert "at least as fast in 1 of 1 (wukong fm_mlp.1 fwd 1.14x)" in text
    assert "`k` 115.2 us = 1.52x (target 1.5: met)" in text and "`k` 128.5 us = 1.36x" in text


def test_torchao_gw_hp_auto_uses_the_rowwise_filter_and_says_so(monkeypatch):
    """The row's conversion goes through LoKA's torchao adapter, which stands in the rowwise
    filter for rowwise_with_gw_hp; the row says so. The adapter is faked here (torchao may
    be absent); the next test runs the real one on a faked torchao."""
    calls = {}

    def convert_torchao(model, recipe, auto_filter=False, device=None, skip_fqns=(),
                        skip_last=False):
        calls.update(recipe=recipe, auto=auto_filter, skip_last=skip_last)
        return []

    adapter = types.SimpleNamespace(convert_torchao=convert_torchao,
                                    AUTO_FILTER_STAND_IN={"rowwise_with_gw_hp": "rowwise"})
    # the deferred adapters load first (the harness loads them before it looks), so that
    # the fake below is what the harness finds and the real one is back afterwards
    loka.kernels.adapters.load()
    monkeypatch.setattr(loka.kernels.adapters, "torchao", adapter, raising=False)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1))
    cuda = torch.device("cuda")
    note = baselines.torchao_training(model, "rowwise_with_gw_hp", auto=True, device=cuda)
    assert calls == {"recipe": "rowwise_with_gw_hp", "auto": True, "skip_last": True}
    assert note == "torchao has no auto filter for rowwise_with_gw_hp: its rowwise filter chose the Linears"
    assert baselines.torchao_training(model, "rowwise", auto=True, device=cuda) is None


def test_torchao_adapter_gives_gw_hp_the_rowwise_filter_and_skips_the_logit(monkeypatch):
    pytest.importorskip("torchao.float8", reason="torchao is not installed")
    import torchao.float8

    from loka.kernels.adapters import torchao as adapter

    calls = {}

    def auto_filter(recipe, filter_fqns):
        if recipe == "rowwise_with_gw_hp":
            raise NotImplementedError("Unsupported recipe")  # as torchao 0.17
        calls["filter"] = (recipe, list(filter_fqns))
        return lambda mod, fqn: False

    class Config:
        @staticmethod
        def from_recipe_name(name):
            calls["recipe"] = name
            return name

    def convert(model, config, module_filter_fn):
        calls["converted"] = config

    monkeypatch.setattr(torchao.float8, "_auto_filter_for_recipe", auto_filter)
    monkeypatch.setattr(adapter, "Float8LinearConfig", Config)
    monkeypatch.setattr(adapter, "convert_to_float8_training", convert)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1))
    note = baselines.torchao_training(model, "rowwise_with_gw_hp", auto=True,
                                      device=torch.device("cuda"))
    assert calls == {"recipe": "rowwise_with_gw_hp", "filter": ("rowwise", ["1"]),
                     "converted": "rowwise_with_gw_hp"}
    assert note == "torchao has no auto filter for rowwise_with_gw_hp: its rowwise filter chose the Linears"
    assert baselines.torchao_training(model, "rowwise", auto=True, device=torch.device("cuda")) is None


def test_quality_schedule_and_optimizer_groups():
    from types import SimpleNamespace as NS

    q = _load("quality_at_scale")
    args = NS(warmup=10, schedule="cosine", steps=110, min_lr_ratio=0.1)
    f = [q.lr_factor(i, args) for i in range(110)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warm-up
    assert f[10] == pytest.approx(1.0) and f[60] == pytest.approx(0.55)  # half-way down
    assert f[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # monotone after the warm-up
    assert q.lr_factor(50, NS(warmup=0, schedule="constant", steps=100, min_lr_ratio=0.1)) == 1.0
    cfg = bench.BenchConfig(model="wukong", preset="tiny", device="cpu", table_rows=100)
    model = bench.build_model(cfg, _mods("loka+mods"), torch.device("cpu"))
    opt = q.make_optimizer(model, NS(lr=1e-3, emb_lr=1e-2, weight_decay=0.01), torch.device("cpu"))
    dense, emb = opt.param_groups
    assert (dense["lr"], emb["lr"]) == (1e-3, 1e-2) and emb["base_lr"] == 1e-2
    n_emb = sum(p.numel() for m in model.modules() if q._is_embedding(m) for p in m.parameters())
    assert n_emb > 0 and sum(p.numel() for p in emb["params"]) == n_emb
    assert len(dense["params"]) + len(emb["params"]) == len(list(model.parameters()))
    # the cached-batch path reads the features bench.build_model builds, without a model
    spec = q._spec_holder(NS(model="wukong", preset="tiny", table_rows=100)).feature_spec
    assert spec == model.feature_spec and max(t.num_embeddings for t in spec.tables) <= 100


def test_kernel_sweep_measures_supported_kernels_and_summarizes_on_cpu():
    bk = _load("bench_kernels")
    cpu = torch.device("cpu")
    kernels = [loka.kernels.get("emulated-rowwise-e4m3"), loka.kernels.get("emulated-tensorwise-e4m3")]
    caller = bk.Caller(cpu, compiled=True)
    assert not any(caller.is_compiled(k) for k in kernels)  # only cuBLAS/torchao, on CUDA
    case = bk.measure({"label": "wukong x", "role": "wgrad", "shape": [48, 64, 32]}, kernels, cpu,
                      budget_ms=1.0, caller=caller)
    assert case["bf16_us"] > 0 and set(case["kernels"]) == {k.name for k in kernels}
    for rec in case["kernels"].values():
        assert rec["us"] > 0 and rec["speedup"] == pytest.approx(case["bf16_us"] / rec["us"])
        assert 0 < rec["mere"] < 0.2 and "weight_q_us" not in rec  # no weight-q off the forward
    fwd = bk.measure({"label": "target", "role": "fwd", "shape": [32, 64, 48]}, kernels[:1], cpu,
                     budget_ms=1.0)
    assert fwd["kernels"]["emulated-rowwise-e4m3"]["weight_q_us"] > 0
    rows, wins = bk.summarize([case, fwd])
    assert [r["label"] for r in rows] == ["wukong x", "target"] and sum(wins.values()) == 2
    assert len(bk.grid_shapes(False)) == 26 and all(m * k * n <= 2 ** 40 for m, k, n in bk.grid_shapes(False))


def test_a_run_cut_short_keeps_its_rows_and_checks_on_disk(tmp_path):
    class Cut(BaseException):  # what a stage timeout's signal does to the process, in effect
        pass

    def progress(line):
        if line.startswith("[infer]"):
            raise Cut()

    cfg = _cfg(tmp_path, train_variants=["bf16", "bf16+mods"], infer_variants=["bf16"], steps=1,
               warmup=1, out=str(tmp_path / "cut.json"))
    with pytest.raises(Cut):
        bench.run(cfg, progress=progress)
    on_disk = json.load(open(tmp_path / "cut.json"))
    assert [r["variant"] for r in on_disk["train"]] == ["bf16", "bf16+mods"]
    assert on_disk["infer"] == [] and on_disk["checks"] == {"oracle": {}, "search_gap": []}


def test_fused_norm_result_summarizes_rows():
    fb = _load("bench_fused_norm")
    rows = [{"granularity": "rowwise", "speedup_vs_norm_compiled+quant_triton": 2.0,
             "fp8_only_speedup_vs_norm_compiled+quant_triton": 2.5,
             "fp8_bytes_equal_quantize_of_output": True, "scales_equal": True},
            {"granularity": "tensorwise", "speedup_vs_norm_compiled+quant_triton": 0.5,
             "fp8_bytes_equal_quantize_of_output": True, "scales_equal": False}]
    s = fb.result(rows, "NVIDIA H200")["summary"]
    assert s["min_speedup_vs_separate_quant"] == 0.5
    assert s["geomean_speedup_vs_separate_quant"] == pytest.approx(1.0)
    assert s["fp8_only_rowwise_speedups_vs_separate_quant"] == [2.5]
    assert s["all_numerics_exact"] is False


def test_fused_norm_with_linear_times_both_routes_on_the_cpu():
    """The producer + Linear pair of bench_fused_norm runs on any device (here the CPU, the
    emulated kernel, a small M): both routes give the same output, in both modes."""
    fb = _load("bench_fused_norm")
    torch._dynamo.reset()
    r = fb.bench_with_linear("norm_act", 64, 512, "blocknorm", "hardswish",
                             "emulated-rowwise-e4m3", torch.device("cpu"), budget_ms=5)
    assert r["N"] == fb.CONSUMERS["norm_act"] == 2048
    for mode in ("train", "serve"):
        row = r[mode]
        assert row["max_abs_diff_vs_eager"] == 0.0  # the FP8 tensor the Linear would make
        assert row["unfused_us"] > 0 and row["fused_us"] > 0 and row["speedup"] > 0


def test_fused_norm_table_shows_each_producer_with_its_linear(tmp_path):
    """make_benchmarks_md renders the --with-linear pairs of a fused-norm run (a row without
    a serving pair shows dashes), and no such table where no row has one."""
    fb, md = _load("bench_fused_norm"), _load("make_benchmarks_md")
    times = {c: {"us": 10.0} for c in ("fused", "fused_fp8_only", "norm_compiled+quant_triton",
                                       "inductor_fused", "norm_compiled_only", "eager")}
    base = {"case": "top_norm", "M": 4096, "D": 16384, "granularity": "rowwise",
            "times": times, "speedup_vs_norm_compiled+quant_triton": 1.8,
            "fp8_only_speedup_vs_norm_compiled+quant_triton": 2.47,
            "fp8_bytes_equal_quantize_of_output": True, "scales_equal": True}
    pair = {"kernel": "k1", "N": 2048,
            "train": {"unfused_us": 363.4, "fused_us": 293.5, "speedup": 1.238},
            "serve": {"unfused_us": 363.1, "fused_us": 271.8, "speedup": 1.336}}
    rows = [dict(base, with_linear=pair),
            dict(base, case="fmb_act", with_linear={"kernel": "k1", "N": 8192,
                                                     "train": pair["train"]})]
    path = tmp_path / "fused.json"
    path.write_text(json.dumps(fb.result(rows, "NVIDIA H200")))
    text = md.render(str(path))
    assert "forward on `k1`" in text
    assert "| top_norm | rowwise | 2048 | 363.4 | 293.5 | 1.24x | 363.1 | 271.8 | 1.34x |" in text
    assert "| fmb_act | rowwise | 8192 | 363.4 | 293.5 | 1.24x | - | - | - |" in text
    path.write_text(json.dumps(fb.result([base], "NVIDIA H200")))
    assert "forward on" not in md.render(str(path))


def test_fp8_site_count_sees_torchao_inference_weights():
    """torchao's inference quantization leaves nn.Linear in place with a quantized weight
    tensor (AffineQuantizedTensor: ``tensor_impl``; 0.17's Float8Tensor: ``qdata``): each
    counts as an FP8 site, a plain Linear does not."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16),
                                torch.nn.Linear(16, 1))
    assert bench.count_fp8(model) == 0
    model[0].weight.qdata = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    model[1].weight.tensor_impl = object()
    assert bench.count_fp8(model) == 2


def test_chart_has_a_panel_per_measured_mode_against_the_first_baseline(tmp_path):
    """An inference-only run charts inference alone (no empty training panel); a run
    without plain bf16 charts against bf16 + Mods; a run with nothing to chart says so."""
    env = {"device": "cpu", "date": "2026-12-03T00:00:00"}
    cfg = {"model": "wukong", "preset": "tiny"}
    infer = [{"variant": "bf16", "speedup_vs_bf16": 1.0},
             {"variant": "loka+mods", "speedup_vs_bf16": 1.3}]
    train = [{"variant": "bf16+mods", "speedup_vs_bf16+mods": 1.0},
             {"variant": "loka+mods", "speedup_vs_bf16+mods": 1.1},
             {"variant": "torchao-rowwise+mods", "error": "RuntimeError: no"}]
    only_infer = {"env": env, "config": cfg, "train": [], "infer": infer}
    assert [(m, ref, [r["variant"] for r in rows])
            for m, ref, rows in bench.plot_panels(only_infer)] == [
        ("infer", "bf16", ["bf16", "loka+mods"])]
    both = {"env": env, "config": cfg, "train": train, "infer": infer}
    assert [(m, ref, len(rows)) for m, ref, rows in bench.plot_panels(both)] == [
        ("train", "bf16+mods", 2), ("infer", "bf16", 2)]
    with pytest.raises(ValueError, match="nothing to plot"):
        bench.plot({"env": env, "config": cfg, "train": train[2:], "infer": []},
                   str(tmp_path / "none.png"))
    if importlib.util.find_spec("matplotlib") is not None:
        path = bench.plot(both, str(tmp_path / "both.png"))
        assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_row_that_changes_inductor_settings_is_undone_and_recorded(tmp_path, monkeypatch):
    """torchao's quantize_ switches Inductor options on for the whole process: a row may
    change them, but the next row compiles under the settings the run started with."""
    import torch._inductor.config as inductor_config

    before = inductor_config.coordinate_descent_tuning
    precision = torch.get_float32_matmul_precision()
    seen = {}
    real = runner.run_train_variant

    def spy(variant, cfg, device, shared):
        name = variant.name
        seen[name] = inductor_config.coordinate_descent_tuning
        if name == "bf16+mods":  # as torchao's recommended_inductor_config_setter does
            inductor_config.coordinate_descent_tuning = not before
            torch.set_float32_matmul_precision("medium")
        return real(variant, cfg, device, shared)
    monkeypatch.setattr(runner, "run_train_variant", spy)
    result = bench.run(_cfg(tmp_path, train_variants=["bf16+mods", "bf16"], infer_variants=[],
                            steps=1, warmup=1), progress=lambda s: None)
    first, second = result["train"]
    assert seen == {"bf16+mods": before, "bf16": before}
    assert first["inductor_changed"] == {"coordinate_descent_tuning": not before,
                                         "float32_matmul_precision": "medium"}
    assert "inductor_changed" not in second
    assert inductor_config.coordinate_descent_tuning == before
    assert torch.get_float32_matmul_precision() == precision


def test_plain_inductor_torchao_inference_keeps_torchao_off_inductor(monkeypatch):
    import sys
    import types

    made = []

    class Config:
        def __init__(self, granularity, set_inductor_config):
            made.append((type(granularity).__name__, set_inductor_config))
    quant = types.SimpleNamespace(Float8DynamicActivationFloat8WeightConfig=Config,
                                  PerRow=type("PerRow", (), {}), PerTensor=type("PerTensor", (), {}),
                                  quantize_=lambda model, config, filter_fn: None)
    monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))
    monkeypatch.setitem(sys.modules, "torchao.quantization", quant)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    baselines.torchao_inference(model, "rowwise")
    baselines.torchao_inference(model, "tensorwise", set_inductor_config=False)
    assert made == [("PerRow", True), ("PerTensor", False)]
    names = _names(bench.parse_variants("torchao-rowwise+mods+plain-inductor", bench.INFER_VARIANTS,
                                        bench.INFER_VARIANTS))
    assert names == ["torchao-rowwise+mods+plain-inductor"]
    with pytest.raises(ValueError, match="unknown variant"):
        bench.parse_variants("bf16+plain-inductor+warp", bench.INFER_VARIANTS, bench.INFER_VARIANTS)


def test_contiguous_input_hook_copies_a_strided_input_only():
    x = torch.arange(24.0).reshape(2, 3, 4).transpose(1, 2)  # strided, as Wukong's FM input
    (y,) = baselines.contiguous_input(None, (x,))
    assert y.is_contiguous() and not x.is_contiguous() and torch.equal(y, x)
    z = torch.ones(3, 4)
    assert baselines.contiguous_input(None, (z, 1))[0] is z  # no copy when already contiguous


def test_triton_emb_variant_switches_the_fused_tables_to_triton_pooling(tmp_path, monkeypatch):
    from loka.models.fused_embedding import FusedEmbeddingArch

    seen = []
    real = rows.set_pooling

    def spy(model, variant):
        n = real(model, variant)
        seen.append((variant.name, n, sorted({m.pooling for m in model.modules()
                                      if isinstance(m, FusedEmbeddingArch)})))
        return n
    monkeypatch.setattr(rows, "set_pooling", spy)
    names = bench.parse_variants("bf16+mods+triton-emb,bf16+mods", bench.TRAIN_VARIANTS,
                            bench.TRAIN_VARIANTS)
    result = bench.run(_cfg(tmp_path, train_variants=names, infer_variants=["bf16+triton-emb"],
                            steps=1, warmup=1), progress=lambda s: None)
    assert seen == [("bf16+mods+triton-emb", 1, ["triton"]), ("bf16+mods", 0, ["torch"]),
                    ("bf16+triton-emb", 1, ["triton"])]
    # on a CPU without Triton's interpreter the tables pool with torch: same numbers
    assert all("error" not in r for r in result["train"] + result["infer"])
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="fused embedding tables"):
        bench.set_pooling(model, Variant.parse("bf16+triton-emb"))


def test_quality_named_arms_pair_each_with_the_bf16_arm(tmp_path):
    q = _load("quality_at_scale")
    arms = ("bf16+mods", "loka@fm+mods", "loka@top+mods")
    runs = [{"arm": a, "seed": s, "final": {"ne": ne, "auc": 0.7}}
            for s, nes in enumerate([(0.80, 0.8008, 0.80), (0.82, 0.82, 0.8282)])
            for a, ne in zip(arms, nes)]
    s = q.summarize(runs, arms)
    assert s["paired_by_arm"]["loka@fm+mods"]["per_seed"] == pytest.approx([0.1, 0.0])
    assert s["paired_by_arm"]["loka@top+mods"]["per_seed"] == pytest.approx([0.0, 1.0])
    assert s["paired_ne_change_pct"] == s["paired_by_arm"]["loka@fm+mods"]
    md = _load("make_benchmarks_md")
    path = tmp_path / "quality.json"
    path.write_text(json.dumps({"schema": "loka.quality", "env": {"device": "cpu", "commit": "abc"},
                                "config": {"model": "wukong", "preset": "small", "steps": 600},
                                "arms": list(arms), "runs": runs, "summary": s}))
    text = md.render(str(path))
    assert "600 steps, 2 seed(s)" in text
    assert "| loka@top+mods | 0.80000, 0.82820 | 0.81410 ± 0.01994 | 0.70000 |" in text
    assert "paired NE change (`loka@top+mods` against bf16 + Mods, same seed): +0.000%, +1.000%" in text


def _run_quality_harness(tmp_path, flag: str, steps: int, eval_steps: int) -> dict:
    """The quality harness on the CPU (tiny Wukong, two seeds) with two plans of the tiny
    model given to ``flag``: ``all`` (every role on emulated rowwise e4m3) and ``none``
    (bf16)."""
    q = _load("quality_at_scale")
    cfg = bench.BenchConfig(model="wukong", preset="tiny", device="cpu", table_rows=100)
    model = bench.build_model(cfg, q._mods(types.SimpleNamespace(merge=False)), torch.device("cpu"))
    Plan.uniform(model, "emulated-rowwise-e4m3").save(tmp_path / "all.plan.json")
    Plan.uniform(model, "bf16").save(tmp_path / "none.plan.json")
    out = tmp_path / "q.json"
    assert q.main(["--device", "cpu", "--preset", "tiny", "--steps", str(steps), "--seeds", "2",
                   "--eval-steps", str(eval_steps), "--eval-every", "0", "--table-rows", "100",
                   flag, f"all={tmp_path / 'all.plan.json'},none={tmp_path / 'none.plan.json'}",
                   "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_quality_harness_runs_named_plans_side_by_side(tmp_path):
    """The harness end to end on the CPU (tiny Wukong, a few steps): one bf16 arm and one
    arm per named plan, each applying its own plan."""
    r = _run_quality_harness(tmp_path, "--plans", steps=4, eval_steps=2)
    assert r["arms"] == ["bf16+mods", "loka@all+mods", "loka@none+mods"] and r["plan"] is None
    fp8 = {(x["arm"], x["seed"]): x["fp8_sites"] for x in r["runs"]}
    assert fp8[("bf16+mods", 1)] == 0 and fp8[("loka@none+mods", 1)] == 0
    assert fp8[("loka@all+mods", 0)] == len(Plan.load(tmp_path / "all.plan.json").fp8_sites()) > 0
    none = r["summary"]["paired_by_arm"]["loka@none+mods"]["per_seed"]
    assert none == pytest.approx([0.0, 0.0], abs=1e-9)  # a bf16 plan changes nothing
    # a later run adds seeds: --first-seed 1 reproduces the seed-1 runs of this one
    q = _load("quality_at_scale")
    later = tmp_path / "later.json"
    assert q.main(["--device", "cpu", "--preset", "tiny", "--steps", "4", "--seeds", "1",
                   "--first-seed", "1", "--eval-steps", "2", "--eval-every", "0",
                   "--table-rows", "100", "--plans", f"all={tmp_path / 'all.plan.json'}",
                   "--out", str(later)]) == 0
    again = {x["arm"]: x for x in json.loads(later.read_text())["runs"]}
    assert {x["seed"] for x in again.values()} == {1}
    for arm in ("bf16+mods", "loka@all+mods"):
        first = next(x for x in r["runs"] if x["arm"] == arm and x["seed"] == 1)
        assert again[arm]["final"]["ne"] == first["final"]["ne"]


def test_quality_harness_serves_the_trained_model_with_plans(tmp_path):
    """--serve-plans: each seed's trained bf16 + Mods model is evaluated again as served by
    each plan. A bf16 plan serves the very same function (NE change 0); an FP8 plan moves
    NE a little, not a lot, and its sites run in FP8."""
    r = _run_quality_harness(tmp_path, "--serve-plans", steps=30, eval_steps=4)
    assert r["arms"] == ["bf16+mods"] and r["plan"] is None  # serving alone: no LoKA arm
    assert sorted(r["serve_plans"]) == ["all", "none"]
    n_fp8 = len(Plan.load(tmp_path / "all.plan.json").fp8_sites())
    for run in r["runs"]:
        assert run["served"]["none"]["ne"] == pytest.approx(run["final"]["ne"], rel=1e-12)
        assert run["served"]["none"]["fp8_sites"] == 0
        assert 0 < run["served"]["all"]["fp8_sites"] <= n_fp8  # forwards that serve in FP8
        assert run["served"]["all"]["ne"] != run["final"]["ne"]
    change = r["summary"]["served_ne_change_pct"]
    assert change["none"]["per_seed"] == pytest.approx([0.0, 0.0], abs=1e-9)
    assert len(change["all"]["per_seed"]) == 2 and abs(change["all"]["mean"]) < 2.0
    text = _load("make_benchmarks_md").render(str(tmp_path / "q.json"))
    assert "served with plan `all`" in text and "served with plan `none`" in text


def test_token_major_variants_build_the_token_major_model():
    assert _mods("bf16+mods+merge+token-major").token_major
    assert _mods("bf16+mods+merge+token-major").merge_siblings
    assert not _mods("bf16+mods").token_major
    names = _names(bench.parse_variants("loka+mods+merge+tuned+graphs+token-major",
                                        bench.TRAIN_VARIANTS, bench.TRAIN_VARIANTS))
    assert names == ["loka+mods+merge+tuned+graphs+token-major"]


def test_fused_norm_variants_switch_the_fusion_on():
    mods = _mods("loka+mods+merge+tuned+graphs+token-major+fused-norm")
    assert mods.fuse_norm_quant and mods.token_major and mods.merge_siblings
    assert not _mods("loka+mods+merge+tuned+graphs").fuse_norm_quant
    name = "loka+mods+merge+tuned+graphs+token-major+triton-emb+fused-norm"
    assert _names(bench.parse_variants(name, bench.TRAIN_VARIANTS, bench.TRAIN_VARIANTS)) == [name]
    with pytest.raises(ValueError, match="unknown variant"):
        bench.parse_variants("loka+fused", bench.TRAIN_VARIANTS, bench.TRAIN_VARIANTS)


def test_compiled_rows_record_where_compilation_time_went(tmp_path):
    torch._dynamo.reset()
    result = bench.run(_cfg(tmp_path, train_variants=[], infer_variants=["bf16+mods"], steps=1,
                            warmup=1, compile=True), progress=lambda s: None)
    row = result["infer"][0]
    assert "error" not in row, row.get("traceback")
    assert row["graph_breaks"] == 0 and row["compiled_graphs"] >= 1
    phases = row["compile_phases_s"]
    assert 0 < len(phases) <= 8 and all(v >= 0 for v in phases.values())
    assert any("compile" in k for k in phases)  # Dynamo/Inductor phases, by name


def test_static_variant_sets_the_probes_amax_where_the_kernel_takes_one(tmp_path, monkeypatch):
    import loka.dispatch
    from loka.dispatch import amax_from_report
    from loka.config import ProbeConfig
    from loka.probe import probe

    cfg = _cfg(tmp_path, train_variants=[], infer_variants=["loka+mods+static", "loka+mods"],
               steps=1, warmup=1, plan=str(tmp_path / "uniform.plan.json"))
    model = bench.build_model(cfg, _mods("loka+mods"), torch.device("cpu"))
    batch = bench.make_batch(model, cfg, torch.device("cpu"))
    report = probe(model, [batch] * 2, loss_fn,
                   config=ProbeConfig(num_samples=2, bootstrap=10, timing=False,
                                      kernels=("bf16", "emulated-rowwise-e4m3"), progress=False))
    report.save(tmp_path / "uniform.report.json")
    plan = Plan.uniform(model, "emulated-rowwise-e4m3")
    plan.save(cfg.plan)
    static = bench.static_scales(plan, report)
    assert static and set(static) <= set(plan.fp8_sites())
    assert static == {s: a for s, a in amax_from_report(report).items() if s in static}
    # the serving plan the run makes from the report (CPU timings decide nothing): FP8 forwards
    monkeypatch.setattr(loka.dispatch, "plan", lambda report, **kw: plan)
    result = bench.run(cfg, progress=lambda s: None)
    fixed, dynamic = result["infer"]
    assert "error" not in fixed, fixed.get("traceback")
    assert fixed["static_sites"] == len(static) and "static_sites" not in dynamic
    # the Probe saw these very batches: static scales from their amax change little
    assert 0 < fixed["static_logit_change"] < 0.1
    with pytest.raises(ValueError, match="Probe's statistics"):
        bench.static_scales(plan, None)


@pytest.mark.parametrize("kernel, roles", [("cublas-rowwise", ("fwd",)),
                                           ("cublas-tensorwise", ("fwd", "dgrad"))])
def test_selftest_training_step_matches_the_emulated_twin(kernel, roles, monkeypatch):
    """The GPU self-test's training-path check, run on the CPU kernels: a compiled training
    step on a kernel agrees with its emulated twin in eager mode, and the check fails when
    the twin's rounding is not the kernel's (the other scaling granularity)."""
    st = _load("gpu_selftest")
    torch._dynamo.reset()
    r = st.linear_vs_twin(kernel, roles, device="cpu", m=64, k=128, n=256)
    assert r["ok"], r
    assert r["twin"] == st.emulated_twin(loka.kernels.get(kernel))
    # on the CPU the kernel's GEMM is exact over FP8 codes, as the twin's is: the same
    # function up to summation order and bf16 rounding of the outputs (a twin of the other
    # granularity is ~0.035 away)
    assert max(r["relfro_y_vs_twin"], r["relfro_dx_vs_twin"], r["relfro_dw_vs_twin"]) < 1e-3
    monkeypatch.setattr(st, "emulated_twin", lambda k: "emulated-rowwise-e4m3"
                        if k.scaling == "tensorwise" else "emulated-tensorwise-e4m3")
    bad = st.linear_vs_twin(kernel, roles, device="cpu", m=64, k=128, n=256, compile=False)
    assert not bad["ok"] and bad["relfro_y_vs_twin"] > 5e-3


def test_grad_noise_separates_a_plan_from_the_models_own_rounding(tmp_path):
    """bench/grad_noise.py: against float64, the float32 model's gradients are exact to
    float32 rounding, a bf16 plan adds nothing, and an FP8 plan adds its rounding."""
    g = _load("grad_noise")
    cfg = bench.BenchConfig(model="wukong", preset="tiny", device="cpu", table_rows=100)
    model = bench.build_model(cfg, loka.ModsConfig.paper(), torch.device("cpu"))
    Plan.uniform(model, "emulated-rowwise-e4m3").save(tmp_path / "fp8.plan.json")
    Plan.uniform(model, "bf16").save(tmp_path / "none.plan.json")
    out = tmp_path / "g.json"
    assert g.main(["--preset", "tiny", "--plans",
                   f"fp8={tmp_path / 'fp8.plan.json'},none={tmp_path / 'none.plan.json'}",
                   "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    s = r["summary"]
    assert r["dtype"] == "float32" and s["model"]["max"] < 1e-4
    assert r["per_parameter"]["none"] == r["per_parameter"]["model"]
    assert 5e-3 < s["fp8"]["median"] < 0.2  # FP8's rounding, not a broken gradient
    assert set(r["per_parameter"]["fp8"]) == set(dict(model.named_parameters()))
    with pytest.raises(SystemExit):  # --plans is required
        g.main(["--preset", "tiny"])


def test_peak_memory_counts_the_graph_capture():
    """A step replayed from a CUDA graph reports the larger of the replay peak and the
    capture peak (the replays' activations live in the graph's pool, unseen by the
    allocator's peak); a plain step reports its own peak."""
    from loka.bench import peak_memory_gb

    class Graphed:
        capture_peak_bytes = 3 * 2 ** 30

    assert peak_memory_gb(2 ** 30) == 1.0
    assert peak_memory_gb(2 ** 30, object()) == 1.0
    assert peak_memory_gb(2 ** 29, Graphed()) == 3.0
    assert peak_memory_gb(5 * 2 ** 30, Graphed()) == 5.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_graphed_step_peak_includes_activations():
    """On a GPU: an MLP whose activations (8192 x 8192 floats, 256 MiB per layer) dwarf its
    weights; the graphed step's reported peak must hold at least one layer's activation,
    and be within 2x of the eager step's peak."""
    from loka.bench.steps import GraphedStep, capture_peak, peak_memory_gb

    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = torch.nn.Sequential(torch.nn.Linear(64, 8192), torch.nn.ReLU(),
                                torch.nn.Linear(8192, 1)).to(dev)
    x = torch.randn(8192, 64, device=dev)
    opt = torch.optim.AdamW(model.parameters(), capturable=True)

    def eager():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    eager()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    eager()
    torch.cuda.synchronize()
    eager_peak = torch.cuda.max_memory_allocated() / 2 ** 30
    step = GraphedStep.__new__(GraphedStep)  # only its capture_peak_bytes is used
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with capture_peak(step):
        with torch.cuda.graph(graph):
            model(x).square().mean().backward()
            opt.step()
    torch.cuda.reset_peak_memory_stats()
    graph.replay()
    torch.cuda.synchronize()
    replay_only = torch.cuda.max_memory_allocated() / 2 ** 30
    reported = peak_memory_gb(torch.cuda.max_memory_allocated(), step)
    activation = 8192 * 8192 * 4 / 2 ** 30
    assert reported >= activation, (reported, replay_only, eager_peak)
    assert reported <= 2.0 * eager_peak + 0.1, (reported, eager_peak)


def _quality_json(path, runs, lr=1e-3, commit="c0", plans=None):
    cfg = {"model": "wukong", "preset": "paper", "steps": 2500, "eval_steps": 50,
           "batch_size": None, "table_rows": 100, "lr": lr, "emb_lr": 1e-2,
           "weight_decay": 0.01, "warmup": 200, "schedule": "cosine", "min_lr_ratio": 0.1,
           "merge": True}
    with open(path, "w") as f:
        json.dump({"schema": "loka.quality", "version": 1, "env": {"commit": commit},
                   "config": cfg, "plans": plans or {},
                   "runs": [{"arm": a, "seed": s, "final": {"ne": ne},
                             "fp8_sites": 0 if a == "bf16+mods" else 5}
                            for a, s, ne in runs]}, f)
    return str(path)


def test_quality_pool_pools_arms_across_runs(tmp_path, capsys):
    pool = _load("quality_pool")
    a = _quality_json(tmp_path / "a.json", [("bf16+mods", 0, 0.80), ("loka@x+mods", 0, 0.82),
                                            ("bf16+mods", 1, 0.81), ("loka@x+mods", 1, 0.83)])
    # the same bf16 run again, 1e-6 off (counted once), one new seed per arm, a NaN run
    b = _quality_json(tmp_path / "b.json", [("bf16+mods", 0, 0.800001), ("bf16+mods", 2, 0.79),
                                            ("loka@x+mods", 2, 0.84),
                                            ("loka@x+mods", 3, float("nan"))])
    out = tmp_path / "pooled.json"
    assert pool.main([a, b, "--out", str(out)]) == 0
    s = json.load(open(out))["summary"]
    base, x = s["arms"]["bf16+mods"], s["arms"]["loka@x+mods"]
    assert base["n"] == 3 and x["n"] == 3
    assert base["ne_mean"] == pytest.approx(0.80, abs=1e-12)
    assert x["ne_mean"] == pytest.approx(0.83, abs=1e-12)
    assert x["change_pct"] == pytest.approx(100 * (0.83 / 0.80 - 1), abs=1e-9)
    # every FP8 run above every bf16 run: of the 20 relabellings only the two extreme ones
    # give a gap this large
    assert x["p_value"] == pytest.approx(2 / 20)
    assert s["arms"]["fp8"]["n"] == 3
    assert s["seed_noise_pct"] == pytest.approx(100 * 0.01 / 0.80, rel=1e-9)
    assert "change +3.75%" in capsys.readouterr().out
    # paired within a file: x against the bf16 run of its seed in its own file
    pr = s["paired"]["loka@x+mods"]
    want = [100 * (0.82 / 0.80 - 1), 100 * (0.83 / 0.81 - 1), 100 * (0.84 / 0.79 - 1)]
    assert pr["n"] == 3 and pr["changes_pct"] == pytest.approx(want, abs=1e-9)
    assert pr["mean_pct"] == pytest.approx(sum(want) / 3, abs=1e-9)
    # all three changes positive: of the 8 sign patterns only all-plus and all-minus reach
    assert pr["p_sign_flip"] == pytest.approx(2 / 8)
    assert "bf16+mods" not in s["paired"]


def test_quality_pool_joins_arms_by_plan_content(tmp_path, capsys):
    """Arms that ran an equal plan pool whatever their name; one name over two different
    plans is split."""
    pool = _load("quality_pool")
    p1, p2 = {"sites": {"a": "fp8"}}, {"sites": {"a": "bf16"}}
    a = _quality_json(tmp_path / "a.json", [("bf16+mods", 0, 0.80), ("loka@x+mods", 0, 0.82)],
                      plans={"loka@x+mods": p1})
    b = _quality_json(tmp_path / "b.json", [("bf16+mods", 1, 0.81), ("loka@y+mods", 1, 0.84),
                                            ("loka@x+mods", 1, 0.90)],
                      plans={"loka@y+mods": dict(p1), "loka@x+mods": p2})
    out = tmp_path / "pooled.json"
    assert pool.main([a, b, "--out", str(out)]) == 0
    r = json.load(open(out))
    arms = r["summary"]["arms"]
    assert arms["loka@x+mods"]["n"] == 2
    assert arms["loka@x+mods"]["ne_mean"] == pytest.approx(0.83, abs=1e-12)
    split = [k for k in arms if k.startswith("loka@x+mods~")]
    assert len(split) == 1 and arms[split[0]]["ne_mean"] == pytest.approx(0.90, abs=1e-12)
    assert "loka@y+mods" not in arms
    assert r["aliases"] == {f"{b}:loka@y+mods": "loka@x+mods", f"{b}:loka@x+mods": split[0]}
    assert "ran the plan of loka@x+mods" in capsys.readouterr().out
    text = _load("make_benchmarks_md").render(str(out))
    assert "| loka@x+mods | 2 | 0.83000 |" in text
    assert f"`{b}:loka@y+mods` ran the same plan as `loka@x+mods`" in text
    assert "| loka@x+mods | 2 | +2.50%, +3.70% | +3.10% |" in text  # 0.82/0.80, 0.84/0.81


def test_quality_pool_refuses_mixed_configs_and_bad_files(tmp_path, capsys):
    pool = _load("quality_pool")
    a = _quality_json(tmp_path / "a.json", [("bf16+mods", 0, 0.80), ("loka@x+mods", 0, 0.82)])
    b = _quality_json(tmp_path / "b.json", [("bf16+mods", 1, 0.80)], lr=2e-3)
    assert pool.main([a, b]) == 2
    assert "different training configuration" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert pool.main([a, str(bad)]) == 2
    assert "not a readable quality JSON" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "loka.bench", "runs": []}))
    assert pool.main([str(other)]) == 2
    only_fp8 = _quality_json(tmp_path / "c.json", [("loka@x+mods", 0, 0.82)])
    assert pool.main([only_fp8]) == 2
    assert "no bf16+mods runs" in capsys.readouterr().err


def test_quality_harness_jitter_control_arm(tmp_path):
    """--jitter: a bf16 + Mods arm from perturbed weights. Its runs differ from the bf16
    arm's (the perturbation reached the model) but hold no FP8 site, its NE change is
    reported as the yardstick and not as the LoKA arm's, and a bad scale is refused."""
    q = _load("quality_at_scale")
    out = tmp_path / "q.json"
    assert q.main(["--device", "cpu", "--preset", "tiny", "--steps", "6", "--seeds", "2",
                   "--eval-steps", "2", "--eval-every", "0", "--table-rows", "100",
                   "--plans", "none=" + str(_bf16_plan(tmp_path)), "--jitter", str(2 ** -9),
                   "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["arms"] == ["bf16+mods", "bf16+mods+jitter", "loka@none+mods"]
    ne = {(x["arm"], x["seed"]): x["final"]["ne"] for x in r["runs"]}
    for seed in (0, 1):
        assert ne[("bf16+mods+jitter", seed)] != ne[("bf16+mods", seed)]
        # a rounding-size change moves a 6-step tiny run only a little
        assert abs(ne[("bf16+mods+jitter", seed)] / ne[("bf16+mods", seed)] - 1) < 0.02
        assert ne[("loka@none+mods", seed)] == pytest.approx(ne[("bf16+mods", seed)], rel=1e-12)
    s = r["summary"]
    assert s["jitter_ne_change_pct"] == s["paired_by_arm"]["bf16+mods+jitter"]
    assert s["paired_ne_change_pct"] == s["paired_by_arm"]["loka@none+mods"]
    assert all(x["fp8_sites"] == 0 for x in r["runs"] if x["arm"] == "bf16+mods+jitter")
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            q.main(["--device", "cpu", "--preset", "tiny", "--jitter", bad])


def test_jitter_perturbs_every_weight_by_the_scale():
    """Relative changes of spread ``scale`` and mean ~0, the same for the same seed (every
    arm and device perturbs alike), different for another seed; no scale, no jitter."""
    q = _load("quality_at_scale")
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).to(torch.float64)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    q.jitter_(model, 1e-3, seed=3)
    rel = model.weight.detach() / before["weight"] - 1.0
    assert rel.std().item() == pytest.approx(1e-3, rel=0.02)  # 65536 draws
    assert abs(rel.mean().item()) < 3e-5
    assert not torch.equal(model.bias, before["bias"])
    first = model.weight.detach().clone()
    for seed, same in ((3, True), (4, False)):
        model.load_state_dict(before)
        q.jitter_(model, 1e-3, seed=seed)
        assert torch.equal(model.weight, first) == same
    for bad in (0.0, -1e-3, float("nan")):
        with pytest.raises(ValueError, match="positive finite"):
            q.jitter_(model, bad, seed=3)


def _bf16_plan(tmp_path):
    q = _load("quality_at_scale")
    cfg = bench.BenchConfig(model="wukong", preset="tiny", device="cpu", table_rows=100)
    model = bench.build_model(cfg, q._mods(types.SimpleNamespace(merge=False)),
                              torch.device("cpu"))
    path = tmp_path / "none.plan.json"
    Plan.uniform(model, "bf16").save(path)
    return path


def test_twin_derivation_against_a_reports_timings(tmp_path):
    """bench/twin_derivation.py: the twin's call less its GEMM plus the kernel's GEMM,
    against the kernel's own time; site-roles missing a time are left out."""
    td = _load("twin_derivation")
    k = {"cublas-rowwise": {"time_us": 100.0, "time_us_gemm": 60.0},
         "cublas-rowwise-fastacc": {"time_us": 90.0, "time_us_gemm": 48.0}}
    report = {"sites": {"a": {"roles": {"fwd": {"kernels": k},
                                        "dgrad": {"kernels": {"cublas-rowwise": {
                                            "time_us": 5.0, "time_us_gemm": None}}}}}}}
    pairs = td.derive(report)
    row = pairs["cublas-rowwise-fastacc"]
    assert row["cases"] == 1 and row["rows"][0]["derived_us"] == 88.0
    assert row["median_abs_rel_err"] == pytest.approx(2 / 90)
    assert pairs["torchao-rowwise-fastacc"]["cases"] == 0
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert td.main([str(path), "--out", str(tmp_path / "o.json")]) == 0
    assert json.loads((tmp_path / "o.json").read_text())["pairs"]["cublas-rowwise-fastacc"][
        "rows"][0]["derived_us"] == 88.0


def test_adam_restart_script_pairs_continued_and_fresh_optimizers(tmp_path):
    """bench/adam_restart.py: a start checkpoint, then per seed one arm continuing its AdamW
    states and one with a fresh AdamW, scored on the same examples; strict JSON."""
    script = _load("adam_restart")
    out = tmp_path / "ar.json"
    assert script.main(["--models", "wukong:tiny", "--batch-size", "32", "--start-steps", "4",
                        "--steps", "3", "--warmup-steps", "2", "--eval-batches", "2",
                        "--eval-batch", "64", "--seeds", "0", "--out", str(out)]) == 0
    row = json.loads(out.read_text())["models"]["wukong:tiny"]
    assert len(row["start"]["losses"]) == 4 and 0 < row["start"]["ne"] < 10
    arms = {a["optimizer"]: a for a in row["arms"]}
    assert set(arms) == {"continued", "fresh"}
    # same weights and batches: the first loss is the same, the updates are not
    assert arms["continued"]["losses"][0] == arms["fresh"]["losses"][0]
    assert arms["continued"]["losses"][1:] != arms["fresh"]["losses"][1:]
    assert arms["continued"]["ne"] != arms["fresh"]["ne"]
    with pytest.raises(SystemExit):
        script.main(["--steps", "0", "--out", str(out)])


def test_profile_plan_derives_family_and_drop_rows_from_the_first_plan(tmp_path):
    """bench/profile_plan.py's rows: the baseline, each named plan, each --family (every
    FP8 role of the first plan on one kernel) and each --drop (the matching sites back on
    the baseline); a derivation without a plan, a bad LABEL=PATH and a regex that matches
    no site stop with one line."""
    import argparse

    from loka.config import ROLES, LinearConfig
    from loka.dispatch.schema import RoleChoice, SitePlan
    pp = _load("profile_plan")
    path = tmp_path / "plan.json"
    kernels = {"a.proj": ("cublas-rowwise",) * 3,
               "b.mlp": ("cublas-rowwise", "bf16", "triton-rowwise"),
               "c.head": ("bf16", "bf16", "tf32")}
    sites = {}
    for name, ks in kernels.items():
        sites[name] = SitePlan(name, 64, 32, 128)
        for role, k in zip(ROLES, ks):
            sites[name].roles[role] = RoleChoice(k, None, None, None, 0.2, "test")
    plan = Plan(sites=sites, device="cuda")
    plan.save(path)
    args = argparse.Namespace(plan=[f"p={path}"], family=["cublas-tensorwise"], drop=["proj"])
    rows = pp.plans_from(args)
    assert [label for label, _ in rows] == ["baseline", "p", "family cublas-tensorwise",
                                             "drop /proj/ (1 sites)"]
    assert rows[0][1] is None
    fam, drop = rows[2][1], rows[3][1]
    assert fam.config("b.mlp") == LinearConfig("cublas-tensorwise", "bf16", "cublas-tensorwise")
    assert fam.config("c.head") == LinearConfig("bf16", "bf16", "tf32")  # not FP8: kept
    assert drop.fp8_sites() == ["b.mlp"]
    assert drop.config("b.mlp") == plan.config("b.mlp")
    for bad, message in [(argparse.Namespace(plan=[], family=["cublas-tensorwise"], drop=[]),
                          "derive from the first --plan"),
                         (argparse.Namespace(plan=[str(path)], family=[], drop=[]),
                          "give LABEL=PATH"),
                         (argparse.Namespace(plan=[f"p={path}"], family=[], drop=["nope"]),
                          "matches no site")]:
        with pytest.raises(SystemExit, match=message):
            pp.plans_from(bad)
    assert pp._graphs("0") == [False] and pp._graphs("0,1") == [False, True]
    for bad in ("2", "0,0", "", "yes"):
        with pytest.raises(argparse.ArgumentTypeError):
            pp._graphs(bad)


def test_host_self_us_sums_cpu_events_per_step_and_leaves_out_the_skipped():
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    from loka.bench.profiling import host_self_us
    events = [E(key="aten::mm", device_type=DeviceType.CPU, self_cpu_time_total=30.0),
              E(key="aten::mm", device_type=DeviceType.CPU, self_cpu_time_total=6.0),
              E(key="ProfilerStep#1", device_type=DeviceType.CPU, self_cpu_time_total=90.0),
              E(key="gemm_kernel", device_type=DeviceType.CUDA, self_cpu_time_total=50.0),
              E(key="aten::view", device_type=DeviceType.CPU, self_cpu_time_total=0.0)]
    assert host_self_us(events, 3) == {"aten::mm": 12.0, "ProfilerStep#1": 30.0}
    assert host_self_us(events, 3, skip=("ProfilerStep",)) == {"aten::mm": 12.0}


def test_serve_static_quality_pairs_every_arm_with_the_float32_model(tmp_path):
    """bench/serve_static_quality.py on a tiny Wukong: every arm's NE change is paired with
    the float32 model (a real interval around it), static arms set scales at the FP8 sites,
    a wider margin saturates no more, and an unlearned seed is kept out of the summary."""
    ssq = _load("serve_static_quality")
    out = tmp_path / "ssq.json"
    assert ssq.main(["--models", "wukong:tiny", "--seeds", "0", "--steps", "10",
                     "--eval-batches", "2", "--eval-batch", "128", "--batch-size", "64",
                     "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    run = doc["models"]["wukong:tiny"]["seeds"][0]
    assert set(run["arms"]) == {"dynamic", "static x1", "static x2"}
    for name, arm in run["arms"].items():
        lo, hi = arm["interval"]
        assert lo <= arm["rel_ne_change"] <= hi and lo < hi
        assert abs(arm["rel_ne_change"]) < 0.05  # FP8 serving of a tiny model: small
        assert arm["static_sites"] == (0 if name == "dynamic" else run["fp8_sites"]) > -1
    assert run["fp8_sites"] > 0
    assert run["arms"]["static x2"]["saturation_max"] <= run["arms"]["static x1"]["saturation_max"]
    summary = doc["models"]["wukong:tiny"]["summary"]
    assert summary["seeds_learned"] == ([0] if run["ne_fp32"] < 1 else [])
    strict = tmp_path / "strict.json"
    ssq.main(["--models", "wukong:tiny", "--seeds", "0", "--steps", "2", "--eval-batches", "1",
              "--eval-batch", "512", "--batch-size", "64", "--margins", "1",
              "--max-baseline-ne", "0", "--out", str(strict)])
    s = json.loads(strict.read_text())["models"]["wukong:tiny"]["summary"]
    assert s["seeds_learned"] == [] and s["seeds_not_learned"] == [0] and "dynamic" not in s
