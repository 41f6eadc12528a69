"""Selection: from a Probe report and an accuracy budget to one kernel per site and role.

Shaped like a sharding planner: *enumerate* the kernels the report measured at each site
and role, *estimate* with the report's numbers, *propose* per role the fastest kernel
whose error bound meets its budget, else the baseline. :func:`audit` checks a plan against
its report with code of its own; :func:`override` edits a plan by hand.

Selection rule for one (site, role):

0. In a training plan, the ``head_sites`` sites nearest the loss (:func:`head_of`: the
   last to run in the Probe's forward order) stay on the baseline in every role. Serving
   plans keep no head back: the evidence for the rule is the NE of training.
1. A candidate is a registered kernel other than the baseline that the report measured
   there without failing, that runs on the target device, serves the role, fits the
   role's GEMM shape (alignment), and is in ``allowed_kernels`` if given. A reference
   kernel (not FP8: fp32, tf32) is a candidate only when ``allowed_kernels`` names it:
   it is what errors are measured against, and its low error would win rule 5.
2. It is *safe* when the upper end of the confidence interval of the error metric is at
   most the budget (``hi <= budget``). The budget is the site's (``site_budgets``, the
   strictest matching pattern), else the role's (``role_budgets``), else ``max_error``.
3. Its speed counts (is *decisive*) only when it was timed on the same device type as
   the target, on a GPU (``timing`` not 'none' or 'cpu-wallclock'), and the kernel is not
   emulated. CPU wall-clock and emulated timings say nothing about FP8 on a GPU.
4. Among safe candidates with a decisive speedup ``>= min_speedup`` the fastest wins
   (ties: lower error bound, then name). The speedup is :func:`kernel_speedup`'s: the
   step-aware one in training where the report has it; in a serving plan with
   ``static_scales``, :func:`static_serve_speedup` where the kernel takes a static scale.
   A kernel the Probe left untimed because its roofline bound (measured against the
   baseline on the same device type, ``KernelResult.roofline_bound``) is below the plan's
   ``min_speedup`` counts as timed and slow.
5. No such candidate, and none timed slow: with ``assume_fast=True`` a safe candidate
   without a decisive timing wins: a real kernel before any emulated one (emulated kernels are numerical
   references, never fast), then the lowest error bound, then the name; otherwise the
   baseline. This makes CPU reports without
   timings (``ProbeConfig(timing=False)``) plan bf16 everywhere unless the caller opts in.

Length: :func:`plan`, :func:`audit` (with the budget and model checks it makes first) and
:func:`override` apply one selection rule; in one module they cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import re
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch

from ..config import ROLES, DispatchConfig, Role, config_to_dict, role_shape
from ..jsonio import decode_number, encode_number
from ..kernels import registry
from ..probe.pricing import serve_static_time_us
from ..probe.report import ProbeReport, nearest_the_loss
from .linear import takes_static_input_scale
from .schema import Plan, RoleChoice, SitePlan
from .static import group_amax, observed_amax, static_scales_for

_UNTRUSTED_TIMINGS = ("none", "cpu-wallclock")


def kernel_speedup(kr, inference: bool = False) -> Optional[float]:
    """The speedup a plan judges a kernel by, step-aware where the report has it
    (quantization priced by where each operand comes from, :mod:`loka.probe.pricing`):
    serving, ``serve_speedup``, else the forward timed with its weight quantized beforehand
    (``speedup_weight_q``); training, ``step_speedup``; else the isolated call's."""
    if inference and kr.serve_speedup is not None:
        return kr.serve_speedup
    if inference and kr.speedup_weight_q is not None:
        return kr.speedup_weight_q
    if not inference and kr.step_speedup is not None:
        return kr.step_speedup
    return kr.speedup


