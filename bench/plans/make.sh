#!/usr/bin/env bash
# Hand-edited plans for experiments (bench/run_all.py --plans name=bench/plans/<name>.plan.json
# and variants loka@<name>...). Each starts from the Probe report of a benchmark run and
# moves some roles to other kernels; `loka plan` refuses a kernel outside the error budget.
set -eu
R=${1:-bench/results/2026-12-03-h200-wukong}
cd "$(dirname "$0")/../.."
for tag in "" ".merge"; do
  rep=$R/bench${tag}.report.json
  # cub: the Probe's choices, with cuBLAS GEMMs quantized by PyTorch ops (Inductor fuses
  # the quantization into the op producing the operand) instead of LoKA's Triton quantizers
  python -m loka plan "$rep" -o "bench/plans/cub${tag}.plan.json" \
    --replace triton-rowwise-cublas=cublas-rowwise \
    --replace triton-rowwise-cublas-fastacc=cublas-rowwise-fastacc
  # fwd: only forward GEMMs of the large Linears (K, N >= 1024) in FP8, on cuBLAS rowwise
  # fast-accumulation GEMMs with Inductor-fused quantization; every gradient in bf16
  python -m loka plan "$rep" -o "bench/plans/fwd${tag}.plan.json" --kernels bf16 \
    --assign '*.fmb.mlp.*:fwd=cublas-rowwise-fastacc' \
    --assign 'over_arch.mlp.0:fwd=cublas-rowwise-fastacc' \
    --assign 'over_arch.mlp.2:fwd=cublas-rowwise-fastacc'
done
