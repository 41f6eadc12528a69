#!/usr/bin/env bash
# Hand-edited plans for experiments (bench/run_all.py --plans name=bench/plans/<name>.plan.json
# and variants loka@<name>...). Each starts from the Probe report of a benchmark run and
# moves some roles to other kernels; `loka plan` refuses a kernel outside the error budget.
set -eu
R=${1:-bench/results/archive/2026-12-03-h200-wukong}
cd "$(dirname "$0")/../.."
for tag in "" ".merge"; do
  rep=$R/bench${tag}.report.json
  # fwd: only forward GEMMs of the large Linears (K, N >= 1024) in FP8, on cuBLAS rowwise
  # fast-accumulation GEMMs with Inductor-fused quantization; every gradient in bf16
  python -m loka plan "$rep" -o "bench/plans/fwd${tag}.plan.json" --kernels bf16 \
    --assign '*.fmb.mlp.*:fwd=cublas-rowwise-fastacc' \
    --assign 'over_arch.mlp.0:fwd=cublas-rowwise-fastacc' \
    --assign 'over_arch.mlp.2:fwd=cublas-rowwise-fastacc'
done
for tag in "" ".merge"; do
  rep=$R/bench${tag}.report.json
  # tw / twc: every role of the FM block's wide Linear and the top Linear on tensorwise FP8
  # (one scale per tensor: x, W and dy are quantized once and reused by the other roles),
  # with LoKA's Triton quantizers (tw) or PyTorch quantization Inductor fuses (twc)
  for name in tw:triton-tensorwise-cublas twc:cublas-tensorwise; do
    python -m loka plan "$rep" -o "bench/plans/${name%%:*}${tag}.plan.json" --kernels bf16 \
      --assign "*.fmb.mlp.2:*=${name#*:}" --assign "over_arch.mlp.0:*=${name#*:}"
  done
done
# wukong-paper-tuned.merge: the plan the training benchmark ran at its best, the `tuned_plan`
# of its loka+mods+merge+tuned+graphs row (FP8 forwards of the four FM 2048 -> 8192 Linears,
# FP8 forward and input gradient of the top Linear), for
# `bench/quality_at_scale.py --merge --plan bench/plans/wukong-paper-tuned.merge.plan.json`
python - <<'PY'
import json
from loka.dispatch.plan import Plan
rows = json.load(open("bench/results/2026-12-03-h200-wukong-search-torchao/bench.json"))["train"]
row = next(r for r in rows if r["variant"] == "loka+mods+merge+tuned+graphs")
Plan.from_dict(row["tuned_plan"]).save("bench/plans/wukong-paper-tuned.merge.plan.json")
PY
# Ablations of the tuned plan, for the quality harness's named arms
# (`bench/quality_at_scale.py --merge --plans fm=...,top=...`): which FP8 sites cost NE.
#   tuned-fm:   only the four FM fmb.mlp.2 forwards (triton-rowwise-cublas-fastacc)
#   tuned-top:  only the top Linear, forward and input gradient (cublas-rowwise-fastacc)
#   tuned-top-exact: the top Linear as tuned-top, without fast accumulation
#                    (triton-rowwise-cublas: the same cuBLAS GEMM, LoKA's Triton quantizer)
rep=bench/results/archive/2026-12-03-h200-wukong-merge/bench.merge.report.json
python -m loka plan "$rep" -o bench/plans/wukong-paper-tuned-fm.merge.plan.json --kernels bf16 \
  --assign '*.fmb.mlp.2:fwd=triton-rowwise-cublas-fastacc'
python -m loka plan "$rep" -o bench/plans/wukong-paper-tuned-top.merge.plan.json --kernels bf16 \
  --assign 'over_arch.mlp.0:fwd=cublas-rowwise-fastacc' \
  --assign 'over_arch.mlp.0:dgrad=cublas-rowwise-fastacc'
python -m loka plan "$rep" -o bench/plans/wukong-paper-tuned-top-exact.merge.plan.json --kernels bf16 \
  --assign 'over_arch.mlp.0:fwd=triton-rowwise-cublas' \
  --assign 'over_arch.mlp.0:dgrad=triton-rowwise-cublas'
#   tuned-exacttop: the tuned plan with the top Linear as tuned-top-exact (FM forwards keep
#                   fast accumulation at K = 2048; the top Linear, K = 16384, does not)
python -m loka plan "$rep" -o bench/plans/wukong-paper-tuned-exacttop.merge.plan.json --kernels bf16 \
  --assign '*.fmb.mlp.2:fwd=triton-rowwise-cublas-fastacc' \
  --assign 'over_arch.mlp.0:fwd=triton-rowwise-cublas' \
  --assign 'over_arch.mlp.0:dgrad=triton-rowwise-cublas'
# wukong-paper-serve-tuned.merge: the serving plan the inference benchmark ran at its best (the
# `tuned_plan` of its loka+mods+merge+tuned+graphs row: FP8 forwards of the eight FM Linears
# on cuBLAS rowwise with fast accumulation), so that serving rows can apply it untuned
python - <<'PY'
import json
from loka.dispatch.plan import Plan
rows = json.load(open("bench/results/archive/2026-12-03-h200-infer-profile/bench.json"))["infer"]
row = next(r for r in rows if r["variant"] == "loka+mods+merge+tuned+graphs")
Plan.from_dict(row["tuned_plan"]).save("bench/plans/wukong-paper-serve-tuned.merge.plan.json")
PY
#   tuned-exacttop-emulated: tuned-exacttop's FP8 site-roles on the emulated rowwise e4m3
#                   kernel (PyTorch quantize -> dequantize -> bf16 GEMM, the CPU reference):
#                   the same FP8 rounding without the FP8 kernels, to tell numerics from kernels
python - <<'PY'
# the report did not time the emulated kernel, so `loka plan --assign` cannot put it there
import json
from loka.dispatch.plan import Plan
d = json.load(open("bench/plans/wukong-paper-tuned-exacttop.merge.plan.json"))
for site in d["sites"].values():
    for role in site["roles"].values():
        if role["kernel"] != "bf16":
            role.update(kernel="emulated-rowwise-e4m3", speedup=None,
                        reason=f"override (was {role['kernel']}): same FP8 rounding, emulated")
Plan.from_dict(d).save("bench/plans/wukong-paper-tuned-exacttop-emulated.merge.plan.json")
PY
