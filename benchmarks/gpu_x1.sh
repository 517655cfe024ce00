#!/usr/bin/env bash
# The one-GPU benchmarks in one call of at most ~9 minutes, on a machine with one GPU, python3 with torch and
# transformers, and no uv:
#   1. weight_transfer: P4 weight-update latency with the real trainer publisher and `primerl inference` server on
#      the GPU: filesystem, broadcast (auto -> gloo on a shared GPU), broadcast forced to nccl on the shared GPU
#      (expected: refused -> filesystem fallback; plus a raw NCCL probe), and nccl across 2 GPUs if 2 are visible.
#   2. fsdp_one_rank (if time is left): 1-rank FSDP2 trainer steps over an NCCL process group under torchrun, the
#      multi-GPU trainer's code path on one device (loss, tokens/s, multi-rank export vs DTensor gathers).
#
# Before, where uv works (packs fastapi, uvicorn, pydantic & co. for CPython 3.12; see that script):
#     python benchmarks/carry_site.py --wheels .whl --out .whl/site.tar.gz
# There, from the repository root, with .whl carried along:
#     bash benchmarks/gpu_x1.sh OUT_DIR
# Writes gpu.txt, weight_transfer_h200.json, fsdp_one_rank_h200.json, a log per stage and logs/ (each mode's trainer
# and server logs) into OUT_DIR. Time limits (seconds): TOTAL_S (default 540) for the whole call, WT_LIMIT_S (390)
# for stage 1, FSDP_LIMIT_S (110) for stage 2 (skipped when less than 45 s of TOTAL_S are left).
set -uo pipefail
out=${1:?usage: gpu_x1.sh OUT_DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
total=${TOTAL_S:-540}
# NVLink multicast stays off everywhere, also in processes started with their own environment.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
site=/tmp/primerl-site
if [ -f .whl/site.tar.gz ]; then
    mkdir -p "$site" && tar xzf .whl/site.tar.gz -C "$site" || exit 1
fi
export PYTHONPATH="$site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
model=/tmp/primerl-qwen3-0.6b-random  # written once by stage 1, reused by stage 2

{
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
"cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
    python3 -c 'import fastapi, uvicorn, pydantic, httpx; print("fastapi", fastapi.__version__, "uvicorn",
uvicorn.__version__, "pydantic", pydantic.__version__)'
} 2>&1 | tee "$out/gpu.txt"
if ! python3 -c 'import fastapi, uvicorn, pydantic' 2>/dev/null; then
    echo "gpu_x1: fastapi/uvicorn/pydantic not importable (is .whl/site.tar.gz there?): the server cannot start" >&2
    exit 2
fi

run() {  # name, seconds, command...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit}s, ${SECONDS}s used): $*"
    local t0=$SECONDS
    timeout --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
    local code=$?
    tail -n 40 "$out/$name.log"
    echo "=== $name: exit $code after $((SECONDS - t0)) s"
}

wt_limit=${WT_LIMIT_S:-390}
run weight_transfer "$wt_limit" python3 benchmarks/weight_transfer.py --budget-s "$((wt_limit - 25))" \
    --model-dir "$model" --logs-dir "$out/logs" --out "$out/weight_transfer_h200.json"

left=$((total - SECONDS - 10))
fsdp_limit=${FSDP_LIMIT_S:-110}
[ "$left" -lt "$fsdp_limit" ] && fsdp_limit=$left
if [ "$fsdp_limit" -ge 45 ]; then
    run fsdp_one_rank "$fsdp_limit" python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
        --max-restarts=0 benchmarks/fsdp_one_rank.py --model-dir "$model" --out "$out/fsdp_one_rank_h200.json"
else
    echo "=== fsdp_one_rank: skipped, ${left}s left of ${total}s"
fi
echo "=== gpu_x1: done after ${SECONDS}s"
