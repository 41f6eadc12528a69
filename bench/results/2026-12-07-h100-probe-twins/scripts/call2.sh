set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
date -u +%FT%TZ > $OUT/times.txt
OLD='{"twin_errors": false, "tune_ahead": false, "progress": false}'
timeout 100 python3 bench/probe_time.py --fresh-caches --no-profile --probe-config '{"progress": false}' --out $OUT/probe_new2.json > $OUT/all.log 2>&1
date -u +%FT%TZ >> $OUT/times.txt
timeout 100 python3 bench/probe_time.py --fresh-caches --no-profile --probe-config "$OLD" --out $OUT/probe_old2.json >> $OUT/all.log 2>&1
grep -a "^probe wukong" $OUT/all.log
date -u +%FT%TZ >> $OUT/times.txt
P=bench/plans/wukong-paper-tuned.merge.plan.json
timeout 250 torchrun --nproc_per_node 1 bench/distributed/run.py --preset paper --mods paper \
  --arms bf16,torchao,loka --plan $P --compile --steps 20 --warmup 5 --profile-steps 3 \
  --out $OUT/dist_w1_children.json > $OUT/dist.log 2>&1
tail -c 1500 $OUT/dist.log
date -u +%FT%TZ >> $OUT/times.txt
