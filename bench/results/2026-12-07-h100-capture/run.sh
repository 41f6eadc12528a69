#!/usr/bin/env bash
# The device calls of this folder (NOTE.md): `bash run.sh all|small|serve|train|loaded` with $OUT set,
# from the repository's root, torchao's wheel in .whl/.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=.:/tmp/site
R='bench/results/2026-12-06-h100-assembled/eval_set.{model}.b{batch}.report.json'
python3 -c "from loka.bench.env import source_digest as s; print('source', s())" >> $OUT/gpu.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $OUT/gpu.txt
grep -c "class CapturedStep" loka/timing.py >> $OUT/gpu.txt
S="--models dcnv2,dlrm --batch-sizes 4096 --modes serve --optimize-trials 4 --optimize-rounds 3 \
 --steps 30 --warmup 10 --paired-rounds 6 --paired-steps 10 --no-save-plans --report $R"
T="--batch-sizes 4096 --modes train --optimize-trials 4 --optimize-rounds 3 --steps 20 \
 --warmup 5 --paired-rounds 4 --paired-steps 10 --no-save-plans --report $R"
V=bf16,loka-static,loka-optimize-static
case "$1" in
all)  # the calls below in one, cut to fit one command
  timeout 150 python3 bench/eval_set.py $S --variants $V --graphs-only --graph-capture step \
    --time-budget-s 130 --out $OUT/serve_step.json > $OUT/serve_step.log 2>&1
  timeout 80 python3 bench/eval_set.py $S --variants bf16,loka-static --graphs-only \
    --time-budget-s 60 --out $OUT/serve_trees.json > $OUT/serve_trees.log 2>&1
  timeout 130 python3 bench/eval_set.py $T --models dcnv2 --variants bf16,loka,loka-optimize \
    --graphs-only --graph-capture step --time-budget-s 100 --out $OUT/train_step_dcnv2.json \
    > $OUT/train_step_dcnv2.log 2>&1
  timeout 150 python3 bench/eval_set.py $T --models wukong --variants bf16,loka \
    --graphs-only --graph-capture step --time-budget-s 120 --out $OUT/train_step_wukong.json \
    > $OUT/train_step_wukong.log 2>&1 ;;
small)  # the least of "all", for what device time was left
  timeout 120 python3 bench/eval_set.py $S --variants $V --graphs-only --graph-capture step \
    --time-budget-s 100 --out $OUT/serve_step.json > $OUT/serve_step.log 2>&1
  timeout 60 python3 bench/eval_set.py $S --variants bf16,loka-static --graphs-only \
    --time-budget-s 40 --out $OUT/serve_trees.json > $OUT/serve_trees.log 2>&1
  timeout 80 python3 bench/eval_set.py $T --models dcnv2 --variants bf16,loka \
    --graphs-only --graph-capture step --time-budget-s 50 --out $OUT/train_step_dcnv2.json \
    > $OUT/train_step_dcnv2.log 2>&1 ;;
serve)
  timeout 90 python3 -m pytest -q -p no:randomly tests/test_timing.py -k captured \
    >> $OUT/gpu.txt 2>&1
  timeout 200 python3 bench/eval_set.py $S --variants $V --graphs-only --graph-capture step \
    --time-budget-s 180 --out $OUT/serve_step.json > $OUT/serve_step.log 2>&1
  timeout 150 python3 bench/eval_set.py $S --variants $V --graphs-only \
    --time-budget-s 130 --out $OUT/serve_trees.json > $OUT/serve_trees.log 2>&1
  timeout 150 python3 bench/eval_set.py $S --variants $V --no-graphs --optimize-synchronized \
    --inductor-config cpp_wrapper=true --time-budget-s 130 --out $OUT/serve_nographs.json \
    > $OUT/serve_nographs.log 2>&1 ;;
train)
  timeout 420 python3 bench/eval_set.py $T --models wukong,dcnv2,dlrm \
    --variants bf16,loka,loka-optimize --graphs-only --graph-capture step \
    --time-budget-s 380 --out $OUT/train_step.json > $OUT/train_step.log 2>&1
  timeout 150 python3 bench/eval_set.py $T --models dcnv2,dlrm --variants bf16,loka \
    --graphs-only --time-budget-s 130 --out $OUT/train_trees.json > $OUT/train_trees.log 2>&1 ;;
loaded)
  # a busy loop on the core the run is pinned to: the host at about half its speed
  taskset -c 3 python3 -c "while True: pass" & BUSY=$!
  timeout 400 taskset -c 3 python3 bench/eval_set.py $S --models dcnv2 --variants $V \
    --no-graphs --optimize-synchronized --inductor-config cpp_wrapper=true \
    --time-budget-s 380 --out $OUT/serve_loaded.json > $OUT/serve_loaded.log 2>&1
  kill $BUSY ;;
esac
ls -la $OUT >> $OUT/gpu.txt
