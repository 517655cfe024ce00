"""Fixtures of the system tier: a Docker daemon (reused when one answers, otherwise
started by ci/dockerd.sh and stopped at the end), and a Debian base image made by ci/base-image.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from docker_helpers import CI, run_in_image
from ssh_drills import LIGHT_CHECKLIST


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


# ---------------------------------------------------------------------------------------------------------- launchers

LAUNCHER_TESTS_VAR = "PRIMERL_LAUNCHER_TESTS"
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml"
# The heavy checklist steps run whole processes: most launcher tests run the light ones on every host; the test of a
# new user's first launch (tests/system/test_launch_ssh.py) runs the whole checklist on two hosts.
CHECKLIST_SKIP = LIGHT_CHECKLIST


def _install_if_missing(packages: list[str], missing) -> str | None:
    """`missing()` says why the tools are unusable (None: usable); when it says so, install `packages` with apt-get
    (root only) and ask again. The reason returned is the skip reason."""
    why = missing()
    if why is None or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return why
    done = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages],
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        return f"{why}; apt-get install {' '.join(packages)} failed: {done.stderr.strip().splitlines()[-1:]}"
    return missing()


DRILLS_VAR = "PRIMERL_DRILLS"  # the drills of `launch ssh` (test_launch_ssh_drills.py) use the SSH hosts too


def _launcher_tests_enabled(also: str | None = None) -> None:
    if os.environ.get(LAUNCHER_TESTS_VAR) != "1" and (also is None or os.environ.get(also) != "1"):
        pytest.skip(
            f"launcher tests are opt-in ({LAUNCHER_TESTS_VAR}=1 pytest -m launchers; .ci/run runs them as their own "
            "group): they need root for network namespaces, sshd and Slurm's daemons, and run the tiny recipe "
            "several times (docs/launch.md)"
        )


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Two hosts `a` and `b` (network namespaces with their own sshd) and a launcher namespace."""
    _launcher_tests_enabled(also=DRILLS_VAR)
    from netns_hosts import Cluster, missing_tools

    why = _install_if_missing(["openssh-server", "iproute2"], missing_tools)
    if why:
        pytest.skip(f"cannot make SSH hosts here: {why}")
    hosts = Cluster(tmp_path_factory.mktemp("cluster"), ["a", "b"])
    yield hosts
    hosts.close()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A one-node Slurm cluster (munged, slurmctld, slurmd) for the session; clients use `slurm.env`."""
    _launcher_tests_enabled()
    from slurm_cluster import SlurmCluster, missing_tools

    why = _install_if_missing(["slurm-wlm", "munge"], missing_tools)
    if why:
        pytest.skip(f"cannot start Slurm here: {why}")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def slurm_login(slurm, tmp_path_factory):
    """A login host for the Slurm cluster: sshd on loopback whose sessions get SLURM_CONF. Yields a [deploy.hosts]
    entry, plus `known_hosts`: the file (for deploy.known_hosts) that holds its host key."""
    from netns_hosts import known_hosts_line, make_keys, start_sshd

    from primerl.ports import free_port

    workdir = tmp_path_factory.mktemp("login")
    key, _, host_key, authorized = make_keys(workdir)
    port = free_port()
    sshd = start_sshd(workdir, "login", "127.0.0.1", port, host_key, authorized,
                      extra_config=f"SetEnv SLURM_CONF={slurm.conf}\n")
    known_hosts = workdir / "known_hosts"  # the launcher verifies the login host's key against it
    known_hosts.write_text(known_hosts_line("127.0.0.1", port, host_key))
    yield {"address": "127.0.0.1", "port": port, "user": "root", "identity_file": str(key),
           "known_hosts": str(known_hosts)}
    sshd.terminate()
    sshd.wait(timeout=30)


def launch_with_fault(command: list[str], run_dir: Path, fault, env: dict[str, str] | None = None,
                      poll_s: float = 0.1) -> tuple[int, str]:
    """Start a launch, wait (up to 10 min) for its trainer's first step in `run_dir`, call `fault()`, then wait (up to
    15 min) for the launch to end: its exit code and output (the output's tail is printed for the test's log)."""
    from primerl.monitor import read_metrics

    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not read_metrics(run_dir, "trainer"):
            assert proc.poll() is None and time.monotonic() < deadline, "no step was trained"
            time.sleep(poll_s)
        fault()
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    print(out[-6000:])
    return proc.returncode, out