def static_serve_speedup(kr, kernel, site, baseline_us: Optional[float]) -> Optional[float]:
    """The serving speedup of ``kernel`` at ``site``'s forward with a static input scale
    (:func:`loka.probe.pricing.serve_static_time_us`), or None where it has none: the
    kernel takes no static scale, the site has no observed input amax, or the report has
    no GEMM-alone timing there."""
    if (baseline_us is None or not takes_static_input_scale(kernel)
            or observed_amax(site) is None or kr.timing is None):
        return None
    t = serve_static_time_us(kernel, time_us_weight_q=kr.time_us_weight_q,
                             time_us_gemm=kr.time_us_gemm, producers=site.producers,
                             compiled=kr.timing.endswith("+compiled"))
    return baseline_us / t if t and t > 0 else None


def judged_speedup(kr, kernel, site, role: Role, baseline_us: Optional[float],
                   inference: bool, static: bool) -> Optional[float]:
    """The speedup :func:`plan` and :func:`audit` judge a kernel by: with static input scales
    a serving forward's :func:`static_serve_speedup` where it has one, else
    :func:`kernel_speedup`'s."""
    if static and inference and role is Role.FWD:
        s = static_serve_speedup(kr, kernel, site, baseline_us)
        if s is not None:
            return s
    return kernel_speedup(kr, inference)


def resolve_budget(config: DispatchConfig, site: str, role: Role | str) -> float:
    """The error budget of ``role`` at ``site``: the strictest matching site pattern, else
    the role's budget, else the global one."""
    matches = [float(b) for pat, b in config.site_budgets.items() if re.search(pat, site)]
    if matches:
        return min(matches)
    role = Role.parse(role)
    for r, b in config.role_budgets.items():
        if Role.parse(r) is role:
            return float(b)
    return float(config.max_error)


def head_of(report: ProbeReport, n: int) -> Tuple[List[str], bool]:
    """The ``n`` sites nearest the loss, and whether the report's forward order chose them.

    They are the last ``n`` sites to run in the Probe's observed training forwards
    (``SiteReport.order``), and never more than a quarter of the sites: a model of a few
    Linears keeps its FP8 sites (three or fewer sites keep none back). A site with no
    recorded order (it never ran there) is not among them. A report that records no order
    at all (made before the Probe recorded it) gives its last sites in registration
    order, and False."""
    ordered = nearest_the_loss({s.name: s.order for s in report.sites.values()}, n)
    if ordered or any(s.order is not None for s in report.sites.values()):
        return ordered, True
    n = min(n, len(report.sites) // 4)
    if n <= 0:
        return [], False
    return list(report.sites)[-n:], False


def _check_budgets(config: DispatchConfig) -> None:
    values = [("max_error", config.max_error)]
    values += [(f"role_budgets[{r!r}]", b) for r, b in config.role_budgets.items()]
    values += [(f"site_budgets[{p!r}]", b) for p, b in config.site_budgets.items()]
    for what, b in values:
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b):
            raise ValueError(f"{what} must be a finite number, got {b!r}")
    for pat in config.site_budgets:
        try:
            re.compile(pat)
        except re.error as e:
            raise ValueError(f"site_budgets pattern {pat!r} is not a regular expression ({e})") from None
    if not math.isfinite(config.min_speedup):
        raise ValueError(f"min_speedup must be finite, got {config.min_speedup!r}")


