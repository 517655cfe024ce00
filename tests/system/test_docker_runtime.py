"""The docker runtime on the local daemon: a tool environment (probe-tools, whose `shell` tool runs model-written
commands) runs by id in one container per rollout, built from the debootstrap base image (no registry)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import verifiers.v1 as vf
from docker_helpers import ROOT
from verifiers.v1.runtimes import provision_runtime

from primerl.orchestrator.envkit import ShellHarness, ShellHarnessConfig

pytestmark = [pytest.mark.system, pytest.mark.images, pytest.mark.usefixtures("probe_envs")]


@pytest.fixture(scope="module")
def bridge(docker_client) -> None:
    """verifiers' docker runtime starts containers on the daemon's default bridge network."""
    if not docker_client.networks.list(names=["bridge"]):
        pytest.fail("the Docker daemon has no bridge network (started with --bridge=none?); ci/dockerd.sh keeps it")


def test_the_shell_tool_runs_inside_the_rollouts_container(docker_client, base_image, bridge):
    harness = ShellHarness(ShellHarnessConfig(id="probe-tools"))

    async def go() -> tuple[str, str, str]:
        async with provision_runtime(vf.DockerConfig(image=base_image)) as runtime:
            (shell,) = harness.runtime_tools(runtime)
            inside = await shell.call('{"command": "cat /etc/hostname; touch /probe-was-here; ls /probe-was-here"}')
            return runtime.info.id, inside, runtime._container

    container_id, inside, name = asyncio.run(go())
    assert inside.splitlines() == ["exit code 0", container_id, "/probe-was-here"]
    assert not docker_client.containers.list(all=True, filters={"name": name})  # removed with the rollout


def test_a_tool_environment_evaluates_by_id_in_containers(docker_client, base_image, bridge, tmp_path):
    since = int(time.time())
    result = subprocess.run(
        [sys.executable, "-m", "primerl.cli", "eval", "--model.name=tiny", "--env.id=probe-tools",
         "--env.runtime.type=docker", f"--env.runtime.image={base_image}", "--num_examples=2",
         "--rollouts_per_example=2", "--sampling.max_tokens=8", f"--output_dir={tmp_path}"],
        check=False, capture_output=True, text=True, timeout=900, cwd=ROOT,
    )
    started = subprocess.run(
        ["docker", "events", "--since", str(since), "--until", str(int(time.time()) + 1), "--filter", "type=container",
         "--filter", "event=start", "--format", "{{.Actor.Attributes.image}}"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["errors"] == 0 and results["num_examples"] == 2
    assert started.split().count(base_image) >= 4  # one container per rollout
