#!/usr/bin/env bash
# Everything that needs a GPU, in one command for a machine that has one:
#
#   bash benchmarks/gpu_check.sh          # logs under $OUT (or ./gpu_check_out)
#
# Builds torchdist_ext in place against that machine's own torch (no venv, no
# downloads; torch 2.11 and later build), for its GPU's architecture only, then,
# most valuable first, each step under its own time limit so that one hang
# cannot eat the rest:
#   1. the CUDA tests (tests/ops/test_cuda.py: every CUDA kernel and CUDA
#      dispatch against torch on the same device and against our CPU kernels;
#      the main job on one GPU);
#   2. the single-GPU kernel benchmarks: the planner's kernel efficiencies (bf16 and
#      fp8 GEMMs, causal SDPA, copy bandwidth, against the GPU's preset); the MoE permute / unpermute against
#      torch's index ops and torch._grouped_mm against a loop of per-expert
#      matmuls; the fp8 cast + amax and the fp8 linear against bf16 (with the
#      ledger's collective counts of one fp8 TP+SP+FSDP2 step on CPU ranks);
#      cross-entropy and the log-sum-exp merge against the unfused torch
#      expressions; each with the fraction of the measured copy bandwidth;
#   3. the main job on the GPUs it finds (one GPU, or an odd count: dp only;
#      even: dp x tp=2), NCCL, bf16, printing tokens/s and MFU, --check against
#      one fp32 process; then again with fp8 GEMMs (--fp8 delayed), and with
#      FSDP2 gathering the weights in fp8 (--fp8-all-gather); with the
#      communication ledger wrapping NCCL (--ledger: the planner's memory and
#      bytes beside the measured ones); compiled (--compile);
#   4. the CPU tests that depend most on the CPU model (its ISA clones, the
#      bytes ATen's kernels allocate, fp8 bits, inductor's vector ISA): the GPU
#      host's CPU is another model than the CI machines'.
# Writes gpu_check.log (everything) and build.log under the output folder.
# Exits non-zero when the build, a test or a benchmark fails or runs out of time.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check_out}
mkdir -p "$out"
log="$out/gpu_check.log"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TDX_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())') || exit 1
  export TORCH_CUDA_ARCH_LIST
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  lscpu | grep -E "Model name|Flags" | cut -c1-400
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
} 2>&1 | tee "$log"

start=$(date +%s)
if ! timeout 420 python3 setup.py build_ext --inplace >"$out/build.log" 2>&1; then
  tail -n 60 "$out/build.log" | tee -a "$log"
  exit 1
fi
echo "built in $(($(date +%s) - start)) s" | tee -a "$log"

status=0
# step SECONDS COMMAND...: runs COMMAND under a time limit, appending its output to the log.
step() {
  local limit=$1
  shift
  echo "=== $* (limit ${limit} s)" | tee -a "$log"
  local began=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== rc $rc after $(($(date +%s) - began)) s" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
}

step 240 python3 -m pytest -q -p no:cacheprovider tests/ops/test_cuda.py tests/examples/test_train_llama.py -m cuda
for bench in bench_planner_calibration bench_moe_kernels bench_fp8 bench_cross_entropy bench_lse_merge; do
  step 120 python3 -m "benchmarks.$bench" --device cuda
done
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
tp=$([ $((gpus % 2)) -eq 0 ] && echo 2 || echo 1)
for precision in "" "--fp8 delayed" "--fp8 delayed --fp8-all-gather"; do
  # shellcheck disable=SC2086  # $precision is a few words or none
  step 150 python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" examples/train_llama.py \
    --device cuda --tp "$tp" --steps 30 --batch $((8 * gpus / tp)) --check $precision
done
step 90 python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" examples/train_llama.py \
  --device cuda --tp "$tp" --steps 5 --batch $((8 * gpus / tp)) --ledger
step 180 python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" examples/train_llama.py \
  --device cuda --tp "$tp" --steps 10 --batch $((8 * gpus / tp)) --compile
step 300 python3 -m pytest -q -p no:cacheprovider -m "not cuda" tests/test_cpu_isa.py \
  tests/planner/test_activation_memory.py tests/ops/test_fp8.py tests/fp8 tests/testing/test_inductor_isa.py
exit $status
