#!/usr/bin/env bash
# Everything that needs a GPU, in one command for a machine that has one:
#
#   bash benchmarks/gpu_check.sh          # logs under $OUT (or ./gpu_check_out)
#
# Builds torchdist_ext in place against that machine's own torch (no venv, no
# downloads), for its GPU's architecture only, then runs the main job on the
# GPUs it finds (one GPU, or an odd count: dp only; even: dp x tp=2; NCCL, bf16, printing tokens/s
# and MFU, and --check against one fp32 process), the CUDA tests
# (tests/ops/test_cuda.py: every CUDA kernel and CUDA dispatch against torch on
# the same device, and against our CPU kernels; the main job on one GPU) and the
# single-GPU kernel benchmarks (cross-entropy and the log-sum-exp merge against
# the unfused torch expressions, the MoE permute / unpermute against torch's
# index ops, the fp8 cast + amax, each with the fraction of the measured copy
# bandwidth reached, torch._grouped_mm against a loop of per-expert matmuls, the
# fp8 linear against bf16), and the main job again with fp8 GEMMs (--fp8
# delayed). Exits non-zero when the build, a test or a benchmark fails.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TDX_CUDA=1 MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$(python3 -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())') || exit 1
  export TORCH_CUDA_ARCH_LIST
fi

{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
} 2>&1 | tee "$out/machine.txt"

start=$(date +%s)
if ! python3 setup.py build_ext --inplace >"$out/build.log" 2>&1; then
  tail -n 60 "$out/build.log"
  exit 1
fi
echo "built in $(($(date +%s) - start)) s"

status=0
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
tp=$([ $((gpus % 2)) -eq 0 ] && echo 2 || echo 1)
python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" examples/train_llama.py --device cuda \
  --tp "$tp" --steps 30 --batch $((8 * gpus / tp)) --check 2>&1 | tee "$out/main_job.log" || status=1
python3 -m torch.distributed.run --standalone --nproc-per-node "$gpus" examples/train_llama.py --device cuda \
  --tp "$tp" --steps 30 --batch $((8 * gpus / tp)) --fp8 delayed --check 2>&1 | tee "$out/main_job_fp8.log" || status=1
python3 -m pytest -q -p no:cacheprovider tests/ops/test_cuda.py tests/examples/test_train_llama.py -m cuda 2>&1 \
  | tee "$out/test_cuda.log" || status=1
for bench in bench_cross_entropy bench_lse_merge bench_moe_kernels bench_fp8; do
  python3 "benchmarks/$bench.py" --device cuda 2>&1 | tee "$out/$bench.log" || status=1
done
exit $status
