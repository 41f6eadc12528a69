import copy
import json
import math

import pytest

from loka.config import Role
from loka.probe import (ErrorStat, KernelResult, ProbeReport, ReportError, RoleReport,
                        SiteReport, compare_reports)


def _kr(name, mere, speedup=None, safe=None, error=None, width=0.02):
    stat = None if mere is None else ErrorStat(mere, mere - width / 2, mere + width / 2, 16, 0.01)
    return KernelResult(name, mere=stat, sqnr=None if stat is None else ErrorStat(30.0, 29, 31, 16),
                        relfro=stat, naive_mere=stat, time_us=None if speedup is None else 100 / speedup,
                        speedup=speedup, timing="cuda-graph" if speedup else "none",
                        safe=(error is None and mere is not None and mere + width / 2 < 0.2)
                        if safe is None else safe,
                        fast=bool(speedup and speedup > 1.05), error=error)


def make_report(fp8_error=0.1, rowwise_speed=1.3):
    """Two sites; fwd has a fast safe FP8 kernel, wgrad only bf16 is safe."""
    sites = {}
    for name, scale in (("mlp.0", 1.0), ("mlp.1", 4.0)):
        roles = {
            Role.FWD: RoleReport(Role.FWD, (4096, 256, 512), 100.0, {
                "bf16": _kr("bf16", 0.004, 1.0),
                "cublas-tensorwise": _kr("cublas-tensorwise", fp8_error * scale, 1.5),
                "cublas-rowwise": _kr("cublas-rowwise", 0.05, rowwise_speed),
                "broken": _kr("broken", None, error="RuntimeError: no kernel image")}),
            Role.WGRAD: RoleReport(Role.WGRAD, (512, 4096, 256), 90.0, {
                "bf16": _kr("bf16", 0.005, 1.0),
                "cublas-tensorwise": _kr("cublas-tensorwise", 0.5, 1.6)}),
        }
        sites[name] = SiteReport(name, 256, 512, 4096, "bfloat16",
                                 {"act": {"amax": 3.5, "kurtosis": math.nan}, "note": [1, 2]},
                                 roles)
    return ProbeReport(sites=sites, device="cuda:0", device_name="NVIDIA H200",
                       torch_version="2.11.0", config={"max_error": 0.2},
                       meta={"steps": 300, "inf": math.inf})


def test_round_trip_is_exact(tmp_path):
    rep = make_report()
    path = tmp_path / "r.json"
    rep.save(path)
    again = ProbeReport.load(path)
    assert again.to_dict() == rep.to_dict()
    assert again.sites["mlp.0"].roles[Role.FWD].kernels["broken"].error.startswith("RuntimeError")
    assert again.sites["mlp.0"].stats["act"]["kurtosis"] == "nan"  # stats stay JSON-safe
    assert again.meta["inf"] == "inf" and again.sites["mlp.1"].stats["note"] == [1, 2]
    neg = again.sites["mlp.0"].roles[Role.FWD].kernels["bf16"].metric("neg_sqnr")
    assert (neg.mean, neg.lo, neg.hi) == (-30.0, -31.0, -29.0)
    json.loads(path.read_text())  # strict JSON: nan/inf are encoded as strings


def _mutate(d, path, value):
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value


