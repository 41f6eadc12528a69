set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
(while true; do echo "== $(date +%T) $(cut -d' ' -f1-3 /proc/loadavg)"; ps -eo pcpu,etimes,rss,args --sort=-pcpu | head -6 | cut -c1-160; sleep 4; done) > $OUT/monitor.log 2>&1 &
MON=$!
date +%T
timeout 420 python3 bench/eval_set.py --models wukong --batch-sizes 4096 --modes serve --variants bf16,loka-static,loka-optimize-static --no-graphs --steps 20 --warmup 5 --paired-rounds 3 --paired-steps 10 --optimize-trials 2 --optimize-rounds 2 --no-save-plans --time-budget-s 400 --out $OUT/eval_wukong_order.json > $OUT/eval_wukong_order.log 2>&1
echo rc=$?; date +%T
kill $MON
grep -v "probe: \|Warning\|warn_once\|Configuration class" $OUT/eval_wukong_order.log | tail -6
grep "^==" $OUT/monitor.log | tail -60 | awk 'NR%3==1'
