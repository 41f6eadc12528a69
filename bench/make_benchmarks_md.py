#!/usr/bin/env python3
"""Render the tables of bench/BENCHMARKS.md from result JSONs (numbers are never typed by
hand): `python bench/make_benchmarks_md.py bench/results/<run>.json [...]` prints Markdown."""

import json
import sys


def bench_table(path: str) -> str:
    r = json.load(open(path))
    env, cfg = r["env"], r["config"]
    out = [f"### {cfg['model']} `{cfg['preset']}` on {env.get('gpu', env['device'])} "
           f"({env['date'][:10]}, commit {env.get('commit')})", "",
           f"torch {env['torch']}, triton {env.get('triton', '-')}, torchao {env.get('torchao', '-')}; "
           f"source: `{path}`", ""]
    for mode in ("train", "infer"):
        rows = r.get(mode, [])
        if not rows:
            continue
        out += [f"**{'training step' if mode == 'train' else 'inference forward'}** "
                f"(median of {cfg['steps']} steps)", "",
                "| variant | FP8 Linears | ms | samples/s | vs bf16 | vs bf16+Mods | vs bf16+Mods+graphs "
                "| vs bf16+Mods+merge+graphs | peak GiB |",
                "|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            if "error" in row:
                why = row["error"].splitlines()[0][:80].replace("|", "/")
                out.append(f"| {row['variant']} | failed: {why} | | | | | | | |")
                continue
            f = lambda k, fmt="{:.3f}": fmt.format(row[k]) if k in row else "-"  # noqa: E731
            out.append(f"| {row['variant']} | {row.get('fp8_sites', 0)} | {f('median_ms')} | "
                       f"{f('samples_per_s', '{:,.0f}')} | {f('speedup_vs_bf16')} | "
                       f"{f('speedup_vs_bf16+mods')} | {f('speedup_vs_bf16+mods+graphs')} | "
                       f"{f('speedup_vs_bf16+mods+merge+graphs')} | {f('peak_mem_gb', '{:.2f}')} |")
        out.append("")
    for mode, what in (("train", "training step"), ("infer", "inference forward")):
        prof = [row for row in r.get(mode, []) if "profile" in row]
        if not prof:
            continue
        classes = ("gemm", "gemm-fp8", "quantize", "triton", "embedding", "optimizer", "other")
        out += [f"**where the GPU time goes** ({what}, ms per step by kernel class, "
                "torch.profiler over the timed step)", "",
                "| variant | GPU ms | " + " | ".join(classes) + " |",
                "|---|---|" + "---|" * len(classes)]
        for row in prof:
            p = row["profile"]
            by = p["by_class_us"]
            out.append(f"| {row['variant']} | {p['gpu_us_per_step'] / 1e3:.2f} | "
                       + " | ".join(f"{by.get(c, 0.0) / 1e3:.2f}" for c in classes) + " |")
        out.append("")
    checks = r.get("checks", {})
    if checks.get("oracle") or checks.get("search_gap"):
        out += ["**the Dispatch checked against itself**", ""]
        for key, res in checks.get("oracle", {}).items():
            v = res["violations"]
            out.append(f"- plan `{key}` audited against its Probe report: {res['site_roles']} "
                       f"site-roles, " + ("no kernel within the budget faster than the one "
                                          "chosen" if not v else f"{len(v)} violation(s): "
                                          + "; ".join(f"{x['site']} {x['role']}: {x['why']}"
                                                      for x in v[:5])))
        for g in checks.get("search_gap", []):
            out.append(f"- {g['mode']}: `{g['tuned']}` {g['tuned_ms']:.3f} ms against the "
                       f"exhaustive search `{g['search']}` {g['search_ms']:.3f} ms: "
                       f"{g['tuned_speed_vs_search']:.3f} of its speed "
                       f"({'within' if g['within_3pct'] else 'not within'} 3%)")
        out.append("")
    for note in r.get("notes", []):
        out.append(f"- {note}")
    return "\n".join(out)


def sweep_table(path: str, ref: str = "bf16+mods") -> str:
    """A batch-size sweep (``loka bench --batch-sizes``): ms and speedup against ``ref``
    per variant and batch size."""
    r = json.load(open(path))
    sizes = [str(b) for b in r["batch_sizes"]]
    out = [f"### {r['config']['model']} `{r['config']['preset']}` batch-size sweep on "
           f"{r['env'].get('gpu', r['env']['device'])} ({r['env']['date'][:10]}, commit "
           f"{r['env'].get('commit')}); source: `{path}`", ""]
    for mode in ("train", "infer"):
        if not r.get(mode):
            continue
        out += [f"**{'training step' if mode == 'train' else 'inference forward'}**: ms "
                f"(speedup vs {ref})", "",
                "| variant | " + " | ".join(f"batch {b}" for b in sizes) + " |",
                "|---|" + "---|" * len(sizes)]
        for variant, by_b in r[mode].items():
            cells = []
            for b in sizes:
                row = by_b.get(b, {})
                if "median_ms" not in row:
                    cells.append("failed" if "error" in row else "-")
                    continue
                sp = row.get(f"speedup_vs_{ref}")
                cells.append(f"{row['median_ms']:.3f}" + (f" ({sp:.3f})" if sp is not None else ""))
            out.append(f"| {variant} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def kernels_table(path: str) -> str:
    """A kernel sweep (``bench/bench_kernels.py``): per case the fastest kernel and the
    best of each library (speedup against bf16, quantization included), the targets."""
    r = json.load(open(path))
    out = [f"### FP8 GEMM kernels on {r['device']} (torch {r['torch']}; "
           f"{len(r['cases'])} cases measured in {r['seconds']:.0f} s, "
           f"{len(r.get('unmeasured', []))} not reached); source: `{path}`", "",
           f"timing: {r.get('timing', 'eager')}", "",
           "| case | role | shape (M, K, N) | bf16 us | fastest | speedup | best per library |",
           "|---|---|---|---|---|---|---|"]
    by_case = {(c["label"], c["role"], tuple(c["shape"])): c for c in r["cases"]}
    for w in r["winners"]:
        c = by_case[(w["label"], w["role"], tuple(w["shape"]))]
        libs = ", ".join(f"{lib} {v['speedup']:.2f} (`{v['kernel']}`)"
                         for lib, v in sorted(w["by_library"].items()))
        sp = w["winner_speedup"]
        out.append(f"| {w['label']} | {w['role']} | {', '.join(map(str, w['shape']))} | "
                   f"{c['bf16_us']:.1f} | {w['winner']} | "
                   f"{'-' if sp is None else f'{sp:.2f}'} | {libs} |")
    out += ["", f"wins by library (bf16 where no FP8 kernel beats it): {r['library_wins']}", ""]
    t = r.get("targets", {})
    rows = t.get("wukong_fused_rowwise_vs_torchao_best", [])
    if rows:
        ahead = sum(x["loka_vs_torchao"] >= 1.0 for x in rows)
        out.append(f"- LoKA's Triton rowwise path against torchao's best kernel at the Wukong "
                   f"cases: at least as fast in {ahead} of {len(rows)} ("
                   + ", ".join(f"{x['case']} {x['loka_vs_torchao']:.2f}x" for x in rows) + ")")
    big = t.get("4096^3")
    if big:
        w, b = big["weight_quantized_once"], big["both_quantized"]
        out.append(f"- 4096^3: bf16 {big['bf16_us']:.1f} us; weight quantized once `{w['kernel']}` "
                   f"{w['us']:.1f} us = {w['speedup']:.2f}x (target {w['target']}: "
                   f"{'met' if w['met'] else 'not met'}); both operands quantized per call "
                   f"`{b['kernel']}` {b['us']:.1f} us = {b['speedup']:.2f}x")
    return "\n".join(out)


def quality_table(path: str) -> str:
    """A quality run (``bench/quality_at_scale.py``): NE per seed and arm, mean and spread,
    the paired change against the seed noise."""
    r = json.load(open(path))
    s, cfg = r["summary"], r["config"]
    out = [f"{cfg['model']} `{cfg['preset']}` on {r['env'].get('gpu', r['env']['device'])}, "
           f"{cfg['steps']} steps, {len({x['seed'] for x in r['runs']})} seed(s), commit "
           f"{r['env'].get('commit')}; source: `{path}`", "",
           "| arm | NE per seed | NE mean ± std | AUC mean |", "|---|---|---|---|"]
    arms = r.get("arms") or ["bf16+mods", "loka+mods"]
    for arm in arms:
        if arm not in s:
            continue
        per = ", ".join(f"{x['final']['ne']:.5f}" for x in sorted(
            (x for x in r["runs"] if x["arm"] == arm), key=lambda x: x["seed"]))
        out.append(f"| {arm} | {per} | {s[arm]['ne_mean']:.5f} ± {s[arm]['ne_std']:.5f} | "
                   f"{s[arm]['auc_mean']:.5f} |")
    by_arm = s.get("paired_by_arm") or (
        {"loka+mods": s["paired_ne_change_pct"]} if s.get("paired_ne_change_pct") else {})
    for arm, pc in by_arm.items():
        who = "LoKA" if arm == "loka+mods" else f"`{arm}`"
        out += ["", f"paired NE change ({who} against bf16 + Mods, same seed): "
                + ", ".join(f"{v:+.3f}%" for v in pc["per_seed"])
                + f"; mean {pc['mean']:+.3f}% ± {pc['std']:.3f}%; seed noise of bf16 + Mods "
                f"{s.get('seed_noise_pct', float('nan')):.3f}%"]
    for name, pc in (s.get("served_ne_change_pct") or {}).items():
        out += ["", f"the trained bf16 + Mods model served with plan `{name}` (NE change "
                "against serving it in bf16, same model): "
                + ", ".join(f"{v:+.3f}%" for v in pc["per_seed"])
                + f"; mean {pc['mean']:+.3f}% ± {pc['std']:.3f}%"]
    return "\n".join(out)


def fused_table(path: str) -> str:
    """A fused norm -> quantize run (``bench/bench_fused_norm.py``): microseconds per way
    of producing the FP8 input, and the fused kernel's speedup against norm + separate
    quantization, per case and granularity."""
    r = json.load(open(path))
    cols = ("fused", "fused_fp8_only", "norm_compiled+quant_triton", "inductor_fused",
            "norm_compiled_only", "eager")
    out = [f"fused norm -> quantize on {r['env'].get('gpu')} (torch {r['env'].get('torch')}, "
           f"commit {r['env'].get('commit')}); source: `{path}`", "",
           "| case | M x D | scaling | " + " | ".join(f"{c} us" for c in cols)
           + " | fused vs separate | FP8-only vs separate | exact |",
           "|---|---|---|" + "---|" * (len(cols) + 3)]
    for row in r["rows"]:
        t = row["times"]
        us = [f"{t[c]['us']:.1f}" if "us" in t.get(c, {}) else "failed" for c in cols]
        sp = row.get("speedup_vs_norm_compiled+quant_triton")
        sp8 = row.get("fp8_only_speedup_vs_norm_compiled+quant_triton")
        exact = row["fp8_bytes_equal_quantize_of_output"] and row["scales_equal"]
        out.append(f"| {row['case']} | {row['M']}x{row['D']} | {row['granularity']} | "
                   + " | ".join(us) + f" | {sp:.2f}x | " + (f"{sp8:.2f}x" if sp8 else "-")
                   + f" | {'yes' if exact else 'NO'} |")
    linear = [row for row in r["rows"] if row.get("with_linear")]
    if linear:
        kern = linear[0]["with_linear"]["kernel"]
        out += ["", f"each producer with the Linear it feeds (forward on `{kern}`): the compiled "
                "norm followed by the Linear quantizing its own input, against "
                "`norm_act_linear`", "",
                "| case | scaling | N | training: unfused us | fused us | speedup "
                "| serving: unfused us | fused us | speedup |",
                "|---|---|---|---|---|---|---|---|---|"]
        for row in linear:
            w = row["with_linear"]
            cells = [f"{w[m]['unfused_us']:.1f} | {w[m]['fused_us']:.1f} | {w[m]['speedup']:.2f}x"
                     if m in w else "- | - | -" for m in ("train", "serve")]
            out.append(f"| {row['case']} | {row['granularity']} | {w['N']} | " + " | ".join(cells)
                       + " |")
    s = r["summary"]
    out += ["", f"fused against norm + separate quantization: geomean "
            f"{s['geomean_speedup_vs_separate_quant']:.2f}x, lowest "
            f"{s['min_speedup_vs_separate_quant']:.2f}x; every FP8 output and scale equal to "
            f"quantizing the kernel's own output: {'yes' if s['all_numerics_exact'] else 'no'}"]
    return "\n".join(out)


def pool_table(path: str) -> str:
    """Quality runs pooled arm by arm (``bench/quality_pool.py``)."""
    r = json.load(open(path))
    s = r["summary"]
    commits = sorted({x["commit"] or "?" for x in r["runs"]})
    out = [f"### Quality runs pooled: {s['n_runs']} runs from {len(r['files'])} files "
           f"(commits {', '.join(commits)}); source: `{path}`", "",
           "| arm | runs | NE mean | std | min | max | change vs bf16+Mods | permutation p |",
           "|---|---|---|---|---|---|---|---|"]
    for arm, a in s["arms"].items():
        ch = f"{a['change_pct']:+.2f}%" if "change_pct" in a else "-"
        pv = f"{a['p_value']:.3f}" if "p_value" in a else "-"
        out.append(f"| {arm} | {a['n']} | {a['ne_mean']:.5f} | {a['ne_std']:.5f} | "
                   f"{a['ne_min']:.5f} | {a['ne_max']:.5f} | {ch} | {pv} |")
    out += ["", f"seed noise of bf16+Mods (std / mean): {s['seed_noise_pct']:.2f}%; `fp8` "
            "pools every run with FP8 sites"]
    for where, arm in r.get("aliases", {}).items():
        out += ["", f"`{where}` ran the same plan as `{arm}` and is pooled with it."]
    if s.get("paired"):
        out += ["", "paired: each run's NE change against the bf16 + Mods run of the same seed in "
                "the same call", "",
                "| arm | pairs | changes | mean | s.e. | sign-flip p |", "|---|---|---|---|---|---|"]
        for arm, a in s["paired"].items():
            ch = ", ".join(f"{c:+.2f}%" for c in a["changes_pct"])
            out.append(f"| {arm} | {a['n']} | {ch} | {a['mean_pct']:+.2f}% | "
                       f"{a['sem_pct']:.2f}% | {a['p_sign_flip']:.3f} |")
    return "\n".join(out)


def render(path: str) -> str:
    with open(path) as f:
        d = json.load(f)
    if d.get("schema") == "loka.quality":
        return quality_table(path)
    if d.get("schema") == "loka.quality-pool":
        return pool_table(path)
    if d.get("schema") == "loka.bench.fused-norm":
        return fused_table(path)
    if d.get("schema") == "loka.bench-sweep":
        return sweep_table(path)
    if "winners" in d and "cases" in d:
        return kernels_table(path)
    return bench_table(path)


if __name__ == "__main__":
    print("\n\n".join(render(p) for p in sys.argv[1:]))