SITE = ("sites", "mlp.0")
FWD = SITE + ("roles", "fwd")
TWK = FWD + ("kernels", "cublas-tensorwise")
BAD = [
    (SITE + ("in_features",), "256", "in_features: expected an integer"),
    (SITE + ("in_features",), -3, "in_features: expected an integer >= 1"),
    (SITE + ("tokens",), 1.5, "tokens: expected an integer"),
    (SITE + ("tokens",), True, "tokens: expected an integer"),
    (SITE + ("name",), "other", "holds site 'other'"),
    (SITE + ("roles",), [], "roles: expected a JSON object"),
    (SITE + ("stats",), "x", "stats: expected a JSON object"),
    (SITE + ("in_features",), KeyError, "missing field(s) ['in_features']"),
    (FWD + ("shape",), [4096, -1, 512], "shape: expected [M, K, N] of 3 positive integers"),
    (FWD + ("shape",), [4096, 256], "shape: expected [M, K, N]"),
    (FWD + ("shape",), "4096x256x512", "shape: expected [M, K, N]"),
    (FWD + ("role",), "wgrad", "holds role 'wgrad'"),
    (FWD + ("role",), "sideways", "unknown role"),
    (FWD + ("baseline_us",), "fast", "baseline_us: expected a number"),
    (TWK + ("kernel",), "other", "holds kernel 'other'"),
    (TWK + ("safe",), "yes", "safe: expected true or false"),
    (TWK + ("speedup",), [1.5], "speedup: expected a number"),
    (TWK + ("error",), 3, "error: expected a string"),
    (TWK + ("mere", "n"), -1, "mere.n: expected an integer >= 0"),
    (TWK + ("mere", "hi"), "high", "mere.hi: expected a number"),
    (TWK + ("mere",), [0.1], "mere: expected a JSON object"),
    (("sites",), [], "sites: expected a JSON object"),
    (("config",), "fast", "config: expected a JSON object"),
]


@pytest.mark.parametrize("path,value,message", BAD, ids=[m for _, _, m in BAD])
def test_invalid_content_gives_one_line_report_error(tmp_path, path, value, message):
    d = make_report().to_dict()
    _mutate(d, path, value)
    f = tmp_path / "r.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ReportError) as info:
        ProbeReport.load(f)
    text = str(info.value)
    assert message in text and "\n" not in text and str(f) in text


@pytest.mark.parametrize("content,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2, 3]", "not a loka.probe-report file"),
    ('{"schema": "loka.plan", "version": 1}', "not a loka.probe-report file (schema: 'loka.plan')"),
    ('{"schema": "loka.probe-report", "version": 99, "sites": {}}', "version 99 is not supported"),
    ('{"schema": "loka.probe-report", "version": 1}', "missing field(s) ['sites']"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
])
def test_corrupt_or_foreign_files(tmp_path, content, message):
    f = tmp_path / "r.json"
    if isinstance(content, bytes):
        f.write_bytes(content)
    else:
        f.write_text(content)
    with pytest.raises(ReportError) as info:
        ProbeReport.load(f)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        ProbeReport.load("/nonexistent/report.json")


def test_best_kernel_and_summary_table():
    rep = make_report()
    fwd = rep.sites["mlp.0"].roles[Role.FWD]
    assert fwd.best().kernel == "cublas-tensorwise"           # safe and fastest
    assert fwd.best(max_error=0.08).kernel == "cublas-rowwise"  # 0.1 no longer fits
    assert fwd.best(max_error=0.001) is None
    assert rep.sites["mlp.1"].roles[Role.FWD].best().kernel == "cublas-rowwise"  # 0.4: unsafe
    assert rep.sites["mlp.0"].roles[Role.WGRAD].best().kernel == "bf16"
    lines = rep.summary_table().splitlines()
    assert lines[0].split()[:2] == ["site", "M"] and set(lines[1]) <= {"-", " "}
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == 4
    assert rows[0][:4] == ["mlp.0", "4096x256x512", "fwd", "cublas-tensorwise"]
    assert rows[0][4:] == ["0.1", "[0.09,", "0.11]", "1.50x"]
    assert rows[2][3] == "cublas-rowwise" and rows[3][3] == "bf16"
    strict = rep.summary_table(max_error=0.001).splitlines()[2].split()
    assert strict[3:] == ["-", "-", "-"]


