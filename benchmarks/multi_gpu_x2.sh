#!/usr/bin/env bash
# The 2-GPU benchmarks in one call of at most 10 minutes, on a machine with 2 GPUs, python3 with torch and
# transformers, and no uv: FSDP2 scaling (1 vs 2 trainer ranks), then reverse-text RL with the server on GPU 0 and
# the trainer on GPU 1, weights through the filesystem and through the NCCL broadcast.
#
# Before, where uv works (packs verifiers, the web stack and pydantic for CPython 3.12; see that script):
#     python benchmarks/carry_site.py --wheels .whl --out .whl/site.tar.gz
# There, from the repository root, with .whl carried along:
#     bash benchmarks/multi_gpu_x2.sh OUT_DIR
# Writes gpu.txt, fsdp_scaling_x2.json, multi_gpu_x2.json and a log per benchmark into OUT_DIR. Without
# .whl/site.tar.gz, fsdp_scaling needs pydantic importable and multi_gpu runs in its driver mode (needs fastapi and
# uvicorn) or fails. Time limits (seconds): FSDP_LIMIT_S (default 215) and MULTI_LIMIT_S (370) for the two stages.
set -uo pipefail
out=${1:?usage: multi_gpu_x2.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
# NVLink multicast stays off everywhere, also in processes started with their own environment.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
site=/tmp/primerl-site
if [ -f .whl/site.tar.gz ]; then
    mkdir -p "$site" && tar xzf .whl/site.tar.gz -C "$site" || exit 1
fi
export PYTHONPATH="$site:$PWD/src:$PWD/environments/reverse_text${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())') || exit 1
if [ "$gpus" -lt 2 ]; then
    echo "multi_gpu_x2: needs 2 GPUs, $gpus visible" >&2
    exit 2
fi
{
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    nvidia-smi topo -m
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
    python3 -c 'import verifiers, fastapi, uvicorn; print("verifiers", verifiers.__version__)' 2>&1 | tail -n 1
} 2>&1 | tee "$out/gpu.txt"

run() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=20 "$limit" "$@" > "$out/$name.log" 2>&1
    local code=$?
    tail -n 40 "$out/$name.log"
    echo "=== $name: exit $code after $((SECONDS - t0)) s"
}

run fsdp_scaling "${FSDP_LIMIT_S:-215}" python3 benchmarks/fsdp_scaling.py --timeout-s 95 \
    --out "$out/fsdp_scaling_x2.json"
run multi_gpu "${MULTI_LIMIT_S:-370}" python3 benchmarks/multi_gpu.py --timeout-s 150 --out "$out/multi_gpu_x2.json"