def plan(report: "ProbeReport | str | os.PathLike", max_error: Optional[float] = None,
         min_speedup: Optional[float] = None, metric: Optional[str] = None,
         role_budgets: Optional[Mapping[str, float]] = None,
         site_budgets: Optional[Mapping[str, float]] = None,
         config: Optional[DispatchConfig] = None,
         allowed_kernels: Optional[Iterable[str]] = None,
         device: "torch.device | str | None" = None, assume_fast: bool = False,
         inference: bool = False, head_sites: Optional[int] = None,
         static_scales: bool = False, static_margin: float = 1.0) -> Plan:
    """Choose per site and role the fastest kernel that meets the error budget.

    Args:
        report: a :class:`~loka.probe.report.ProbeReport` or the path of a saved one.
        max_error, min_speedup, metric, role_budgets, site_budgets, head_sites: override
            the fields of ``config`` (a :class:`~loka.config.DispatchConfig`, default: its
            defaults: MERE <= 0.2, speedup >= 1.05, the 3 sites nearest the loss on the
            baseline).
        allowed_kernels: consider only these kernel names (the baseline is always allowed).
        device: the device the plan is for; default: the report's.
        assume_fast: where no decisive timing exists (CPU or emulated timings, or none),
            choose the lowest-error safe real kernel (else emulated); see the module
            docstring.
        inference: plan for serving (``loka.apply(model, plan, inference=True)``): only
            the forward role is planned, and a kernel's speed is the one the Probe
            measured with the weight quantized beforehand, step-aware where the report
            has it (``serve_speedup``, else ``speedup_weight_q``), since serving
            quantizes weights once; dgrad and wgrad stay on the baseline.
        static_scales: (serving) quantize each FP8 forward's activation with a static
            scale, the report's observed input amax times ``static_margin``, where the
            kernel takes one (PyTorch quantizers: ``cublas-*``, ``torchao-*``): no amax
            pass, and the cast fuses into the op that makes x. Kernels are judged by that
            price (:func:`static_serve_speedup`), and the plan carries the scales
            (``Plan.static_scales``), which ``loka.apply(..., inference=True)`` sets.
            Values beyond a scale saturate to the format's largest: check quality on the
            data the model serves (the guard's ``saturation`` flag counts them).
        static_margin: multiplies each observed amax (> 1 leaves headroom for unseen
            outliers, at a little precision).

    Returns:
        A :class:`Plan`; ``plan.notes`` says which kernels were excluded and why.
    """
    if not isinstance(report, ProbeReport):
        report = ProbeReport.load(report)
    overrides = {k: v for k, v in (("max_error", max_error), ("min_speedup", min_speedup),
                                   ("metric", metric), ("role_budgets", role_budgets),
                                   ("site_budgets", site_budgets),
                                   ("head_sites", head_sites)) if v is not None}
    cfg = dataclasses.replace(config or DispatchConfig(), **overrides)
    _check_budgets(cfg)
    if static_scales and not inference:
        raise ValueError("static_scales is for serving plans (inference=True); training "
                         "takes delayed scaling")
    if not (isinstance(static_margin, (int, float)) and not isinstance(static_margin, bool)
            and 0 < static_margin < math.inf):
        raise ValueError(f"static_margin must be a finite positive number, got {static_margin!r}")
    allowed = None if allowed_kernels is None else set(allowed_kernels)
    if allowed is not None:
        unknown = sorted(n for n in allowed if n not in {k.name for k in registry.all_kernels()})
        if unknown:
            raise KeyError(f"allowed_kernels names unregistered kernels: {unknown}")
    target = torch.device(device if device is not None else report.device)
    same_device_type = torch.device(report.device).type == target.type
    registry.get(cfg.baseline)  # the baseline must exist

    notes: List[str] = []
    head, by_order = ([], True) if inference else head_of(report, cfg.head_sites)
    if head:
        notes.append(f"head_sites={cfg.head_sites}: {', '.join(head)} stay on {cfg.baseline} "
                     "in every role (the sites nearest the loss"
                     + ("" if by_order else "; the report records no forward order, so "
                        "the last in registration order") + ")")
    excluded: Dict[str, str] = {}  # kernel name -> why it was never considered
    undecided = 0  # safe site-roles left on the baseline for want of a decisive timing

    def usable(name: str) -> bool:
        if name in excluded:
            return False
        why = registry.why_not_runnable(name, target)
        if why is not None:
            excluded[name] = (why if why == registry.NOT_REGISTERED
                              else f"unavailable on {target}: {why}")
            return False
        return True

    sites: Dict[str, SitePlan] = {}
    for name, site in report.sites.items():
        sp = SitePlan(name, site.in_features, site.out_features, site.tokens)
        for role in ROLES:
            budget = resolve_budget(cfg, name, role)
            rr = site.roles.get(role)
            base_stat = None
            if rr is not None and cfg.baseline in rr.kernels:
                base_stat = rr.kernels[cfg.baseline].metric(cfg.metric)
            baseline_choice = RoleChoice(
                cfg.baseline, None if base_stat is None else base_stat.hi,
                None if base_stat is None else base_stat.mean, None, budget,
                "no kernel meets the budget")
            if name in head:
                baseline_choice.reason = ("head: among the sites nearest the loss "
                                          f"(head_sites={cfg.head_sites})")
                sp.roles[role] = baseline_choice
                continue
            if rr is None:
                skipped = site.stats.get("skipped_roles")
                why = skipped.get(role.value) if isinstance(skipped, Mapping) else None
                baseline_choice.reason = "not measured" + (f" ({why})" if why else "")
                sp.roles[role] = baseline_choice
                continue
            if inference and role is not Role.FWD:
                baseline_choice.reason = "inference plan: forward only"
                sp.roles[role] = baseline_choice
                continue
            timed, untimed, misfit, other = [], [], 0, 0  # other: over budget, failed, slow
            slow: List[float] = []  # decisive speedups below min_speedup
            for kname, kr in rr.kernels.items():
                if kname == cfg.baseline or (allowed is not None and kname not in allowed):
                    continue
                if not usable(kname):
                    continue
                kern = registry.get(kname)
                if not kern.is_fp8 and allowed is None:  # a reference: only when named
                    continue
                shape = role_shape(role, kern.padded_tokens(site.tokens), site.in_features,
                                   site.out_features)
                if not kern.supports(target, *shape, role=role):
                    misfit += 1
                    continue
                stat = kr.metric(cfg.metric)
                if kr.error or stat is None or stat.hi is None or not math.isfinite(stat.hi):
                    other += 1
                    continue
                if stat.hi > budget:
                    other += 1
                    continue
                bound = kr.roofline_bound if same_device_type else None
                if bound is not None and bound < cfg.min_speedup:  # never fast here
                    slow.append(bound)
                    other += 1
                    continue
                speedup = judged_speedup(kr, kern, site, role, rr.baseline_us, inference,
                                         static_scales)
                decisive = (same_device_type and not kern.is_emulated
                            and kr.timing.split("+")[0] not in _UNTRUSTED_TIMINGS
                            and speedup is not None and math.isfinite(speedup))
                if decisive:
                    if speedup >= cfg.min_speedup:
                        timed.append((speedup, stat, kname))
                    else:
                        slow.append(speedup)
                        other += 1
                else:
                    untimed.append((stat, kern, kname))
            if timed:
                speed, stat, kname = min(timed, key=lambda t: (-t[0], t[1].hi, t[2]))
                sp.roles[role] = RoleChoice(kname, stat.hi, stat.mean, speed, budget,
                                            "fastest kernel within the budget")
            elif untimed and assume_fast and not slow:
                stat, kern, kname = min(untimed, key=lambda t: (t[1].is_emulated, t[0].hi, t[2]))
                sp.roles[role] = RoleChoice(kname, stat.hi, stat.mean, None, budget,
                                            "lowest error within the budget (assume_fast)")
            else:
                if slow:  # timed on this device and not fast enough: emulated twins aside
                    baseline_choice.reason = (f"no kernel within the budget is {cfg.min_speedup:g}x "
                                              f"faster (best {max(slow):.2f}x)")
                elif untimed:
                    undecided += 1
                    baseline_choice.reason = "safe kernels have no decisive timing"
                elif misfit and not other:
                    baseline_choice.reason = ("no kernel fits the GEMM shape (alignment) on "
                                              f"{target.type}")
                sp.roles[role] = baseline_choice
        sites[name] = sp

    for kname, why in sorted(excluded.items()):
        notes.append(f"kernel {kname!r} excluded: {why}")
    unmeasured = report.meta.get("kernels_not_measured")
    if isinstance(unmeasured, Mapping) and unmeasured:
        listed = "; ".join(f"{n} ({why})" for n, why in sorted(unmeasured.items()))
        notes.append(f"kernels the Probe was asked for but could not run there, so not "
                     f"measured: {listed}")
    if undecided:
        notes.append(f"{undecided} site-role(s) kept on {cfg.baseline}: their safe kernels have "
                     "no decisive timing (CPU wall-clock, emulated, untimed, or measured on "
                     "another device type); plan with assume_fast=True (loka plan "
                     "--assume-fast) to choose the lowest-error safe kernel")
    budget_dict = config_to_dict(cfg)
    budget_dict.update(assume_fast=bool(assume_fast), inference=bool(inference),
                       allowed_kernels=None if allowed is None else sorted(allowed))
    if static_scales:
        budget_dict.update(static_scales=True, static_margin=float(static_margin))
    dtypes = {site.dtype for site in report.sites.values()}
    source = {"report_created": report.created, "report_device": report.device,
              "device_name": report.device_name, "torch": report.torch_version,
              "dtype": dtypes.pop() if len(dtypes) == 1 else None}
    out = Plan(sites=sites, device=str(target), budget=budget_dict, source=source, notes=notes)
    if static_scales:
        observed = group_amax(report)
        out.static_scales = static_scales_for(out, {n: a * float(static_margin)
                                                    for n, a in observed.items()
                                                    if a is not None})
        dynamic = [n for n in out.fp8_sites() if n not in out.static_scales
                   and sites[n].kernel("fwd", cfg.baseline) != cfg.baseline]
        if dynamic:
            notes.append(f"static_scales: {len(dynamic)} FP8 forward(s) keep dynamic scales "
                         f"(kernel takes no static scale, or no observed amax): "
                         f"{', '.join(dynamic)}")
    return out