def test_geomean_error():
    rep = make_report(fp8_error=0.1)
    assert rep.geomean_error("cublas-tensorwise", role="fwd") == pytest.approx(math.sqrt(0.1 * 0.4))
    assert rep.geomean_error("cublas-tensorwise") == pytest.approx((0.1 * 0.4 * 0.5 * 0.5) ** 0.25)
    assert rep.geomean_error("bf16", role=Role.WGRAD) == pytest.approx(0.005)
    assert rep.geomean_error("cublas-rowwise", metric="relfro") == pytest.approx(0.05)
    with pytest.raises(ValueError, match="no mere"):
        rep.geomean_error("broken")                       # failed everywhere
    with pytest.raises(ValueError, match="no mere in this report for role dgrad"):
        rep.geomean_error("bf16", role="dgrad")
    with pytest.raises(ValueError, match="positive metric"):
        rep.geomean_error("bf16", metric="sqnr")


def test_compare_reports():
    a, b = make_report(fp8_error=0.1), make_report(fp8_error=0.25)
    del b.sites["mlp.1"]
    b.sites["new"] = copy.deepcopy(a.sites["mlp.0"])
    b.sites["new"].name = "new"
    cmp = compare_reports(a, b)
    assert cmp["only_in_a"] == ["mlp.1"] and cmp["only_in_b"] == ["new"]
    roles = {(r["site"], r["role"]): r for r in cmp["roles"]}
    fwd = roles[("mlp.0", "fwd")]
    assert (fwd["best_a"], fwd["best_b"], fwd["changed"]) == ("cublas-tensorwise", "cublas-rowwise", True)
    assert fwd["kernels"]["cublas-tensorwise"]["delta"] == pytest.approx(0.15)
    assert fwd["kernels"]["cublas-tensorwise"]["safe_a"] and not fwd["kernels"]["cublas-tensorwise"]["safe_b"]
    assert fwd["kernels"]["broken"]["delta"] is None
    assert not roles[("mlp.0", "wgrad")]["changed"] and cmp["best_changed"] == 1
    text = compare_reports(a, b, as_text=True)
    assert "cublas-tensorwise -> cublas-rowwise" in text and "(now unsafe)" in text
    assert "only in a: mlp.1" in text
    same = compare_reports(a, a)
    assert same["best_changed"] == 0 and all(
        v["delta"] in (0, None) for r in same["roles"] for v in r["kernels"].values())


# -- reliability (issue 29): hostile files, error bounds that cannot be ------------------------
HOSTILE = [
    (("version",), True, "version True is not supported"),
    (SITE + ("tokens",), 1e999, "sites['mlp.0'].tokens: expected an integer"),
    (SITE + ("tokens",), 2 ** 70, "sites['mlp.0'].tokens: expected an integer"),
    (TWK + ("time_us",), 10 ** 19, None),  # an integer literal is fine when float() holds it
    (TWK + ("mere", "n"), 1e999, "mere.n: expected an integer"),
    (TWK + ("mere", "hi"), -1e308, "mere.hi"),
    (TWK + ("mere", "hi"), "-inf", "mere.hi"),
    (TWK + ("mere", "lo"), 0.9, "mere.lo"),  # lo > hi
    (TWK + ("mere", "mean"), -0.5, "mere.mean"),
    (TWK + ("relfro", "hi"), -1.0, "relfro.hi"),
    (TWK + ("naive_mere", "lo"), 5.0, "naive_mere.lo"),
    (TWK + ("mere", "std"), -1.0, "mere.std"),
    (TWK + ("time_us",), -3.0, "time_us"),
    (TWK + ("speedup",), -1.5, "speedup"),
    (FWD + ("baseline_us",), -1.0, "baseline_us"),
    (TWK + ("timing",), 5, "timing: expected a string"),
    (("device",), "quantum:0", "device"),
    (("device",), 7, "device: expected a string"),
    (("meta",), [1], "meta: expected a JSON object"),
    (("created",), {"a": 1}, "created: expected a string"),
    (("device_name",), ["x"], "device_name: expected a string"),
]


@pytest.mark.parametrize("path,value,message", HOSTILE, ids=[str(m) for _, _, m in HOSTILE])
def test_hostile_fields_give_one_report_error_naming_file_and_field(tmp_path, path, value, message):
    d = make_report().to_dict()
    _mutate(d, path, value)
    f = tmp_path / "r.json"
    f.write_text(json.dumps(d))
    if message is None:
        ProbeReport.load(f)
        return
    with pytest.raises(ReportError) as info:
        ProbeReport.load(f)
    text = str(info.value)
    assert message in text and "\n" not in text and str(f) in text


