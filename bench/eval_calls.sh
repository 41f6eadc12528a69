#!/usr/bin/env bash
# The evaluation set's device calls, each sized for one 600-s device command:
#   OUT=/tmp/out bash bench/eval_calls.sh train|serve|aoti|loaded
# from the repository's root, torchao's wheel in .whl/ (see bench/results/README.md). They
# plan from the recorded reports of bench/results/2026-12-06-h100-assembled/ (no Probe).
#   train:  the GPU test of loka.timing.CapturedStep; training rows of the three models with
#           whole steps captured, loka.optimize among them
#   serve:  serving rows with whole steps captured: the Wukong at 4096, all at 16384
#   aoti:   serving without CUDA graphs as AOTInductor packages, then torch.compile beside
#   loaded: the DCNv2's no-graph serving rows on a host core that a busy loop shares
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=.:/tmp/site
A=bench/results/2026-12-06-h100-assembled
R4="$A/eval_set.{model}.b{batch}.report.json"
R16="$A/eval_b16384.{model}.b{batch}.report.json"
python3 -c "from loka.bench.env import source_digest as s; print('source', s())" >> $OUT/gpu.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/gpu.txt
T="--batch-sizes 4096 --modes train --optimize-trials 4 --optimize-rounds 3 --steps 20 \
 --warmup 5 --paired-rounds 4 --paired-steps 10 --no-save-plans --report $R4"
S="--modes serve --optimize-trials 4 --optimize-rounds 3 --steps 30 --warmup 10 \
 --paired-rounds 6 --paired-steps 10 --no-save-plans"
V=bf16,loka-static,loka-optimize-static
case "$1" in
train)  # the CUDA test of CapturedStep; training captured through loka.optimize
  timeout 90 python3 -m pytest -q -p no:randomly tests/test_timing.py -k captured \
    >> $OUT/gpu.txt 2>&1
  timeout 480 python3 bench/eval_set.py $T --models dcnv2,dlrm,wukong \
    --variants bf16,loka,loka-optimize --graphs-only --graph-capture step \
    --time-budget-s 420 --out $OUT/train_step.json > $OUT/train_step.log 2>&1 ;;
serve)  # every serving row with graphs captured: Wukong at 4096, all at 16384
  timeout 200 python3 bench/eval_set.py $S --models wukong --batch-sizes 4096 --report "$R4" \
    --variants $V --graphs-only --graph-capture step --time-budget-s 180 \
    --out $OUT/serve_step_b4096.json > $OUT/serve_step_b4096.log 2>&1
  timeout 360 python3 bench/eval_set.py $S --models dcnv2,wukong --batch-sizes 16384 \
    --report "$R16" --variants $V --graphs-only --graph-capture step --time-budget-s 330 \
    --out $OUT/serve_step_b16384.json > $OUT/serve_step_b16384.log 2>&1 ;;
aoti)  # serving without CUDA graphs: AOTInductor packages, then torch.compile beside them
  # (AOTI_S: seconds for the packages' rows, 300 unless set; torch.compile's get 120;
  # AOTI_MODELS: the models, dcnv2,dlrm unless set)
  A_S=${AOTI_S:-300}
  M=${AOTI_MODELS:-dcnv2,dlrm}
  timeout $((A_S + 60)) python3 bench/eval_set.py $S --models $M --batch-sizes 4096 \
    --report "$R4" --variants $V --no-graphs --serve-runtime aoti --time-budget-s $A_S \
    --out $OUT/serve_aoti.json > $OUT/serve_aoti.log 2>&1
  timeout 150 python3 bench/eval_set.py $S --models $M --batch-sizes 4096 --report "$R4" \
    --variants bf16,loka-static --no-graphs --time-budget-s 120 \
    --out $OUT/serve_compile.json > $OUT/serve_compile.log 2>&1 ;;
loaded)
  # a busy loop on the core the run is pinned to: the host at about half its speed
  taskset -c 3 python3 -c "while True: pass" & BUSY=$!
  timeout 400 taskset -c 3 python3 bench/eval_set.py $S --models dcnv2 --batch-sizes 4096 \
    --report "$R4" --variants $V --no-graphs --optimize-synchronized \
    --inductor-config cpp_wrapper=true --time-budget-s 380 --out $OUT/serve_loaded.json \
    > $OUT/serve_loaded.log 2>&1
  kill $BUSY ;;
esac
ls -la $OUT >> $OUT/gpu.txt