def audit(plan: Plan, report: "ProbeReport | str | os.PathLike") -> dict:
    """Check a plan against the report it claims to follow, independently of :func:`plan`.

    For every site and role the report measured: the chosen kernel's error bound must be
    within the plan's budget, and no other kernel that the report shows within the budget
    may be faster by the plan's ``min_speedup`` rule (a role left on the baseline is at
    speed 1.0; a candidate must reach ``min_speedup`` to count), except that a training
    plan's head sites (rule 0, the plan's ``head_sites``) on the baseline are its own
    choice. Speeds are the report's (:func:`kernel_speedup`'s, as the plan judged them). Only
    timings taken on a GPU count; a plan made with ``assume_fast`` is checked for the
    budget only. Speeds count as in
    :func:`plan` (rule 3): taken on the plan's device type, not by the CPU wall clock, and
    not of an emulated kernel. A kernel the report timed ran where the report was
    measured, so the check needs no GPU: it runs anywhere.

    Before that, two checks that make "within its budget" mean something:

    * the plan and the report must describe the same model: every site in both, with the
      same in/out features and tokens (:func:`plan_report_mismatches`); each difference
      is a violation of kind ``"mismatch"`` (role ``"*"``);
    * every role's budget must be a real bound: the one the plan's own configuration
      (``budget``: ``max_error``, ``role_budgets``, ``site_budgets``) gives that site and
      role, recorded in the choice, and not one any output meets (:func:`budget_problem`:
      missing, not finite, or at least what a kernel returning zeros scores). A role
      whose budget fails is a violation of kind ``"budget"`` and is not checked further.

    Each site and role has at most one violation: kinds ``"mismatch"``, ``"budget"``,
    ``"error"`` (the chosen kernel outside its budget) and ``"speed"``.

    Returns:
        ``{"site_roles": n checked, "violations": [{"site", "role", "chosen", "kind",
        "chosen_speedup", "best", "best_speedup", "why"}], "ok": bool}``.
    """
    if not isinstance(report, ProbeReport):
        report = ProbeReport.load(report)
    cfg = plan.budget
    min_speedup = float(cfg.get("min_speedup", DispatchConfig().min_speedup))
    metric = str(cfg.get("metric", DispatchConfig().metric))
    inference = bool(cfg.get("inference", False))
    static = bool(cfg.get("static_scales", False))
    speeds_count = not cfg.get("assume_fast", False)
    allowed = None if cfg.get("allowed_kernels") is None else set(cfg["allowed_kernels"])
    registered = {k.name: k for k in registry.all_kernels()}
    same_device_type = torch.device(plan.device).type == torch.device(report.device).type

    def within(rr, kname: str, budget: float) -> bool:
        kr = rr.kernels.get(kname)
        stat = None if kr is None or kr.error else kr.metric(metric)
        return stat is not None and stat.hi is not None and stat.hi <= budget

    def speed(rr, kname: str, site=None, role: Role = Role.FWD) -> float:
        # decisive only as plan() rule 3 has it: timed on the plan's device type, not on
        # the CPU's wall clock, and not an emulated kernel (a numerical reference)
        if kname == plan.baseline:
            return 1.0
        kr = rr.kernels.get(kname)
        if (kr is None or not same_device_type or kr.timing.split("+")[0] in _UNTRUSTED_TIMINGS
                or kname not in registered or registered[kname].is_emulated):
            return math.nan
        s = (judged_speedup(kr, registered[kname], site, role, rr.baseline_us, inference,
                            static) if site is not None else kernel_speedup(kr, inference))
        return math.nan if s is None else float(s)

    def runs(site, role: Role, kname: str) -> bool:
        # it ran where the report was measured (it has a timing there); what is left is
        # whether the plan could use it: allowed, serving the role, fitting the padded shape
        try:
            kern = registry.get(kname)
        except KeyError:
            return False
        if allowed is not None and kname not in allowed:
            return False
        return bool(kern.fits(*role_shape(role, kern.padded_tokens(site.tokens), site.in_features,
                                          site.out_features), role=role))

    # rule 0 as the plan had it (a plan from before head_sites kept none back)
    n_head = cfg.get("head_sites", 0)  # not a count (a plan edited by hand): none back
    n_head = n_head if isinstance(n_head, int) and not isinstance(n_head, bool) else 0
    head = set() if inference else set(head_of(report, n_head)[0])
    checked, violations = 0, []
    mismatched = set()
    for m in plan_report_mismatches(plan, report):
        mismatched.add(m["site"])
        violations.append({"site": m["site"], "role": "*", "chosen": None, "kind": "mismatch",
                           "why": m["why"]})
    for name, sp in plan.sites.items():
        site = report.sites.get(name)
        if site is None or name in mismatched:
            continue
        for role, choice in sp.roles.items():
            rr = site.roles.get(role)
            if rr is None or (inference and role is not Role.FWD):
                continue
            checked += 1
            chosen = choice.kernel
            row = {"site": name, "role": role.value, "chosen": chosen}
            budget, why = _audited_budget(cfg, metric, name, role, choice.budget)
            if why is not None:
                violations.append({**row, "kind": "budget", "why": why})
                continue
            if chosen != plan.baseline and not within(rr, chosen, budget):
                violations.append({**row, "kind": "error", "why": "chosen kernel's error bound "
                                   f"is outside the budget {budget} (or was not measured)"})
                continue
            if not speeds_count or (name in head and chosen == plan.baseline):
                continue  # rule 0: a head site on the baseline is the plan's own choice
            cands = [(speed(rr, k, site, role), k) for k in rr.kernels
                     if k != plan.baseline and within(rr, k, budget)
                     and speed(rr, k, site, role) >= min_speedup and runs(site, role, k)]
            if not cands:
                continue
            best_speed, best = max(cands)
            mine = speed(rr, chosen, site, role)
            if not mine >= best_speed:  # NaN (an untimed choice) counts as slower
                violations.append({**row, "kind": "speed", "chosen_speedup": encode_number(mine),
                                   "best": best, "best_speedup": best_speed,
                                   "why": "a faster kernel within the budget was measured"})
    return {"site_roles": checked, "violations": violations, "ok": not violations}


