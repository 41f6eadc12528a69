"""The HTML page, the Markdown summary and the text tables of ``loka.reporting``."""

import html.parser
import json
import math
import re
import shutil
import subprocess

import pytest

from loka import reporting
from loka.config import ROLES, Role
from loka.dispatch import Plan, RoleChoice, SitePlan
from loka.probe.report import ErrorStat, KernelResult, ProbeReport, ReportError, RoleReport, SiteReport
from loka.reporting import plots, tables

KERNELS = ("bf16", "emulated-tensorwise-e4m3", "emulated-rowwise-e4m3", "cublas-rowwise")
# (site, K, N, tokens, tensorwise MERE scale): over_arch.mlp.0 has outliers
SITES = (("layers.0.fmb.mlp.0", 64, 128, 512, 1.0), ("layers.0.fmb.mlp.2", 128, 128, 512, 1.2),
         ("over_arch.mlp.0", 256, 64, 512, 3.5))


def _stat(mean, n=16):
    return ErrorStat(mean, mean * 0.9, mean * 1.1, n, mean * 0.05)


def make_report(timing="cuda-graph", naive=True):
    """Three sites x three roles x four kernels, GPU-style timings, stats as loka.probe writes."""
    sites = {}
    for name, k, n, m, scale in SITES:
        roles = {}
        for role in ROLES:
            shape = {Role.FWD: (m, k, n), Role.DGRAD: (m, n, k), Role.WGRAD: (n, m, k)}[role]
            kernels = {}
            for kname, base_err, speed in (("bf16", 0.004, 1.0),
                                           ("emulated-tensorwise-e4m3", 0.09 * scale, None),
                                           ("emulated-rowwise-e4m3", 0.07, None),
                                           ("cublas-rowwise", 0.07, 1.2 if scale < 3 else 0.8)):
                kernels[kname] = KernelResult(
                    kname, mere=_stat(base_err), sqnr=_stat(30.0), relfro=_stat(base_err / 2),
                    naive_mere=_stat(base_err / 1.15) if naive else None,
                    time_us=None if speed is None else 10.0 / speed, speedup=speed,
                    timing=timing if speed is not None else "none",
                    safe=base_err * 1.1 <= 0.2, fast=bool(speed and speed >= 1.05))
            roles[role] = RoleReport(role, shape, 10.0, kernels)
        stats = {"act": {"updates": 4, "amax": 3.0 * scale, "channel_amax_ratio": 2.0 * scale,
                         "underflow_frac_e4m3": 1e-4 * scale, "overflow_frac_e4m3": 0.0,
                         "kurtosis": 0.5 * scale, "channel_kurtosis_max": 4.0 * scale,
                         "covariance": "full"},
                 "grad": {"amax": 1e-3, "kurtosis": 2.0, "underflow_frac_e4m3": 0.01},
                 "weight": {"amax": 0.3, "kurtosis": 0.1}}
        sites[name] = SiteReport(name, k, n, m, "bfloat16", stats, roles)
    return ProbeReport(sites=sites, device="cuda:0", device_name="NVIDIA H200",
                       torch_version="2.11.0", config={"max_error": 0.2, "min_speedup": 1.05})


CURVES = {"bf16": {"train": {"step": [1, 2, 3, 4], "loss": [0.7, 0.5, 0.4, 0.35]},
                   "eval": {"step": [2, 4], "ne": [0.98, 0.95], "auc": [0.6, 0.65]}},
          "LoKA": {"train": {"step": [1, 2, 3, 4], "loss": [0.7, 0.51, 0.41, 0.36]},
                   "eval": {"step": [2, 4], "ne": [0.981, 0.9512], "auc": [0.6, 0.649]}}}
SUMMARY = {"headers": ["", "bf16", "LoKA", "change"],
           "rows": [["held-out NE", "0.95000", "0.95120", "+0.13%"]],
           "notes": ["a note <with> markup & ampersand"]}
VOID = {"meta", "img", "br", "hr", "link", "input"}


class _Checker(html.parser.HTMLParser):
    """Collects tags, checks that every non-void tag is closed in order."""

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.ids, self.imgs, self.urls = [], [], [], 0, []
        self.tags = set()

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        for key in ("src", "href"):
            if key in attrs:
                self.urls.append(attrs[key])
        if tag == "img":
            self.imgs += 1
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:] or 'nothing'}")
        else:
            self.stack.pop()


