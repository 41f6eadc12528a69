"""The plan as data (loka/dispatch/schema.py): JSON round trips, one-line errors for bad
files, the summary, report-free uniform plans."""

import json
import math

import pytest
from torch import nn

from loka.config import LinearConfig, Role
from loka.dispatch import Plan, plan
from loka.jsonio import ReportError
from loka.kernels.registry import get

pytestmark = pytest.mark.usefixtures("fake_kernels")


def test_json_round_trip(tmp_path, make_report, three):
    report = make_report({"a.b": (64, 64, 128, {r: three for r in Role}),
                          "c": (48, 1, 100, {"fwd": three})})
    p = plan(report, role_budgets={Role.WGRAD: 0.06}, site_budgets={"^c": 0.2})
    p.sites["c"].roles[Role.FWD].error = math.inf  # inf survives JSON as a string
    p.record_fallback("a.b", 17, "non-finite output")
    path = tmp_path / "plan.json"
    p.save(path)
    text = path.read_text()
    data = json.loads(text)
    assert data["schema"] == "loka.plan" and data["version"] == 1
    assert data["sites"]["a.b"]["roles"]["wgrad"]["kernel"] == "bf16"
    assert data["budget"]["role_budgets"] == {"wgrad": 0.06}
    q = Plan.load(path)
    assert q.to_dict() == p.to_dict()
    assert q.sites["c"].roles[Role.FWD].error == math.inf
    assert q.fallbacks[0].site == "a.b" and q.fallbacks[0].step == 17
    assert q.fallbacks[0].previous == {"fwd": "t-mid", "dgrad": "t-mid", "wgrad": "t-slow-exact"}
    assert q.config("a.b") == LinearConfig.uniform("bf16")
    assert "pickle" not in text


@pytest.mark.parametrize("content, match", [
    ("{not json", "not valid JSON"),
    (json.dumps({"schema": "loka.probe-report", "version": 1, "sites": {}}), "not a loka.plan"),
    (json.dumps([1, 2]), "not a loka.plan"),
    (json.dumps({"schema": "loka.plan", "version": 2, "sites": {}}), "version 2 is not supported"),
    (json.dumps({"schema": "loka.plan", "version": 1}), "missing field"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {"name": "a"}}}),
     "missing field"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {
        "name": "a", "in_features": 4, "out_features": 4, "tokens": 1,
        "roles": {"fwd": {"kernel": 3}}}}}), "kernel must be a name"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {
        "name": "a", "in_features": -4, "out_features": 4, "tokens": 1, "roles": {}}}}),
     r"sites\['a'\].in_features: expected an integer >= 0"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {
        "name": "b", "in_features": 4, "out_features": 4, "tokens": 1, "roles": {}}}}),
     "holds site"),
    (json.dumps({"schema": "loka.plan", "version": 1, "sites": {"a": {
        "name": "a", "in_features": 4, "out_features": 4, "tokens": 1,
        "roles": {"bwd": {"kernel": "bf16"}}}}}), "unknown role"),
])
def test_load_rejects_bad_files_with_one_line_errors(tmp_path, content, match):
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(ReportError, match=match) as info:
        Plan.load(path)
    assert "\n" not in str(info.value)


def test_summary_and_fp8_sites(make_report, three):
    report = make_report({"enc.0": (64, 64, 128, {r: three for r in Role}),
                          "logit": (64, 64, 128, {"fwd": {"t-mid": (0.9, 2.0)}})})
    p = plan(report)
    assert p.fp8_sites() == ["enc.0"]
    text = p.summary()
    assert "enc.0" in text and "logit" in text and "t-mid (e<=0.15, 1.40x)" in text
    assert "1/2 sites with FP8 (mere <= 0.2, speedup >= 1.05)" in text
    assert "uniform: fwd=cublas-rowwise" in Plan.uniform(nn.Linear(64, 64), "cublas-rowwise").summary()


def test_uniform_plan_falls_back_per_role_where_the_kernel_cannot_run():
    # (torch 2.11's build has no rowwise _scaled_mm on the CPU: its emulated twin)
    rw = "cublas-rowwise" if get("cublas-rowwise").device_ok("cpu") else "emulated-rowwise-e4m3"
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    p = Plan.uniform(model, rw)
    assert p.config("0") == LinearConfig.uniform(rw)
    assert p.config("2") == LinearConfig("bf16", "bf16", rw)
    assert p.fp8_sites() == ["0", "2"]
    assert Plan.uniform(model, rw, module_filter="^0$").fp8_sites() == ["0"]


# -- reliability (issue 29): hostile plan files -------------------------------------------------
def _plan_dict(make_report, three):
    report = make_report({"a.b": (64, 64, 128, {r: three for r in Role})})
    p = plan(report, role_budgets={Role.WGRAD: 0.06})
    p.record_fallback("a.b", 17, "non-finite output")
    return p.to_dict()


