set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/gpu.txt
python3 -c "from loka.bench.env import source_digest; print(source_digest())" > $OUT/source.txt
R='tmp_rep/{model}.b{batch}.report.json'
A=bench/results/2026-12-06-h100-assembled
timeout 200 python3 bench/eval_set.py --models dcnv2,dlrm --batch-sizes 4096 --modes serve --no-graphs \
  --variants bf16,loka-static --inductor-config cpp_wrapper=true --steps 20 --warmup 5 \
  --paired-rounds 4 --paired-steps 10 --profile-steps 3 --time-budget-s 150 --no-save-plans \
  --report "$R" --out $OUT/cppw.json > $OUT/cppw.log 2>&1
timeout 100 python3 bench/step_host.py --model dcnv2 --batch-size 4096 --plan $A/eval_set.dcnv2.b4096.plan.serve.json \
  --prefix-sites 1,2,4 --skip-guards --rounds 6 --steps 20 --profile-steps 20 --top 40 --out $OUT/host_dyn.json > $OUT/host_dyn.log 2>&1
timeout 150 python3 bench/eval_set.py --models dcnv2 --batch-sizes 4096 --modes serve \
  --variants bf16,loka-optimize-static --optimize-trials 2 --optimize-rounds 2 --steps 20 --warmup 5 \
  --paired-rounds 4 --paired-steps 10 --profile-steps 3 --time-budget-s 110 --no-save-plans \
  --report "$R" --out $OUT/opt.json > $OUT/opt.log 2>&1
ls -la $OUT