def _check(page: str) -> _Checker:
    c = _Checker()
    c.feed(page)
    c.close()
    assert not c.errors, c.errors[:5]
    assert c.stack == [], f"unclosed tags: {c.stack}"
    return c


@pytest.fixture(scope="module")
def report():
    return make_report()


@pytest.fixture(scope="module")
def plan(report):
    """What the planner picks on this report: cublas-rowwise (1.2x, safe) at the first two
    sites, bf16 at over_arch.mlp.0 (0.8x)."""
    sites = {}
    for name, k, n, m, scale in SITES:
        fast = scale < 3
        sites[name] = SitePlan(name, k, n, m, {
            r: RoleChoice("cublas-rowwise", 0.077, 0.07, 1.2, 0.2, "fastest") if fast
            else RoleChoice("bf16", 0.0044, 0.004, None, 0.2, "no kernel meets the budget")
            for r in ROLES})
    return Plan(sites=sites, device="cuda:0",
                budget={"max_error": 0.2, "min_speedup": 1.05, "metric": "mere",
                        "baseline": "bf16", "assume_fast": False})


def test_plan_fixture_has_fp8_and_baseline(plan):
    picked = tables.decisions(plan)
    assert picked["layers.0.fmb.mlp.0"]["fwd"] == "cublas-rowwise"
    assert picked["over_arch.mlp.0"]["fwd"] == "bf16"  # 0.8x: not fast
    assert tables.fp8_fraction(plan) == (6, 9)


@pytest.mark.parametrize("with_plan,with_curves", [(True, True), (True, False), (False, False)])
def test_html_valid_self_contained_every_section(report, plan, with_plan, with_curves, tmp_path):
    path = tmp_path / "report.html"
    reporting.write_html(path, report, plan if with_plan else None,
                         CURVES if with_curves else None, SUMMARY, title="t <&>")
    page = path.read_text()
    c = _check(page)
    assert page.startswith("<!DOCTYPE html>")
    for sid in reporting.SECTIONS:
        assert sid in c.ids, sid
    assert "script" not in c.tags and "<script" not in page.lower()
    assert not [u for u in c.urls if not u.startswith("data:")], c.urls
    assert not re.search(r"(src|href)\s*=\s*[\"']?\s*(https?:)?//", page, re.I)
    assert "@import" not in page and "url(" not in page
    assert "a note &lt;with&gt; markup &amp; ampersand" in page  # escaped, not injected
    expected_imgs = 3 + int(with_plan) + int(with_curves)  # scatter, naive, stats (+map, curves)
    if plots.available():
        assert c.imgs == expected_imgs
    for site, *_ in SITES:
        assert site in page


def test_html_tables_carry_values(report, plan):
    page = reporting.render_html(report, plan, CURVES, SUMMARY)
    # the learned/naive ratio is 1.15 for every kernel by construction
    assert re.search(r"<td[^>]*>1\.15</td>", page)
    assert "0.95120" in page and "0.9512" in page  # summary and curve table
    assert "underflow_frac_e4m3" in page and "channel_kurtosis_max" in page
    assert "cuda:0" in page and "6 of 9 GEMM roles" in page


def test_html_without_matplotlib(report, plan, monkeypatch):
    monkeypatch.setattr(plots, "available", lambda: False)  # as if matplotlib were absent
    page = reporting.render_html(report, plan, CURVES, SUMMARY)
    c = _check(page)
    assert c.imgs == 0
    assert page.count("Plots need matplotlib") == 5
    for sid in reporting.SECTIONS:
        assert sid in c.ids
    assert "<table>" in page and "cublas-rowwise" in page


def test_html_empty_and_untimed_report():
    untimed = make_report(timing="none", naive=False)
    for kr in (k for s in untimed.sites.values() for r in s.roles.values() for k in r.kernels.values()):
        kr.speedup = kr.time_us = None
    page = reporting.render_html(untimed)
    _check(page)
    assert "no timings" in page.lower()
    assert "No N(0, 1) comparison" in page
    empty = reporting.render_html(ProbeReport())
    _check(empty)
    assert "No kernel results" in empty or "Plots need matplotlib" in empty


def test_cpu_timing_note():
    cpu = make_report(timing="cpu-wallclock")
    assert "CPU" in tables.timing_note(cpu)
    assert tables.timing_note(make_report()) is None
    assert "Timings were taken on the CPU" in reporting.render_markdown(cpu)


