#!/usr/bin/env bash
# One benchmark session on a GPU machine that cannot reach the network: installs the
# wheels carried in .whl/ (torchao, fbgemm-gpu-genai) beside the machine's own torch, then
# runs the stages named on the command line, each under its own time limit, logging
# everything to $OUT/session.log. Results are JSON files under $OUT, and all of $OUT is
# packed into $OUT/results.tgz at the end.
#
#   OUT=/tmp/out LOKA_COMMIT=$(git rev-parse --short HEAD) bash bench/gpu_session.sh selftest bench
#
# Stages: env, selftest, gputests, kernels, inline, bench, fused, quality, probe, evalset, nebudget,
# traced (bench/traced_check.py: compiled steps launch LoKA's Triton kernels from Inductor's
# code; wall against GPU time), quantizers (bench/bench_quantizers.py: the Triton quantizers and
# PyTorch's compiled ones, QUANT_ARGS), probetime (bench/probe_time.py --fresh-caches: a training
# Probe's wall time on empty caches and its compile-cache counts, PROBETIME_ARGS), cachekeys
# (the same Probe under bench/cache_keys.py: which parts of the parent's and its compiling
# children's cache keys differ), distributed (bench/distributed/run.py under torchrun on
# DIST_GPUS GPUs), stepcode (bench/step_code.py compiled for real: the kernels and bytes of
# the GPU's own Inductor, against the CPU-simulated files in bench/results). Extra
# arguments for a stage come from the environment: BENCH_ARGS, KERNEL_ARGS, INLINE_ARGS,
# FUSED_ARGS, QUALITY_ARGS, PROBE_ARGS, TRACED_ARGS, DIST_ARGS, STEPCODE_ARGS, EVALSET_ARGS (bench/eval_set.py: the evaluation set
# through the public path; its --time-budget-s should end inside EVALSET_LIMIT), NE_ARGS
# (nebudget: bench/ne_sources.py --mode plan, the default plan's paired NE change and its NE
# budget at paper scale; to continue a run cut short, give it --plan-in and --resume with the
# files an earlier call returned), GPUTEST_FILES (the test files gputests runs; by default those
# with compiled Triton kernels, which the CPU suite runs only under the Triton interpreter).
set -u
OUT=${OUT:-bench/results/session}
mkdir -p "$OUT"
LOG=$OUT/session.log
export PYTHONUNBUFFERED=1
export LOKA_COMMIT=${LOKA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}

# (a default holding a brace, set apart: inside ${VAR:-...} the brace would end the expansion)
PROBETIME_DEFAULT='--probe-config {"progress":false}'

stage() {  # stage NAME LIMIT_S CMD...: run CMD under a time limit, log it, never abort
  local name=$1 limit=$2
  shift 2
  echo "=== $name start $(date +%T) (limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1
  echo "=== $name rc=$? end $(date +%T)" | tee -a "$LOG"
}

