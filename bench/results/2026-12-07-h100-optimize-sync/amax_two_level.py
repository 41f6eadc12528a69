"""A row amax taken in two stages (per block of 256, then per row), so that Inductor can
fuse the first stage into a block norm's own kernel: the CUDA code Inductor generates for a
simulated H200 on the CPU (``loka.bench.stepcode.cuda_step_code``; nothing runs), for
``Linear(2048, 2048) -> RowBlockNorm(2048, 256) -> HSwish -> Linear(2048, 8192)`` at 4096
rows, the second Linear on ``cublas-rowwise`` in every role. ``one``: LoKA's rowwise
scales as they are; ``two``: ``loka.numerics.compute_scales`` patched to take a row's amax
of a contiguous operand as the amax of its 256-blocks' amaxes (the same values, bit for bit).

    PYTHONPATH=. python bench/results/2026-12-07-h100-optimize-sync/amax_two_level.py \\
        --out bench/results/2026-12-07-h100-optimize-sync/amax_two_level_cpu.json
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import loka  # noqa: E402
import loka.numerics.scaling as S  # noqa: E402
from evalset.common import HSwish, RowBlockNorm  # noqa: E402
from loka.bench.stepcode import cuda_step_code, inventory, summarize  # noqa: E402
from loka.dispatch import Plan  # noqa: E402

G = 256
ONE_LEVEL = S.compute_scales


def two_level(x, fmt, block, power_of_two=False):
    r, c = x.shape
    br, bc = S._resolve_block((r, c), block)
    if br == 1 and bc == c and c % G == 0 and c > G and x.stride(1) == 1:
        amax = x.detach().abs().reshape(r, c // G, G).amax(-1).amax(-1, keepdim=True).float()
        scale = amax.clamp(min=S.AMAX_EPS) / S.get_format(fmt).max
        return S.round_scale_to_power_of_two(scale) if power_of_two else scale
    return ONE_LEVEL(x, fmt, block, power_of_two)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2048, 2048, bias=False)
        self.n = RowBlockNorm(2048, G)
        self.h = HSwish()
        self.b = nn.Linear(2048, 8192, bias=False)

    def forward(self, x):
        return self.b(self.h(self.n(self.a(x)))).float().sum(-1)


def case(variant: str, train: bool) -> dict:
    S.compute_scales = two_level if variant == "two" else ONE_LEVEL
    try:
        torch.manual_seed(0)
        m = Block().to(torch.bfloat16)
        loka.apply(m, Plan.uniform(m, "cublas-rowwise", module_filter=r"^b$", device="cpu"))
        if not train:
            m.eval()
        x = torch.randn(4096, 2048, dtype=torch.bfloat16)
        with torch.enable_grad() if train else torch.no_grad():
            codes = cuda_step_code(m, (x,), None, train=train)
    finally:
        S.compute_scales = ONE_LEVEL
    launches = [launch for code in codes for launch in inventory(code)]
    s = summarize(launches)
    return {"variant": variant, "mode": "train" if train else "serve",
            "total_launches": s["total_launches"], "non_gemm_mbytes": s["non_gemm_mbytes"],
            "launches": s["launches"], "mbytes": s["mbytes"],
            "kernels": [[launch.name, round(launch.bytes / 1e6, 1)] for launch in launches]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rows = [case(v, t) for t in (False, True) for v in ("one", "two")]
    for r in rows:
        print(r["mode"], r["variant"], r["total_launches"], "launches,",
              r["non_gemm_mbytes"], "non-GEMM MB")
    with open(args.out, "w") as f:
        json.dump({"torch": torch.__version__, "generated_for": "simulated H200 (no GPU)",
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
