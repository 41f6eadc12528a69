set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
P=bench/plans/wukong-paper-tuned.merge.plan.json
timeout 200 torchrun --nproc_per_node 1 bench/distributed/run.py --preset paper --mods paper \
  --arms bf16,torchao,loka --plan $P --compile --steps 20 --warmup 5 \
  --out $OUT/dist_w1_compiled.json > $OUT/dist_compiled.log 2>&1
timeout 70 torchrun --nproc_per_node 1 bench/distributed/run.py --preset paper --mods paper \
  --arms bf16,torchao,loka --plan $P --steps 20 --warmup 5 \
  --out $OUT/dist_w1_eager.json > $OUT/dist_eager.log 2>&1
ls -la $OUT
