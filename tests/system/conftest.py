"""Fixtures of the system tier that need a Docker daemon: the daemon itself (reused when one answers, otherwise
started by ci/dockerd.sh and stopped at the end), and a Debian base image made by ci/base-image.sh."""

from __future__ import annotations

import os
import subprocess

import pytest
from docker_helpers import CI, run_in_image


def _ci(script: str, *args: str) -> str:
    done = subprocess.run([str(CI / script), *args], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"ci/{script} {' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip()


IMAGE_TESTS_VAR = "PRIMERL_IMAGE_TESTS"


@pytest.fixture(scope="session")
def docker_client():
    if os.environ.get(IMAGE_TESTS_VAR) != "1":
        pytest.skip(
            f"image builds are opt-in ({IMAGE_TESTS_VAR}=1 pytest -m images; .ci/run runs them as their own group): "
            "they need root for dockerd and take about 15 min on 2 cores with the vfs storage driver "
            "(docs/containers.md)"
        )
    from primerl.launch.images import docker_client as connect

    how = _ci("dockerd.sh", "start")
    client = connect()
    yield client
    client.close()
    if how == "started":
        _ci("dockerd.sh", "stop")


@pytest.fixture(scope="session")
def base_image(docker_client) -> str:
    """A Debian image made here with debootstrap + docker import (kept between runs: it does not grow)."""
    return _ci("base-image.sh").splitlines()[-1]


@pytest.fixture(scope="session")
def base_python(docker_client, base_image) -> str:
    """The `major.minor` of the base image's Python, which the images built on it must use."""
    code, out = run_in_image(
        docker_client, base_image, ["python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]
    )
    assert code == 0, out
    return out.strip()
