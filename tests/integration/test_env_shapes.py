"""Environments of every shape verifiers 0.4 allows, installed next to primerl and run by id through `eval` and `rl`
on the tiny model with no environment flags; the refusal of unsandboxed tool harnesses; failures that exit non-zero
with their root cause on one line. The packages are tests/environments/packages/ (the `probe_envs` fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, batch_meta, run_rl
from inference.server_process import start_server

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("probe_envs")]

RUNNABLE = ["probe-taskset", "probe-harnessed", "probe-multiturn"]  # probe-tools needs a sandbox (tests/system)
FLAG = "--env.allow_unsandboxed_tools true"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, probe_envs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One inference server for the eval runs (each `eval` would otherwise start its own)."""
    with start_server(tiny_model_dir, tmp_path_factory.mktemp("server")) as running:
        yield running.base_url


def run_eval(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "primerl.cli", "eval", "--model.name=tiny", "--num_examples=2",
         "--rollouts_per_example=2", "--sampling.max_tokens=8", f"--output_dir={out}", *args],
        check=False, capture_output=True, text=True, timeout=600, cwd=REPO,
    )


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize("env_id", RUNNABLE)
def test_eval_by_id(env_id, server, tmp_path):
    result = run_eval(tmp_path, f"--env.id={env_id}", f"--base_url={server}")
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["errors"] == 0 and results["num_examples"] == 2
    for example in results["examples"]:
        assert example["task_id"] and example["errors"] == [None, None]
    assert len({e["task_id"] for e in results["examples"]}) == 2


def test_eval_refuses_a_tool_harness_on_the_host_before_starting_a_server(tmp_path):
    result = run_eval(tmp_path, "--env.id=probe-tools")
    assert result.returncode == 2, result.stdout + result.stderr
    # Progress lines ("loading the environment ...") may come first; the refusal itself is one line, no traceback.
    errors = [line for line in result.stderr.splitlines() if not line.startswith("primerl eval: loading")
              and not line.startswith("primerl eval: still")]
    assert len(errors) == 1 and FLAG in errors[0] and "Traceback" not in result.stderr, result.stderr
    assert not (tmp_path / "logs").exists()  # no server was started


def test_eval_exits_non_zero_with_the_root_cause_when_every_rollout_failed(server, tmp_path):
    result = run_eval(tmp_path, "--env.id=probe-taskset", f"--base_url={server}", "--served_model_name=absent")
    assert result.returncode == 1, result.stdout + result.stderr
    line = last_line(result.stderr)
    assert line.startswith("primerl eval: every rollout failed (4 of 4); first error: ") and "'absent'" in line
    results = json.loads((tmp_path / "results.json").read_text())  # written all the same
    assert results["errors"] == 4
    for example in results["examples"]:
        assert example["task_id"] and all("model 'absent' is not served here" in e for e in example["errors"])


@pytest.mark.parametrize("env_id", RUNNABLE)
def test_rl_by_id(env_id, tmp_path):
    result = run_rl(tmp_path / "run", f"--orchestrator.env.id={env_id}", "--max_steps=1",
                    "--orchestrator.batch.tasks_per_step=1", "--orchestrator.batch.group_size=2")
    assert result.returncode == 0, result.stdout + result.stderr
    meta = batch_meta(tmp_path / "run", 0)
    assert meta["num_loss_tokens"] > 0 and {s["env"] for s in meta["samples"]} == {env_id}


def run_orchestrator(run_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """The orchestrator alone (the `rl` process that runs environments): its refusals and failures are what `rl`
    reports, as the last line of its output, when the orchestrator exits."""
    return subprocess.run(
        [sys.executable, "-m", "primerl.cli", "orchestrator", "--model.name=tiny", f"--run_dir={run_dir}",
         "--max_steps=1", "--batch.tasks_per_step=1", "--batch.group_size=2", "--sampling.max_tokens=8", *args],
        check=False, capture_output=True, text=True, timeout=600, cwd=REPO,
    )


def test_the_orchestrator_refuses_a_tool_harness_on_the_host(tmp_path):
    result = run_orchestrator(tmp_path, "--env.id=probe-tools", "--client.base_url=http://127.0.0.1:9")
    assert result.returncode == 2, result.stdout + result.stderr
    line = last_line(result.stderr)
    assert "config error: harness 'probe-tools' gives the model a shell or file tools" in line and FLAG in line


def test_rl_exits_non_zero_with_the_root_cause_when_every_rollout_fails(tmp_path):
    # a 4-token context: every prompt is too long, so every rollout fails the same way
    result = run_rl(tmp_path / "run", "--orchestrator.env.id=probe-taskset", "--max_steps=1",
                    "--inference.max_model_len=4", "--orchestrator.batch.tasks_per_step=1",
                    "--orchestrator.batch.group_size=2")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rl: orchestrator exited with code 1" in result.stderr
    line = last_line(result.stderr)
    assert "16 groups in a row failed entirely; last error: " in line
    assert "exceeds maximum context length (4)" in line