def test_negative_sqnr_is_a_valid_statistic(tmp_path):
    d = make_report().to_dict()
    d["sites"]["mlp.0"]["roles"]["fwd"]["kernels"]["cublas-tensorwise"]["sqnr"] = {
        "mean": -3.0, "lo": -4.0, "hi": -2.0, "n": 16, "std": 0.5}
    f = tmp_path / "r.json"
    f.write_text(json.dumps(d))
    assert ProbeReport.load(f).sites["mlp.0"].roles[Role.FWD].kernels["cublas-tensorwise"].sqnr.hi == -2.0


def test_failed_kernels_keep_their_nan_statistics(tmp_path):
    rep = make_report()
    kr = rep.sites["mlp.0"].roles[Role.FWD].kernels["cublas-tensorwise"]
    kr.mere = ErrorStat(math.nan, math.nan, math.nan, 16, math.nan)
    kr.relfro = ErrorStat(math.inf, math.inf, math.inf, 16, math.nan)
    rep.save(tmp_path / "r.json")
    again = ProbeReport.load(tmp_path / "r.json")
    assert math.isnan(again.sites["mlp.0"].roles[Role.FWD].kernels["cublas-tensorwise"].mere.hi)


def test_a_normal_interval_may_reach_below_zero(tmp_path):
    # bootstrap_stat(resamples=0) gives mean -/+ 1.96 s/sqrt(n): lo < 0 is honest
    rep = make_report()
    rep.sites["mlp.0"].roles[Role.FWD].kernels["cublas-tensorwise"].mere = ErrorStat(0.01, -0.02, 0.04, 2, 0.03)
    rep.save(tmp_path / "r.json")
    ProbeReport.load(tmp_path / "r.json")


@pytest.mark.parametrize("where", [("meta",), SITE + ("stats",)])
def test_deep_nesting_in_free_form_fields_is_a_report_error(tmp_path, where):
    d = make_report().to_dict()
    _mutate(d, where, "DEEP")
    text = json.dumps(d).replace('"DEEP"', "[" * 100_000 + "]" * 100_000)
    f = tmp_path / "r.json"
    f.write_text(text)
    with pytest.raises(ReportError, match="nested too deeply") as info:
        ProbeReport.load(f)
    assert str(f) in str(info.value)


def test_a_5000_digit_integer_is_a_report_error(tmp_path):
    text = json.dumps(make_report().to_dict()).replace('"tokens": 4096', '"tokens": ' + "9" * 5000)
    f = tmp_path / "r.json"
    f.write_text(text)
    with pytest.raises(ReportError, match="integer") as info:
        ProbeReport.load(f)
    assert str(f) in str(info.value)


def test_a_report_above_the_size_limit_is_refused(tmp_path):
    rep = make_report()
    rep.meta["padding"] = [0.5] * 10_000
    rep.save(tmp_path / "r.json")
    size = (tmp_path / "r.json").stat().st_size
    with pytest.raises(ReportError, match="limit"):
        ProbeReport.load(tmp_path / "r.json", max_bytes=size // 2)
    assert ProbeReport.load(tmp_path / "r.json", max_bytes=size).meta["padding"][0] == 0.5


def test_the_planner_never_sees_an_impossible_bound(tmp_path):
    # issue 29: hi = -1e308 made a kernel that measured 0.326 look safe under a 0.2 budget
    from loka.dispatch import plan
    d = make_report(fp8_error=0.326).to_dict()
    stat = d["sites"]["mlp.0"]["roles"]["fwd"]["kernels"]["cublas-tensorwise"]["mere"]
    stat["hi"] = -1e308
    f = tmp_path / "r.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ReportError, match="mere.hi"):
        plan(str(f), max_error=0.2)
