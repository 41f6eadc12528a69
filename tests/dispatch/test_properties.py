"""Properties of the Dispatch on random inputs (hypothesis; a few dozen examples each):
``loka.Linear`` with FP8 off has the gradients of float64 finite differences
(``torch.autograd.gradcheck``), and planning is deterministic (the same report gives the
same plan JSON, also after the report's JSON round trip)."""

import json

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import loka  # noqa: E402
from loka.config import ROLES, LinearConfig, Role  # noqa: E402
from loka.dispatch import plan  # noqa: E402
from loka.kernels import Kernel, register, unregister  # noqa: E402
from loka.probe.report import (ErrorStat, KernelResult, ProbeReport, RoleReport,  # noqa: E402
                               SiteReport)

PROPERTY = settings(max_examples=30, deadline=None, database=None)
pytestmark = pytest.mark.usefixtures("fake_kernels")  # conftest: real test kernels, any device
EXACT = "t-exact-mm"
"""a high-precision kernel that is not the baseline: loka.Linear then runs its own autograd
Function (the baseline alone is plain F.linear), in the operands' dtype"""


@pytest.fixture(scope="module", autouse=True)
def exact_kernel():
    register(Kernel(EXACT, lambda a, b, out: torch.mm(a, b.to(a.dtype)).to(out), library="custom",
                    description="torch.mm in the operands' dtype (tests)"), override=True)
    yield
    unregister(EXACT)


@PROPERTY
@given(k=st.integers(1, 6), n=st.integers(1, 6), lead=st.lists(st.integers(1, 4), min_size=1,
                                                                 max_size=3),
       bias=st.booleans(), roles=st.tuples(*(st.sampled_from(["bf16", EXACT]) for _ in ROLES)),
       seed=st.integers(0, 2 ** 31 - 1))
def test_linear_gradients_match_float64_finite_differences(k, n, lead, bias, roles, seed):
    torch.manual_seed(seed)
    lin = loka.Linear(k, n, bias=bias, dtype=torch.float64, config=LinearConfig(*roles))
    x = torch.randn(*lead, k, dtype=torch.float64, requires_grad=True)
    params = (lin.weight,) + ((lin.bias,) if bias else ())

    def f(x, *p):
        return torch.func.functional_call(lin, dict(zip(["weight", "bias"], p)), (x,))

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def _report(draw_sites, seed: int) -> ProbeReport:
    """A random report over emulated kernels, test kernels that count as real (their
    timings decide) and the baseline, measured on this CPU's device type."""
    g = torch.Generator().manual_seed(seed)
    kernels = ["emulated-tensorwise-e4m3", "emulated-rowwise-e4m3", "emulated-tensorwise-e5m2",
               "t-mid", "t-fast-coarse", "t-faster"]

    def u(lo, hi):
        return float(torch.empty(()).uniform_(lo, hi, generator=g))

    sites = {}
    for i, (k, n, m, timed) in enumerate(draw_sites):
        roles = {}
        for role in ROLES:
            shape = {Role.FWD: (m, k, n), Role.DGRAD: (m, n, k), Role.WGRAD: (n, m, k)}[role]
            results = {"bf16": KernelResult("bf16", mere=ErrorStat(0.004, 0.003, 0.005, 8),
                                            speedup=1.0, timing="cuda-graph")}
            for name in kernels:
                if name.endswith("e5m2") and role is Role.FWD:
                    continue
                hi = u(0.01, 0.4)
                results[name] = KernelResult(
                    name, mere=ErrorStat(hi * 0.8, hi * 0.6, hi, 8, 0.01),
                    speedup=u(0.5, 2.0) if timed else None,
                    timing="cuda-graph" if timed else "none")
            roles[role] = RoleReport(role, shape, 10.0, results)
        sites[f"layer{i}.mlp"] = SiteReport(f"layer{i}.mlp", k, n, m, roles=roles)
    return ProbeReport(sites=sites, device="cpu", device_name="test", created="2026-01-01T00:00:00")


SITES = st.lists(st.tuples(st.sampled_from([16, 32, 48, 64]), st.sampled_from([16, 32, 128]),
                           st.integers(1, 4096), st.booleans()), min_size=0, max_size=6)


@PROPERTY
@given(sites=SITES, seed=st.integers(0, 2 ** 31 - 1), max_error=st.floats(0.01, 0.5),
       wgrad=st.one_of(st.none(), st.floats(0.01, 0.5)), assume_fast=st.booleans(),
       inference=st.booleans(), min_speedup=st.floats(0.5, 2.0))
def test_planning_is_deterministic(tmp_path_factory, sites, seed, max_error, wgrad, assume_fast,
                                   inference, min_speedup):
    report = _report(sites, seed)
    kwargs = dict(max_error=max_error, min_speedup=min_speedup, assume_fast=assume_fast,
                  inference=inference, role_budgets=None if wgrad is None else {"wgrad": wgrad})

    def plan_json(r):
        d = plan(r, **kwargs).to_dict()
        d.pop("created")
        return json.dumps(d, sort_keys=True)

    first = plan_json(report)
    assert plan_json(report) == first
    path = tmp_path_factory.mktemp("plan") / "report.json"
    report.save(path)
    assert plan_json(ProbeReport.load(path)) == first  # the JSON round trip changes nothing
    assert plan_json(str(path)) == first
    # and the plan passes its own audit
    p = plan(report, **kwargs)
    assert loka.dispatch.audit(p, report)["ok"]
