#!/usr/bin/env python3
"""How well a fast-accumulation kernel's compiled call is derived from its twin's
(``Kernel.quantizes_as``): from a Probe report in which both were timed (GPU), the
twin's call less its GEMM plus the kernel's GEMM, against the kernel's own timing, per
site-role and weight-quantized variant. Pairs that the registry does not declare twins
are checked too, to show why they are not.

    python bench/twin_derivation.py bench/results/2026-12-05-h200-evalset/wukong.b4096.report.json \\
        --out bench/results/2026-12-05-h200-evalset/twin_derivation.json
"""

import argparse
import json
import statistics
import sys

from loka.jsonio import atomic_write_text

PAIRS = (("cublas-rowwise-fastacc", "cublas-rowwise"),
         ("cublas-tensorwise-fastacc", "cublas-tensorwise"),
         ("torchao-tensorwise-fastacc", "torchao-tensorwise"),
         ("torchao-rowwise-fastacc", "torchao-rowwise"))


def derive(report: dict) -> dict:
    out = {}
    for kernel, twin in PAIRS:
        errs = []
        for site, s in report["sites"].items():
            for role, rr in s["roles"].items():
                k, t = rr["kernels"].get(kernel), rr["kernels"].get(twin)
                if not k or not t:
                    continue
                if None in (k.get("time_us"), k.get("time_us_gemm"), t.get("time_us"),
                            t.get("time_us_gemm")):
                    continue
                d = t["time_us"] - t["time_us_gemm"] + k["time_us_gemm"]
                errs.append({"site": site, "role": role, "measured_us": k["time_us"],
                             "derived_us": d, "rel_err": d / k["time_us"] - 1})
        abs_errs = [abs(e["rel_err"]) for e in errs]
        out[kernel] = {"from": twin, "cases": len(errs),
                       "median_abs_rel_err": statistics.median(abs_errs) if errs else None,
                       "max_abs_rel_err": max(abs_errs) if errs else None, "rows": errs}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    with open(args.report) as f:
        result = {"report": args.report, "pairs": derive(json.load(f))}
    for kernel, r in result["pairs"].items():
        print(f"{kernel:28} from {r['from']:20} cases {r['cases']:3}  median |err| "
              f"{r['median_abs_rel_err']}  max {r['max_abs_rel_err']}")
    if args.out:
        atomic_write_text(args.out, json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
