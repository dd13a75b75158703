#!/usr/bin/env bash
# The GPU checks, as one script for a GPU node: what the machine has, the tests that take their
# GPU path where torch sees a GPU (the HF engine, the torch and Megatron trainers, engine
# placement), a short `astraflow run` of the main example with its trainer and rollout engine on
# the GPU, the RaaS-node-vs-bare-engine benchmark on the GPU, and, where vLLM's CUDA build is
# installed, the same for the vLLM engine (its test tier, vLLM vs HF tokens/s, a run, the node's
# overhead). Each step's log and a summary (summary.txt) go to OUTDIR. Multi-GPU tests (TP/DP over
# NCCL, two engines on two GPUs) skip themselves on a host with fewer GPUs than they need.
#
#   bash tests/run_gpu.sh [OUTDIR]     # default runs/gpu-check; PYTHON=... picks the interpreter
#   GPU_CHECK_STEPS="tests run" bash tests/run_gpu.sh   # only some steps
#   steps: env tests run bench, and with vLLM installed vtests vcompare vrun vbench
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:-runs/gpu-check}
# the project's venv where it exists (tests/run.sh makes it), else the python3 on PATH
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; else PY=${PYTHON:-python3}; fi
STEPS=${GPU_CHECK_STEPS:-env tests run bench}
if [ -z "${GPU_CHECK_STEPS:-}" ] && "$PY" -c "import vllm" 2>/dev/null; then
  STEPS="$STEPS vtests vcompare vrun vbench"
fi
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
SUMMARY="$OUTDIR/summary.txt"
: > "$SUMMARY"
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log it, record its outcome
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1
  local rc=$?
  printf '%-6s rc=%-3s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$(tail -n 1 "$OUTDIR/$name.log")" | tee -a "$SUMMARY"
}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "no CUDA device visible to $PY: nothing to check here" | tee -a "$SUMMARY"
  exit 2
fi

run_example() {  # run_example NAME [--set ...]: the main example, short, trainer and engine on the GPU (bf16)
  local name=$1
  shift
  local run_dir="$OUTDIR/$name-run"
  rm -rf "$run_dir"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader -l 5 \
    >> "$OUTDIR/$name-gpu_apps.log" 2>&1 &
  local smi_pid=$!
  step "$name" "${GPU_CHECK_RUN_S:-200}" "$PY" -m astraflow run examples/math/config.yaml --run-dir "$run_dir" \
    --set run.max_steps="${GPU_CHECK_RUN_STEPS:-100}" --set run.timeout_s=180 \
    --set policies.solver.model="$OUTDIR/math-model" --set policies.solver.init.warm_start_seconds="${GPU_CHECK_WARM_S:-90}" \
    --set policies.solver.trainer.precision=bf16 --set rollout.engine.dtype=bf16 \
    --set partitions.rollout.gpus_per_node=1 "$@"
  kill "$smi_pid" 2>/dev/null
  cp "$run_dir/summary.json" "$OUTDIR/$name-summary.json" 2>/dev/null
  { grep -h "held-out accuracy .* -> " "$OUTDIR/$name.log" | tail -n 1
    echo "GPU processes seen during the run (nvidia-smi every 5 s): $(cut -d, -f1,2 "$OUTDIR/$name-gpu_apps.log" | sort -u | tr '\n' ';')"; } | sed "s/^/$name    /" >> "$SUMMARY"
}

for s in $STEPS; do
  case $s in
    env)
      step env 60 bash -c "nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
        $PY -c 'import torch, transformers, sys; print(sys.version.split()[0], \"torch\", torch.__version__,
          \"cuda\", torch.version.cuda, \"gpus\", torch.cuda.device_count(), \"transformers\", transformers.__version__)';
        $PY -c 'import megatron.core as m; print(\"megatron-core\", m.__version__)' || echo 'megatron-core: not installed';
        $PY -c 'import vllm; print(\"vllm\", vllm.__version__)' || echo 'vllm: not installed'" ;;
    tests)
      # a worker per GPU test module group; each test's own timeout stays as in the suite
      step tests "${GPU_CHECK_TESTS_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -n "${GPU_CHECK_WORKERS:-8}" -rs \
        tests/test_models.py tests/rollout/test_hf_engine.py tests/rollout/test_engine_pool.py \
        tests/rollout/test_weight_sync.py tests/training tests/megatron ;;
    run)
      run_example run ;;
    vtests)
      # the vLLM tier, serially: each test's engine takes a fifth of the GPU (tests/vllm/conftest.py)
      step vtests "${GPU_CHECK_VTESTS_S:-300}" "$PY" -m pytest -v --tb=short -p no:cacheprovider -rs \
        tests/vllm ;;
    vcompare)
      step vcompare "${GPU_CHECK_VCOMPARE_S:-120}" "$PY" benchmarks/engine_compare.py --reps 1 --prompts 256 \
        --max-new-tokens 64 ;;
    vrun)
      run_example vrun --set rollout.engine.type=vllm ;;
    vbench)
      step vbench "${GPU_CHECK_VBENCH_S:-120}" "$PY" benchmarks/rollout_overhead.py --engine vllm --device cuda:0 \
        --reps 1 --groups 100 --capacity 256 --max-batch 128 --tls-only ;;
    bench)
      step bench "${GPU_CHECK_BENCH_S:-120}" "$PY" benchmarks/rollout_overhead.py --device cuda:0 --reps 1 \
        --groups 100 --capacity 256 --max-batch 128 --tls-only ;;
  esac
done
echo "logs: $OUTDIR"
