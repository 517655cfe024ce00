#!/usr/bin/env bash
# The vLLM adapter against uv.lock's vLLM (the one primerl:cuda13 bundles), on the CPU. The environment is a second
# venv, .venv-vllm, synced from the project's own lock with the gpu extra: vllm and what it brings, flash-attn aside
# (a source package that compiles against CUDA; nothing here imports it). The project's .venv is not touched, so the
# main tier keeps testing the install without vllm. ci/test-cuda12.sh runs the same tests with the CUDA 12 image's
# vLLM. PRIMERL_EXPECT_VLLM=1 turns a missing vllm into a failure instead of a skip.
#
# usage: ci/test-vllm.sh [PYTEST ARGS...]      (default: the tests that need vllm installed)
set -euo pipefail
cd "$(dirname "$0")/.."
export UV_PROJECT_ENVIRONMENT="$PWD/.venv-vllm" PRIMERL_EXPECT_VLLM=1
uv sync --locked --extra gpu --no-install-package flash-attn
if [ $# -eq 0 ]; then
    set -- tests/inference/test_vllm_binding.py tests/inference/test_vllm_compat.py
fi
"$UV_PROJECT_ENVIRONMENT/bin/python" -m pytest "$@"