A = ("sites", "a.b")
FWD = A + ("roles", "fwd")
HOSTILE = [
    (("version",), True, "version True is not supported"),
    (("fallbacks", 0, "step"), 1e999, "fallbacks[0].step: expected an integer"),
    (("fallbacks", 0, "step"), "17", "fallbacks[0].step: expected an integer"),
    (("fallbacks", 0, "previous"), 5, "fallbacks[0].previous: expected a JSON object"),
    (("fallbacks", 0, "previous"), {"fwd": 3}, "fallbacks[0].previous.fwd: expected a string"),
    (("fallbacks", 0, "site"), ["a"], "fallbacks[0].site: expected a string"),
    (("fallbacks",), {"a": 1}, "fallbacks: expected a JSON array"),
    (("fallbacks",), [5], "fallbacks[0]: expected a JSON object"),
    (A + ("tokens",), 1e999, "sites['a.b'].tokens: expected an integer"),
    (A + ("in_features",), 2 ** 70, "sites['a.b'].in_features: expected an integer"),
    (A + ("roles",), [], "sites['a.b'].roles: expected a JSON object"),
    (A + ("name",), 5, "sites['a.b'].name: expected a string"),
    (FWD + ("error",), "low", "sites['a.b'].roles['fwd'].error: expected a number"),
    (FWD + ("budget",), [0.2], "sites['a.b'].roles['fwd'].budget: expected a number"),
    (FWD + ("reason",), 5, "sites['a.b'].roles['fwd'].reason: expected a string"),
    (("notes",), 5, "notes: expected a JSON array"),
    (("notes",), [5], "notes[0]: expected a string"),
    (("source",), [], "source: expected a JSON object"),
    (("budget",), 3, "budget: expected a JSON object"),
    (("budget", "max_error"), "big", "budget.max_error: expected a number"),
    (("budget", "min_speedup"), [1], "budget.min_speedup: expected a number"),
    (("budget", "metric"), 3, "budget.metric: expected a string"),
    (("budget", "baseline"), 3, "budget.baseline: expected a string"),
    (("budget", "role_budgets"), [0.1], "budget.role_budgets: expected a JSON object"),
    (("budget", "role_budgets", "wgrad"), "x", "budget.role_budgets.wgrad: expected a number"),
    (("budget", "assume_fast"), "yes", "budget.assume_fast: expected true or false"),
    (("budget", "allowed_kernels"), "bf16", "budget.allowed_kernels: expected a JSON array"),
    (("device",), 5, "device: expected a string"),
    (("device",), "quantum:0", "device"),
    (("created",), 5, "created: expected a string"),
]


def _set(d, path, value):
    node = d
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value


@pytest.mark.parametrize("path,value,message", HOSTILE, ids=[m for _, _, m in HOSTILE])
def test_hostile_plan_files_give_one_report_error_naming_file_and_field(
        tmp_path, make_report, three, path, value, message):
    d = _plan_dict(make_report, three)
    _set(d, path, value)
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ReportError) as info:
        Plan.load(f)
    text = str(info.value)
    assert message in text and text.startswith(str(f)) and "\n" not in text


@pytest.mark.parametrize("text,match", [
    ('"step": 17', "fallbacks[0].step: expected an integer"),
    ('"tokens": 128', "sites['a.b'].tokens: expected an integer"),
])
def test_a_5000_digit_integer_in_a_plan_is_a_report_error(tmp_path, make_report, three, text, match):
    raw = json.dumps(_plan_dict(make_report, three))
    assert text in raw
    f = tmp_path / "plan.json"
    f.write_text(raw.replace(text, text.split(":")[0] + ": " + "9" * 5000))
    with pytest.raises(ReportError) as info:
        Plan.load(f)
    assert match in str(info.value) and str(f) in str(info.value)


@pytest.mark.parametrize("where", [("source",), ("budget", "uniform")])
def test_deep_nesting_in_a_plan_is_a_report_error(tmp_path, make_report, three, where):
    d = _plan_dict(make_report, three)
    _set(d, where, "DEEP")
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d).replace('"DEEP"', "[" * 100_000 + "]" * 100_000))
    with pytest.raises(ReportError, match="nested too deeply") as info:
        Plan.load(f)
    assert str(f) in str(info.value)


def test_a_plan_above_the_size_limit_is_refused(tmp_path, make_report, three):
    d = _plan_dict(make_report, three)
    d["notes"] = ["x" * 100] * 1000
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ReportError, match="limit"):
        Plan.load(f, max_bytes=f.stat().st_size - 1)
    assert len(Plan.load(f).notes) == 1000


def test_null_and_infinite_budgets_still_load(tmp_path, make_report, three):
    # a uniform plan has no budgets; an edited one may: loading keeps them, audit judges them
    d = _plan_dict(make_report, three)
    _set(d, FWD + ("budget",), None)
    _set(d, ("budget", "role_budgets", "wgrad"), "inf")
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    p = Plan.load(f)
    assert p.sites["a.b"].roles[Role.FWD].budget is None
    assert p.budget["role_budgets"]["wgrad"] == "inf"  # as written: json_safe's encoding
