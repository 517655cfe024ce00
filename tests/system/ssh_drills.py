"""Drills of `primerl launch ssh` with auto-restart, on runs that have several processes of one role -- which on CPU
only a launch over several hosts gives: two inference servers (one per host), or a trainer of two ranks split over
two hosts (torchrun, 2 nodes x 1 rank, gloo). One process is SIGKILLed on its host after the first trained step; the
launcher must stop every process on every host, restart the whole run from its last checkpoint, and finish it.

Used by tests/system/test_launch_ssh_drills.py and `benchmarks/drills.py --only ssh`. Needs root (network
namespaces, sshd): `netns_hosts.Cluster`. Each drill's row says what the fault cost and whether every step trained
on the same tasks as in an uninterrupted launch of the same recipe, seed and layout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import tomli_w

from primerl.launch.restart import restarts_of_run
from primerl.monitor import read_metrics
from primerl.transport import snapshots

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "tiny.toml"
MAX_STEPS = 4
MAX_RESTARTS = 2
LAYOUT = {"inference": ["a", "b"], "orchestrator": "a", "trainer": ["a", "b"]}  # two servers, two trainer ranks
LIGHT_CHECKLIST = ["sft_trainer", "rl_trainer", "inference", "rl_smoke"]  # the heavy steps left out
# The faults: the process killed on host b, told apart by its command line (the host side of the launch,
# `primerl.launch.remote`, and torchrun's agent name the same config file; they are not the target).
INFERENCE = "inference server"
TRAINER_RANK = "trainer rank"
FAULTS = {INFERENCE: ("inference.toml", "inference.1 on host b"), TRAINER_RANK: ("trainer.toml", "trainer.1 on host b")}


def write_deploy(path: Path, cluster, run_dir: Path, roles: dict | None = None, hosts: dict | None = None,
                 **extra) -> Path:
    """A deploy file for `cluster` (the launcher tests' too): every host with the test key, one thread per process,
    gloo on the host's own interface, the light checklist, the hosts' keys in the known_hosts file the launcher
    checks; `roles` default to the drills' `LAYOUT`."""
    hosts = hosts if hosts is not None else {
        name: {"address": h.address, "user": "root", "identity_file": str(cluster.key),
               "env": {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}}
        for name, h in cluster.hosts.items()
    }
    deploy = {"target": "ssh", "run_dir": str(run_dir), "checklist_skip": LIGHT_CHECKLIST, "connect_timeout_s": 5,
              "shutdown_grace_s": 10, "software": {"uv": shutil.which("uv") or "uv"}, "hosts": hosts,
              "roles": roles or LAYOUT, "known_hosts": str(cluster.known_hosts), **extra}
    path.write_text(tomli_w.dumps({"deploy": deploy}))
    return path


def launch_command(cluster, deploy: Path) -> list[str]:
    """The launch of every drill and of the uninterrupted run: checkpoints every step, `MAX_RESTARTS`."""
    return cluster.launcher_command(sys.executable, "-m", "primerl.cli", "launch", "ssh", str(RECIPE), "--deploy",
                                    str(deploy), f"--rl.max_steps={MAX_STEPS}", "--rl.trainer.ckpt.interval=1",
                                    f"--max-restarts={MAX_RESTARTS}")


def run_uninterrupted(cluster, work: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """The run every drill is compared with: the same launch, never killed."""
    run_dir = work / "run"
    done = subprocess.run(launch_command(cluster, write_deploy(work / "deploy.toml", cluster, run_dir)),
                          capture_output=True, text=True, timeout=900, check=False)
    return run_dir, done


def tasks_per_step(run_dir: Path) -> list[list[str]]:
    """The task ids of each published batch, step by step."""
    steps = len(list(run_dir.glob("rollouts/step_*")))
    return [json.loads((run_dir / "rollouts" / f"step_{k}" / "meta.json").read_text())["extra"]["tasks"]
            for k in range(steps)]


def target_pid(cluster, host: str, config: str) -> int | None:
    """The process on `host` that runs primerl with `config`: not the host side of the launch, not torchrun's agent."""
    for pid in sorted(cluster.hosts[host].pids()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if config in cmd and "primerl.cli" in cmd and "primerl.launch.remote" not in cmd and \
                "torch.distributed.run" not in cmd:
            return pid
    return None


def _steps_being_written(run_dir: Path) -> list[int]:
    staged = [*run_dir.glob("weights/.step_*.tmp-*"),
              *(p.parent for p in run_dir.glob("checkpoints/step_*/trainer.tmp"))]
    return [int(re.search(r"step_(\d+)", p.name).group(1)) for p in staged]


def run_ssh_drill(cluster, fault: str, work: Path, uninterrupted: Path | None = None) -> dict:
    """One drill: launch, SIGKILL the `fault` process on host b after the first trained step, let the launcher heal
    the run. The row of the results table."""
    config, name = FAULTS[fault]
    run_dir = work / "run"
    started = time.monotonic()
    launcher = subprocess.Popen(launch_command(cluster, write_deploy(work / "deploy.toml", cluster, run_dir)),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not read_metrics(run_dir, "trainer"):
            assert launcher.poll() is None, f"{fault}: the launch ended before its first trained step"
            assert time.monotonic() < deadline, f"{fault}: no step was trained"
            time.sleep(0.05)
        pid = target_pid(cluster, "b", config)
        assert pid is not None, f"{fault}: no {config} process on host b"
        os.kill(pid, signal.SIGKILL)
        trained_before = max((r["step"] for r in read_metrics(run_dir, "trainer")), default=0)
        started_before = max([trained_before, *_steps_being_written(run_dir)])
        out, _ = launcher.communicate(timeout=1200)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    restarts = restarts_of_run(run_dir)
    failed_at = max([started_before, *(r["failed_at_step"] for r in restarts[:1])])
    resumed_from = restarts[0]["resumed_from_step"] if restarts else None
    trainer_steps = [r["step"] for r in read_metrics(run_dir, "trainer")]
    batch_steps = [r["step"] for r in read_metrics(run_dir, "orchestrator")]
    finished = launcher.returncode == 0 and snapshots.is_stable(snapshots.weights_dir(run_dir, MAX_STEPS))
    lines = out.splitlines()
    return {
        "fault": f"SIGKILL {name.replace(' on host ', '@')} ({fault}) once, mid-run",
        "layout": "inference on a and b, orchestrator on a, trainer over a and b (2 ranks)",
        "max_restarts": MAX_RESTARTS,
        "restarts": len(restarts),
        "causes": [f"{r['process']} {r['cause']}" for r in restarts],
        "trained_before_kill": trained_before,
        "resumed_from_checkpoint": resumed_from,
        "steps_redone": max(0, failed_at - resumed_from) if resumed_from is not None else None,
        "steps_lost": len(set(range(1, MAX_STEPS + 1)) - set(trainer_steps)),
        "duplicate_trainer_records": len(trainer_steps) - len(set(trainer_steps)),
        "duplicate_batch_records": len(batch_steps) - len(set(batch_steps)),
        "task_order_equal": None if uninterrupted is None or not finished
        else tasks_per_step(run_dir) == tasks_per_step(uninterrupted),
        "exit_code": launcher.returncode,
        "restart_lines": [line for line in lines if line.startswith("launch: restart ")],
        "outcome": "finished" if finished else "stopped",
        "seconds": round(time.monotonic() - started, 1),
        "tail": "" if finished else out[-3000:],
    }
