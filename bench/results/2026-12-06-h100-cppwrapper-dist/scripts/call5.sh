python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
timeout 55 torchrun --nproc_per_node 1 bench/distributed/run.py --preset paper --mods paper \
  --arms bf16,torchao,loka --plan bench/plans/wukong-paper-tuned.merge.plan.json --steps 20 --warmup 5 \
  --out $OUT/dist_w1_eager_fused.json > $OUT/dist_eager_fused.log 2>&1
tail -5 $OUT/dist_eager_fused.log
