"""Rollouts in worker processes (`orchestrator.workers`) against the real inference server on the tiny model: the same
batches as in the loop's own process, and the failure semantics — a killed worker is one clear error, Ctrl-C and a
killed orchestrator leave no worker behind, bad env args fail before any worker starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_verifiers_bridge import server  # noqa: F401  (the module-scoped tiny server fixture)

from primerl.orchestrator.workers import worker_count
from primerl.transport.rollouts import read_batch

pytestmark = pytest.mark.integration
SETTINGS = {"batch.tasks_per_step": "2", "batch.group_size": "3", "sampling.max_tokens": "8", "seed": "5"}


def command(run_dir: Path, url: str, *overrides: str) -> list[str]:
    """`primerl orchestrator` with no trainer: after its first batches it waits for a policy that never comes."""
    return [sys.executable, "-m", "primerl.cli", "orchestrator", f"--run_dir={run_dir}", "--model.name=tiny",
            f"--client.base_url={url}", *(f"--{key}={value}" for key, value in SETTINGS.items()), *overrides]


def worker_pids(run_dir: Path) -> set[int]:
    """Live (not zombie) rollout workers of `run_dir`'s orchestrator."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
            continue
        if b"primerl.orchestrator.rollout_worker" in cmdline and str(run_dir).encode() in cmdline and state != "Z":
            found.add(int(entry.name))
    return found


def wait_until(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the orchestrator exited ({proc.returncode}) while waiting for {what}:\n"
                                 f"{proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def start(run_dir: Path, url: str, *overrides: str) -> subprocess.Popen:
    """The orchestrator in a process group of its own (as `rl` starts it), once a batch is written: its workers run."""
    proc = subprocess.Popen(command(run_dir, url, "--workers=2", *overrides), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_until(lambda: (run_dir / "rollouts" / "step_0").is_dir(), 300, "the first batch", proc)
    assert len(worker_pids(run_dir)) == 2
    return proc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_write_the_batches_the_loop_writes_in_its_own_process(server, tmp_path):  # noqa: F811
    """Same seed, same server: every step takes the same tasks in the same order and the same tokens, masks,
    log-probs and versions, with the rollouts in two worker processes or in the loop's own. No trainer: policy 0
    serves every step, the bound is opened as far as the run, and every group is used."""
    for workers in (0, 2):
        finished = subprocess.run(
            command(tmp_path / f"workers_{workers}", server, f"--workers={workers}", "--max_steps=3",
                    "--max_async_steps=3", "--advantage.drop_zero_advantage=false"),
            check=False, capture_output=True, text=True, timeout=300,
        )
        assert finished.returncode == 0, finished.stderr[-3000:]
    for step in range(3):
        alone, pooled = (read_batch(tmp_path / f"workers_{n}" / "rollouts" / f"step_{step}") for n in (0, 2))
        assert alone.meta["extra"]["tasks"] == pooled.meta["extra"]["tasks"]
        assert alone.meta["samples"] == pooled.meta["samples"]  # policy versions and version runs per sample
        assert alone.arrays.keys() == pooled.arrays.keys()
        for name in alone.arrays:
            if name == "inference_logprobs":
                # the same sampled tokens, scored in batches of other row counts (the requests reach the server
                # from two processes, at other times): where the CPU kernel's blocking follows the row count, a
                # log-prob may differ in its last bits (seen: 5 of 2,048 by at most 4.8e-7 on an AMD EPYC host)
                np.testing.assert_allclose(alone.arrays[name], pooled.arrays[name], rtol=0, atol=1e-5,
                                           err_msg=f"step {step}: {name}")
            else:
                np.testing.assert_array_equal(alone.arrays[name], pooled.arrays[name], err_msg=f"step {step}: {name}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_worker_stops_the_orchestrator_with_one_clear_error(server, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    proc = start(run_dir, server)
    victim, other = sorted(worker_pids(run_dir))
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)  # idle or busy, a dead worker ends the run: never a hang
    assert proc.returncode == 1, err[-3000:]
    failed = [line for line in err.splitlines() if "orchestrator failed" in line]
    assert len(failed) == 1 and f"(pid {victim}) was killed by signal 9 (SIGKILL)" in failed[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not worker_pids(run_dir) and not Path(f"/proc/{other}").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_stops_the_orchestrator_and_its_workers(server, tmp_path):  # noqa: F811
    """SIGINT to the process group (a terminal's Ctrl-C; `rl` stops its processes the same way)."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, server)
    pids = worker_pids(run_dir)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted" in err and "orchestrator failed" not in err, err[-3000:]
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)  # reaped by the orchestrator: no zombie either


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_exit_when_their_orchestrator_is_killed(server, tmp_path):  # noqa: F811
    run_dir = tmp_path / "run"
    proc = start(run_dir, server)
    pids = worker_pids(run_dir)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    wait_until(lambda: not worker_pids(run_dir), 30, f"workers {sorted(pids)} to exit")


def test_bad_env_args_fail_in_one_line_before_any_worker_starts(tmp_path):
    result = subprocess.run(command(tmp_path / "run", "http://127.0.0.1:9", "--workers=2", "--env.args.revers=words"),
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if " ERROR " in line]
    assert errors == [errors[0]] and errors[0].endswith(
        "config error: environment 'reverse-text': env.args.revers: Extra inputs are not permitted (got 'words')"
    ), result.stderr[-3000:]
    assert "worker processes" not in result.stderr


def test_auto_starts_workers_only_where_there_are_cores_to_spare():
    assert [worker_count("auto", cores) for cores in (1, 2, 4, 7, 8, 12, 16, 64)] == [0, 0, 0, 0, 4, 6, 8, 8]
    assert worker_count(0, cores=64) == 0 and worker_count(3, cores=2) == 3