for s in "$@"; do
  case $s in
    env) stage env 60 python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name()); import loka.kernels as k; print([x.name for x in k.available('cuda')]); from loka.kernels.adapters import FAILED; print('adapter failures:', FAILED)" ;;
    selftest) stage selftest "${SELFTEST_LIMIT:-120}" python3 bench/gpu_selftest.py --out "$OUT/selftest.json" ;;
    gputests) stage gputests "${GPUTEST_LIMIT:-180}" python3 -m pytest -q -p no:cacheprovider -n 6 \
        --junitxml="$OUT/gputests.xml" ${GPUTEST_FILES:-tests/mods/test_fused.py \
        tests/kernels/test_triton_quantize.py tests/kernels/test_triton_gemm.py tests/kernels/test_fp8_kernels.py \
        tests/kernels/test_adapters.py tests/integrations/test_torchao.py \
        tests/dispatch/test_compiler_native.py tests/test_timing.py} ;;
    kernels) stage kernels "${KERNELS_LIMIT:-240}" python3 bench/bench_kernels.py --out "$OUT/kernels.json" ${KERNEL_ARGS:-} ;;
    bench) stage bench "${BENCH_LIMIT:-420}" python3 bench/run_all.py --device cuda --out "$OUT/bench.json" ${BENCH_ARGS:-} ;;
    inline) stage inline "${INLINE_LIMIT:-150}" python3 bench/bench_inline.py --out "$OUT/inline.json" ${INLINE_ARGS:-} ;;
    fused) stage fused "${FUSED_LIMIT:-90}" python3 bench/bench_fused_norm.py --out "$OUT/fused_norm.json" ${FUSED_ARGS:-} ;;
    quality) stage quality "${QUALITY_LIMIT:-300}" python3 bench/quality_at_scale.py --out "$OUT/quality.json" ${QUALITY_ARGS:-} ;;
    probe) stage probe "${PROBE_LIMIT:-240}" python3 bench/bench_probe.py --out "$OUT/probe.json" ${PROBE_ARGS:-} ;;
    evalset) stage evalset "${EVALSET_LIMIT:-540}" python3 bench/eval_set.py --out "$OUT/eval_set.json" ${EVALSET_ARGS:-} ;;
    traced) stage traced "${TRACED_LIMIT:-300}" python3 bench/traced_check.py --out "$OUT/traced.json" ${TRACED_ARGS:-} ;;
    distributed) stage distributed "${DIST_LIMIT:-300}" torchrun --nproc_per_node "${DIST_GPUS:-1}" \
        bench/distributed/run.py --preset paper --mods paper --out "$OUT/distributed.json" ${DIST_ARGS:-} ;;
    nebudget) stage nebudget "${NE_LIMIT:-560}" env CUBLAS_WORKSPACE_CONFIG=:4096:8 \
        python3 bench/ne_sources.py --mode plan --device cuda --out "$OUT/ne_plan.json" \
        ${NE_ARGS:---models wukong:paper --batch-size 4096 --lr 1e-3 --warmup-steps 100 --start-steps 250 --steps 30 --seeds 0,1,2,3,4,5 --cache-batches --plan-kernel cublas-rowwise --plan-out $OUT/plan.default.json --budget-plan-out $OUT/plan.ne.json --speed-steps 20} ;;
    stepcode) stage stepcode "${STEPCODE_LIMIT:-240}" python3 bench/step_code.py --out "$OUT/step_code.json" \
        ${STEPCODE_ARGS:---model wukong --scale paper --batch-size 4096 --plan bench/results/2026-12-05-h200-evalset/wukong.b4096.plan.train.json --families cublas-rowwise-fastacc,cublas-tensorwise-fastacc,triton-rowwise-cublas-fastacc --delayed} ;;
    quantizers) stage quantizers "${QUANT_LIMIT:-150}" python3 bench/bench_quantizers.py \
        --out "$OUT/quantizers.json" ${QUANT_ARGS:---shapes 4096x2048,4096x8192,16384x2048} ;;
    probetime) stage probetime "${PROBETIME_LIMIT:-150}" python3 bench/probe_time.py --fresh-caches \
        --no-profile --report-out "$OUT/probe_time.report.json" --out "$OUT/probe_time.json" \
        ${PROBETIME_ARGS:-$PROBETIME_DEFAULT} ;;
    cachekeys) stage cachekeys "${CACHEKEYS_LIMIT:-200}" python3 bench/cache_keys.py run \
        --dir /tmp/loka-keylogs-$$ -- python3 bench/probe_time.py --fresh-caches --no-profile \
        --out "$OUT/probe_time_keys.json" ${PROBETIME_ARGS:-$PROBETIME_DEFAULT}
      stage cachekeys-compare 60 python3 bench/cache_keys.py compare --dir /tmp/loka-keylogs-$$ \
        --out "$OUT/cache_keys.json" ;;
    *) echo "unknown stage $s" | tee -a "$LOG" ;;
  esac
done
# the device returns at most 8 files: everything goes into one archive as well
tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/results.tgz"
grep -E "^(PASS|FAIL)|^===|x[0-9.]+ vs|FAILED|Error| passed| failed" "$LOG" | tail -150
