"""The plan as data (loka/dispatch/schema.py): JSON round trips, one-line errors for bad
files, the summary, report-free uniform plans."""

import json
import math

import pytest
from torch import nn

from loka.config import LinearConfig, Role
from loka.dispatch import Plan, plan
from loka.jsonio import ReportError

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
     "non-negative integers"),
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
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    p = Plan.uniform(model, "cublas-rowwise")
    assert p.config("0") == LinearConfig.uniform("cublas-rowwise")
    assert p.config("2") == LinearConfig("bf16", "bf16", "cublas-rowwise")
    assert p.fp8_sites() == ["0", "2"]
    assert Plan.uniform(model, "cublas-rowwise", module_filter="^0$").fp8_sites() == ["0"]