def plan_report_mismatches(plan: Plan, report: ProbeReport) -> List[Dict[str, str]]:
    """Where ``plan`` and ``report`` describe different models: sites in one and not the
    other, and sites whose in/out features or tokens differ (a plan made from another
    model's report, or from a run of another batch size).

    Returns:
        ``[{"site", "why"}]``, in plan order then report order; empty when they match.
    """
    out = []
    for name, sp in plan.sites.items():
        site = report.sites.get(name)
        if site is None:
            out.append({"site": name, "why": "in the plan but not in the report"})
        elif (sp.in_features, sp.out_features, sp.tokens) != (
                site.in_features, site.out_features, site.tokens):
            out.append({"site": name, "why": (
                f"plan {sp.in_features}->{sp.out_features} x {sp.tokens} tokens, report "
                f"{site.in_features}->{site.out_features} x {site.tokens} tokens")})
    out += [{"site": name, "why": "in the report but not in the plan"}
            for name in report.sites if name not in plan.sites]
    return out


def budget_problem(metric: str, budget: object) -> Optional[str]:
    """Why ``budget`` bounds nothing for ``metric`` ('mere', 'relfro', 'neg_sqnr'), or None.

    A budget bounds nothing when it is missing, not a finite number, negative for an
    error that is never negative (no kernel meets it), or at least what a kernel that
    returns zeros scores: MERE and relative Frobenius error of zeros are at most 1, and
    -SQNR of zeros is 0 dB. A budget of 1e308 says "every choice within its budget" of
    any kernel at all.
    """
    if budget is None:
        return "no budget is recorded"
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
        return f"budget {budget!r} is not a finite number"
    if metric in ("mere", "relfro"):
        if budget < 0:
            return f"budget {budget:g} is negative: no kernel meets it"
        if budget >= 1:
            return (f"budget {budget:g} bounds nothing: a kernel that returns zeros has "
                    f"{metric} <= 1")
    elif metric == "neg_sqnr" and budget >= 0:
        return (f"budget {budget:g} bounds nothing: a kernel that returns zeros has "
                "-SQNR 0 dB")
    return None


