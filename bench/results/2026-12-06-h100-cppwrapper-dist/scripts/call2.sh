set -x
export PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
timeout 230 torchrun --nproc_per_node 1 bench/distributed/run.py --preset paper --mods paper \
  --arms bf16,loka --plan bench/plans/wukong-paper-tuned.merge.plan.json --compile \
  --steps 10 --warmup 3 --out $OUT/dist_w1_compiled.json > $OUT/dist.log 2>&1
ls -la $OUT
