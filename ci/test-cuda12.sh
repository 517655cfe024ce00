#!/usr/bin/env bash
# The fast test tier on the CUDA 12 image's stack: torch 2.10 and transformers 4.57 from docker/cuda12/uv.lock
# (primerl:cuda12), beside the main lock's torch 2.13 and transformers 5. Both run on the CPU.
#
# usage: ci/test-cuda12.sh [PYTEST ARGS...]      (default: the subset below)
# The environment is a second venv, .venv-cuda12, synced from that lock with the gpu extra as the image has it: vllm
# 0.19 and what it brings, flash-attn aside (a source package that compiles against CUDA; nothing here imports it).
# About 2.5 GB of torch and CUDA 12 wheels and 0.8 GB more for vllm on a cold uv cache; the project's own .venv is not
# touched. The subset is what depends on the stack: the model registry and tokenizers, the trainer (loss, model, FSDP,
# RL and SFT steps, weight export), the weight transports (broadcast, shared memory, rollout batches), the inference
# engine and server, the vLLM adapter bound to this vLLM (tests/inference/test_vllm_binding.py; PRIMERL_EXPECT_VLLM=1
# makes a missing vllm fail it, not skip it), and the W&B logging; not the SmolLM2 tests (marker slow) nor the
# kill-and-resume test of the RL trainer (process handling, the same on both stacks, and the slowest of the set).
# Nor the connection tests (HTTP transport and proxies, the same on both stacks).
set -euo pipefail
cd "$(dirname "$0")/.."
export UV_PROJECT_ENVIRONMENT="$PWD/.venv-cuda12" PRIMERL_EXPECT_VLLM=1
uv sync --locked --compile-bytecode --project docker/cuda12 --extra gpu --no-install-package flash-attn
if [ $# -eq 0 ]; then
    set -- tests/test_models.py tests/test_monitor.py tests/trainer tests/transport tests/inference -m "not slow" \
        --deselect tests/trainer/test_rl_trainer.py::test_resume_after_kill_repeats_the_same_steps \
        --ignore tests/inference/test_connections.py
fi
"$UV_PROJECT_ENVIRONMENT/bin/python" -m pytest "$@"
