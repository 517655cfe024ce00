#!/usr/bin/env bash
# Every GPU benchmark in one go, for a single-GPU machine (P2 trainer step, P3 engine decode, P4 weight export).
# Usage: bash benchmarks/gpu_suite.sh OUT_DIR
# Writes p2_trainer_h200.json, p3_engine_h200.json, p4_weights_gpu.json and a log per benchmark into OUT_DIR.
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# NVLink multicast stays off everywhere, also in processes started with their own environment.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

run() {  # name, command...
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$out/$name.log" | tail -n 25
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
    | tee -a "$out/gpu.txt"

run p3_smollm2 python3 benchmarks/engine.py --random-init --arch smollm2-135m --batch 64 --new-tokens 128 \
    --out "$out/p3_smollm2.json"
run p3_qwen3 python3 benchmarks/engine.py --random-init --arch qwen3-0.6b --batch 64 --new-tokens 128 \
    --out "$out/p3_qwen3.json"
run p2 python3 benchmarks/trainer.py --out "$out/p2_trainer_h200.json"
run p4 python3 benchmarks/weights.py --qwen3-0.6b --out "$out/p4_weights_gpu.json"