def test_markdown(report, plan, tmp_path):
    path = tmp_path / "summary.md"
    reporting.write_markdown(path, report, plan, CURVES, SUMMARY)
    md = path.read_text()
    assert md.startswith("## LoKA report")
    assert "**Plan:** 6 of 9 GEMM roles off the bf16 baseline." in md
    assert "1.15x the N(0, 1) MERE" in md
    table = [l for l in md.splitlines() if l.startswith("| `")]
    assert len(table) == len(SITES)
    assert all(l.count("|") == 5 for l in table)  # site + 3 roles
    # a chosen cell carries the chosen kernel's error and speedup
    assert "cublas-rowwise (0.07, 1.2x)" in md
    assert "0.95120" in md and "0.9512" in md
    assert "http" not in md


def test_text_tables(report, plan):
    text = tables.text_report(report, plan)
    assert "3 site(s) on cuda:0" in text
    lines = [l for l in text.splitlines() if l.startswith("layers.0.fmb.mlp.0")]
    assert len(lines) == 3 * (len(KERNELS) - 1)  # baseline rows left out
    assert sum(l.rstrip().endswith("*") for l in text.splitlines()) == 6
    ptext = tables.text_plan(plan)
    assert "6 of 9 GEMM roles" in ptext and "over_arch.mlp.0" in ptext


@pytest.mark.parametrize("columns", [("act", ""), ("grad",), ("weight",)])
def test_stat_columns(report, columns):
    cols = tables.stat_columns(report, columns)
    prefixes = {c.rpartition(".")[0] for c in cols}
    assert prefixes <= set(columns)
    if "act" in columns:
        assert cols == ["act.amax", "act.channel_amax_ratio", "act.underflow_frac_e4m3",
                        "act.overflow_frac_e4m3", "act.kurtosis", "act.channel_kurtosis_max"]
    assert "act.updates" not in cols and "act.covariance" not in cols


def test_flat_stats_and_geomean():
    flat = tables.flat_stats({"a": {"b": 1, "c": "inf", "d": "text", "e": True}, "f": 2.5})
    assert flat == {"a.b": 1.0, "a.c": math.inf, "f": 2.5}
    assert tables.geomean([1.0, 4.0, None, math.nan, -1.0]) == pytest.approx(2.0, rel=1e-12)
    assert tables.geomean([None]) is None


def test_load_dispatches_on_schema(report, plan, tmp_path):
    report.save(tmp_path / "r.json")
    plan.save(tmp_path / "p.json")
    assert isinstance(tables.load(tmp_path / "r.json"), ProbeReport)
    assert type(tables.load(tmp_path / "p.json")).__name__ == "Plan"
    (tmp_path / "x.json").write_text(json.dumps({"schema": "other"}))
    with pytest.raises(ReportError, match="schema: 'other'"):
        tables.load(tmp_path / "x.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ReportError, match="not valid JSON"):
        tables.load(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError):
        tables.load(tmp_path / "missing.json")


def test_decisions_from_dict_equals_object(plan):
    assert tables.decisions(plan.to_dict()) == tables.decisions(plan)


def test_tensorboard_missing_is_a_clear_error(report, plan, tmp_path):
    if reporting.tensorboard_available():
        n = reporting.write_tensorboard(tmp_path / "tb", report, plan, CURVES)
        assert n == 2 * (4 + 2 * 2) + 6 * 2
    else:
        with pytest.raises(RuntimeError, match="pip install 'loka\\[tensorboard\\]'"):
            reporting.write_tensorboard(tmp_path / "tb", report, plan, CURVES)


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_renders_in_headless_chromium(report, plan, tmp_path):
    Image = pytest.importorskip("PIL.Image")
    page = tmp_path / "report.html"
    reporting.write_html(page, report, plan, CURVES, SUMMARY)
    shot = tmp_path / "shot.png"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           f"--screenshot={shot}", "--window-size=1200,3000", f"file://{page}"]
    subprocess.run(cmd, capture_output=True, timeout=120, check=False)
    assert shot.exists(), "chromium wrote no screenshot"
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 3000)
    import numpy as np

    pixels = np.asarray(img.resize((120, 300)), dtype=np.int64).reshape(-1, 3)
    assert len(np.unique(pixels, axis=0)) > 50  # text, tables and figures, not a blank page
    # figures and table borders make a good share of the page non-white
    assert (pixels.sum(1) < 700).mean() > 0.05
