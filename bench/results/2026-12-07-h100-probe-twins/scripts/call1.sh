set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
date -u +%FT%TZ > $OUT/times.txt
python3 -c "import torch._inductor.config as c; print('static_launch_user_defined_triton_kernels', c.static_launch_user_defined_triton_kernels, 'use_static_cuda_launcher', c.use_static_cuda_launcher)" >> $OUT/times.txt 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 4 tests/kernels/test_twin_bits.py > $OUT/all.log 2>&1; tail -5 $OUT/all.log
OLD='{"twin_errors": false, "tune_ahead": false, "progress": false}'
date -u +%FT%TZ >> $OUT/times.txt
timeout 130 python3 bench/probe_time.py --fresh-caches --no-profile --probe-config "$OLD" --out $OUT/probe_old.json >> $OUT/all.log 2>&1
date -u +%FT%TZ >> $OUT/times.txt
timeout 130 python3 bench/probe_time.py --fresh-caches --no-profile --probe-config '{"progress": false}' --out $OUT/probe_new.json >> $OUT/all.log 2>&1
date -u +%FT%TZ >> $OUT/times.txt
timeout 150 python3 bench/probe_time.py --fresh-caches --probe-config "$OLD" --out $OUT/probe_old_prof.json >> $OUT/all.log 2>&1
grep -a "^probe wukong" $OUT/all.log
date -u +%FT%TZ >> $OUT/times.txt
R='bench/results/2026-12-06-h100-assembled/eval_set.{model}.b{batch}.report.json'
for cfg in on off; do
  X=""; [ $cfg = on ] && X="--inductor-config static_launch_user_defined_triton_kernels=true"
  timeout 80 python3 bench/eval_set.py --models dcnv2 --batch-sizes 4096 --modes serve --no-graphs \
    --variants bf16,loka $X --steps 20 --warmup 5 --paired-rounds 4 --paired-steps 10 --profile-steps 3 \
    --time-budget-s 70 --no-save-plans --report "$R" --out $OUT/sl_$cfg.json > $OUT/sl.log 2>&1; tail -c 1500 $OUT/sl.log >> $OUT/all.log; rm $OUT/sl.log
done
date -u +%FT%TZ >> $OUT/times.txt
ls -la $OUT