def _audited_budget(cfg: Mapping, metric: str, site: str, role: Role,
                    recorded: Optional[float]) -> Tuple[float, Optional[str]]:
    """The budget the plan's configuration gives ``site`` and ``role`` (as
    :func:`resolve_budget` does), and why it or the choice's ``recorded`` one fails."""
    if "max_error" not in cfg:
        return math.inf, "the plan records no error budget (a uniform plan has none to audit)"
    try:
        matches = [decode_number(b) for pat, b in dict(cfg.get("site_budgets") or {}).items()
                   if re.search(str(pat), site)]
        roles = {Role.parse(r): b for r, b in dict(cfg.get("role_budgets") or {}).items()}
        if matches:
            where = "site_budgets"
            configured = None if None in matches else min(matches)
        elif role in roles:
            where = f"role_budgets[{role.value!r}]"
            configured = decode_number(roles[role])
        else:
            where = "max_error"
            configured = decode_number(cfg.get("max_error"))
    except (re.error, ValueError, TypeError) as e:  # ReportError is a ValueError
        return math.inf, f"the plan's budget cannot be read ({e})"
    why = budget_problem(metric, configured)
    if why is not None:
        return math.inf, f"the plan's {where}: {why}"
    if recorded is None or not math.isclose(recorded, configured, rel_tol=1e-9, abs_tol=0.0):
        return math.inf, (f"the choice records budget {recorded!r}, but the plan's {where} "
                          f"gives {configured:g}")
    return configured, None


