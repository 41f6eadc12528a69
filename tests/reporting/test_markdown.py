"""Markdown and HTML of reports from hostile files (loka/reporting/markdown.py, html.py):
every string a file brings is rendered as the text it is; a plan and a report of two
models are rendered only with a warning."""

import html.parser
import re

import pytest

from loka import reporting
from loka.config import ROLES, Role
from loka.dispatch import Plan, RoleChoice, SitePlan
from loka.probe.report import ErrorStat, KernelResult, ProbeReport, RoleReport, SiteReport
from loka.reporting import tables
from loka.reporting.markdown import md_code, md_text

EVIL = '<script>alert("x")</script> & <img src=x onerror=alert(1)> [a](javascript:alert(1)) `|`'
SITE = "over_arch.mlp.0<script>`|`"
KERNEL = "cublas-rowwise"


def _report(device_name=EVIL, site=SITE, torch_version=EVIL, tokens=512):
    roles = {}
    for role in ROLES:
        shape = {Role.FWD: (tokens, 64, 128), Role.DGRAD: (tokens, 128, 64),
                 Role.WGRAD: (128, tokens, 64)}[role]
        roles[role] = RoleReport(role, shape, 10.0, {
            "bf16": KernelResult("bf16", mere=ErrorStat(0.004, 0.0036, 0.0044, 16), speedup=1.0,
                                 timing="cuda-graph"),
            KERNEL: KernelResult(KERNEL, mere=ErrorStat(0.07, 0.063, 0.077, 16),
                                 naive_mere=ErrorStat(0.06, 0.054, 0.066, 16), speedup=1.2,
                                 timing="cuda-graph", safe=True, fast=True)})
    return ProbeReport(sites={site: SiteReport(site, 64, 128, tokens, roles=roles)},
                       device="cuda:0", device_name=device_name, torch_version=torch_version)


def _plan(site=SITE, tokens=512, metric="mere"):
    roles = {r: RoleChoice(KERNEL, 0.077, 0.07, 1.2, 0.2, EVIL) for r in ROLES}
    return Plan(sites={site: SitePlan(site, 64, 128, tokens, roles)}, device="cuda:0",
                budget={"max_error": 0.2, "min_speedup": 1.05, "metric": metric,
                        "baseline": "bf16"}, notes=[EVIL])


class _Tags(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _outside_code(md: str) -> str:
    """The Markdown with its code spans removed (their content is never rendered as HTML)."""
    return re.sub(r"(`+)(?:(?!\1).)+?\1", "", md)


def test_markdown_escapes_every_report_derived_string():
    # issue 29: device_name went into summary.md as a live <script>
    md = reporting.render_markdown(_report(), _plan(), title=EVIL,
                                   summary={"headers": ["", EVIL], "rows": [[EVIL, "1"]],
                                            "notes": [EVIL]},
                                   curves={EVIL: {"eval": {"step": [1], "ne": [0.9]}}})
    text = _outside_code(md)
    assert not re.search(r"<[A-Za-z/!?]", text)  # no tag opens ('< 0.2' is plain text)
    assert not re.search(r"(?<!\\)\[a(?<!\\)\]", text)  # no link: the brackets are escaped
    assert "&lt;script&gt;" in md
    # a table keeps its columns: a name's | does not split cells
    row = next(l for l in md.splitlines() if "over" in l and l.startswith("|"))
    assert len(re.findall(r"(?<!\\)\|", row)) == 5


def test_markdown_and_html_escape_the_kernel_names_of_a_plan():
    plan = _plan()
    for choice in plan.sites[SITE].roles.values():
        choice.kernel = EVIL  # a plan file may name anything
    md = reporting.render_markdown(_report(), plan)
    assert not re.search(r"<[A-Za-z/!?]", _outside_code(md))
    parser = _Tags()
    parser.feed(reporting.render_html(_report(), plan))
    assert "script" not in {t for t, _ in parser.tags}


def test_a_plan_file_with_an_unknown_metric_is_refused():
    d = _plan().to_dict()
    d["budget"]["metric"] = EVIL
    with pytest.raises(ValueError, match="budget.metric"):
        Plan.from_dict(d)


@pytest.mark.parametrize("text", ["plain", "a|b", "`tick`", "``", " ", "x\ny", "<b>&"])
def test_md_code_and_md_text_round_trip_as_literal_text(text):
    code = md_code(text)
    fence = re.match(r"`+", code).group(0)
    assert code.endswith(fence) and fence not in code[len(fence):-len(fence)]
    assert "\n" not in code and "\n" not in md_text(text)
    assert not re.search(r"(?<!\\)\|", code) and not re.search(r"(?<!\\)\|", md_text(text))


def test_normal_names_are_left_readable():
    assert md_text("cublas-rowwise (0.07, 1.2x)") == "cublas-rowwise (0.07, 1.2x)"
    assert md_text("NVIDIA H200, cuda:0") == "NVIDIA H200, cuda:0"
    assert md_code("layers.0.fmb.mlp.0") == "`layers.0.fmb.mlp.0`"


def test_html_escapes_every_report_derived_string():
    # the meta line skipped escaping for any text with '&' in it
    page = reporting.render_html(_report(), _plan(), title=EVIL,
                                 summary={"headers": ["", EVIL], "rows": [[EVIL, "1"]],
                                          "notes": [EVIL]})
    parser = _Tags()
    parser.feed(page)
    names = {t for t, _ in parser.tags}
    assert "script" not in names and not any("onerror" in a for _, a in parser.tags)
    assert all(t != "img" or a.get("src", "").startswith("data:image/png") for t, a in parser.tags)


def test_a_plan_and_a_report_of_two_models_are_rendered_with_a_warning():
    # issue 29: loka report rendered a plan against another model's report silently
    report, plan = _report(site="a", device_name="gpu"), _plan(site="b")
    other_tokens = _plan(site="a", tokens=4096)
    for p, site, why in ((plan, "b", "in the plan but not in the report"),
                         (other_tokens, "a", "4096 tokens")):
        note = tables.mismatch_note(report, p)
        assert note and site in note and why in note
        assert "warning: the plan does not match this report" in tables.text_report(report, p)
        assert "**Warning:** the plan does not match this report" in reporting.render_markdown(report, p)
        assert "<b>Warning:</b> the plan does not match this report" in reporting.render_html(report, p)
    matching = _plan(site="a")
    assert tables.mismatch_note(report, matching) is None
    assert "Warning" not in reporting.render_markdown(report, matching)
    assert "Warning" not in reporting.render_html(report, matching)


@pytest.mark.parametrize("name", ["a$\\frac$b", "x$^$y", "$$"])
def test_names_with_dollar_signs_do_not_break_the_figures(name):
    # matplotlib reads $...$ as a formula, and a malformed one failed the whole page
    pytest.importorskip("matplotlib")
    page = reporting.render_html(_report(site=name), _plan(site=name))
    assert page.count("data:image/png") >= 2


@pytest.mark.parametrize("value", [1e308, 1e150])
def test_extreme_but_valid_numbers_do_not_break_the_figures(value):
    pytest.importorskip("matplotlib")
    report = _report(device_name="gpu", site="a")
    kr = report.sites["a"].roles[Role.FWD].kernels[KERNEL]
    kr.mere = ErrorStat(value, 0.0, value, 16)
    kr.speedup = value
    page = reporting.render_html(report, _plan(site="a"))
    assert "data:image/png" in page and f"{value:.3g}" in page