# -- editing a plan ---------------------------------------------------------------------
def override(plan: Plan, *, replace: Optional[Mapping[str, str]] = None,
             assign: Optional[Mapping[str, str]] = None,
             report: "ProbeReport | str | os.PathLike | None" = None,
             check_budget: bool = True, same_numerics: bool = False) -> Plan:
    """A copy of ``plan`` with some kernels changed by hand (an experiment, or a choice the
    Probe cannot see, such as a kernel whose quantization fuses into its producer inside a
    compiled model).

    Args:
        plan: the plan to edit (not modified).
        replace: ``{old: new}``: every role on kernel ``old`` moves to ``new``.
        assign: ``{"<site glob>:<role>": kernel}`` (role 'fwd', 'dgrad', 'wgrad' or '*'):
            those roles move to ``kernel``, the baseline included. Applied after ``replace``.
        report: the Probe report the plan came from: the new choices take its error bound
            and speedup for that site and role.
        check_budget: with a report, refuse a kernel whose error bound at a site exceeds
            the role's budget, or that the report did not measure there.
        same_numerics: without a report, the new kernels compute what the old ones did (a
            fusible twin, :data:`FUSIBLE_TWINS`): each changed role keeps its error bound
            (its isolated speedup no longer applies).

    Returns:
        The edited plan; each changed role's ``reason`` says what it was before.

    Raises:
        KeyError: an unregistered kernel; ValueError: a kernel that does not serve a role,
        a glob that matches no site, or (``check_budget``) a choice outside the budget.
    """
    if report is not None and not isinstance(report, ProbeReport):
        report = ProbeReport.load(report)
    edits: List[Tuple[str, Role, str]] = []  # (site, role, kernel)
    for old, new in (replace or {}).items():
        registry.get(new)
        edits += [(s, r, new) for s, sp in plan.sites.items() for r in ROLES
                  if sp.kernel(r, plan.baseline) == old]
    for key, kernel in (assign or {}).items():
        pattern, sep, role_text = key.rpartition(":")
        if not sep or not pattern:
            raise ValueError(f"assign keys are '<site glob>:<role>', got {key!r}")
        roles = list(ROLES) if role_text == "*" else [Role.parse(role_text)]
        sites = [s for s in plan.sites if fnmatch.fnmatchcase(s, pattern)]
        if not sites:
            raise ValueError(f"{pattern!r} matches no site of the plan")
        registry.get(kernel)
        edits += [(s, r, kernel) for s in sites for r in roles]
    out = plan.copy()
    for site, role, kernel in edits:
        kern = registry.get(kernel)
        if role not in kern.roles:
            raise ValueError(f"kernel {kernel!r} does not serve role {role} ({site})")
        old = out.sites[site].roles.get(role)
        budget = None if old is None else old.budget
        error = error_mean = speedup = None
        if report is not None and kernel != out.baseline:
            kr = report.sites.get(site)
            kr = None if kr is None else kr.roles.get(role)
            kr = None if kr is None else kr.kernels.get(kernel)
            stat = None if kr is None else kr.metric(str(out.budget.get("metric", "mere")))
            if stat is not None and stat.hi is not None and math.isfinite(stat.hi):
                error, error_mean = stat.hi, stat.mean
                speedup = kernel_speedup(kr, bool(out.budget.get("inference")))
            if check_budget and (error is None or (budget is not None and error > budget)):
                raise ValueError(f"{site} {role}: {kernel!r} " + (
                    "was not measured there by the report" if error is None else
                    f"has error bound {error:.4g} above the budget {budget:g}"))
        elif same_numerics and old is not None:
            error, error_mean = old.error, old.error_mean
        was = "nothing" if old is None else old.kernel
        why = (f"{old.reason}; twin of {was} (same numerics)" if same_numerics and old is not None
               else f"override (was {was})")
        out.sites[site].roles[role] = RoleChoice(kernel, error, error_mean, speedup, budget, why)
    if edits:
        out.notes.append(f"overridden by hand: {len(edits)} site-role(s)")
    return out

