"""Drills of `primerl launch ssh` with auto-restart, on runs that have several processes of one role -- which on CPU
only a launch over several hosts gives: two inference servers (one per host), or a trainer of two ranks split over
two hosts (torchrun, 2 nodes x 1 rank, gloo). One process is SIGKILLed on its host after the first trained step, or
SIGSTOPped there (a hung process: it holds its sockets, answers nothing, and the run's heartbeat, metrics.jsonl, stops
growing); the launcher must stop every process on every host (the stopped one included), restart the whole run from
its last checkpoint, and finish it.

Used by tests/system/test_launch_ssh_drills.py and `benchmarks/drills.py --only ssh`. Needs root (network
namespaces, sshd): `netns_hosts.Cluster`. Each drill's row says what the fault cost and whether every step trained
on the same tasks as in an uninterrupted launch of the same recipe, seed and layout.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import tomli_w
from drill_records import restart_figures, steps_being_written

from primerl.monitor import read_metrics

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
# The hang: the trainer rank on b SIGSTOPped once mid-run; its peer on a waits in a collective, the run stalls, and the
# launcher sees no new metrics record for STALL_TIMEOUT_S (far above a step or a start of the tiny run on a busy
# machine, as the rl stall drill's).
HUNG_RANK = "hung trainer rank"
STALLS = {HUNG_RANK: ("trainer.toml", "trainer.1 on host b")}
STALL_TIMEOUT_S = 120


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


def launch_command(cluster, deploy: Path, *extra: str) -> list[str]:
    """The launch of every drill and of the uninterrupted run: checkpoints every step, `MAX_RESTARTS`."""
    return cluster.launcher_command(sys.executable, "-m", "primerl.cli", "launch", "ssh", str(RECIPE), "--deploy",
                                    str(deploy), f"--rl.max_steps={MAX_STEPS}", "--rl.trainer.ckpt.interval=1",
                                    f"--max-restarts={MAX_RESTARTS}", *extra)


def run_uninterrupted(cluster, work: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """The run every drill is compared with: the same launch, never killed."""
    run_dir = work / "run"
    done = subprocess.run(launch_command(cluster, write_deploy(work / "deploy.toml", cluster, run_dir)),
                          capture_output=True, text=True, timeout=900, check=False)
    return run_dir, done


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


def run_ssh_drill(cluster, fault: str, work: Path, uninterrupted: Path | None = None) -> dict:
    """One drill: launch, SIGKILL (`FAULTS`) or SIGSTOP (`STALLS`, with `STALL_TIMEOUT_S`) the `fault` process on
    host b after the first trained step, let the launcher heal the run. The row of the results table."""
    hang = fault in STALLS
    config, name = {**FAULTS, **STALLS}[fault]
    run_dir = work / "run"
    started = time.monotonic()
    stall = [f"--rl.stall_timeout_s={STALL_TIMEOUT_S}"] if hang else []
    launcher = subprocess.Popen(launch_command(cluster, write_deploy(work / "deploy.toml", cluster, run_dir), *stall),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while not read_metrics(run_dir, "trainer"):
            assert launcher.poll() is None, f"{fault}: the launch ended before its first trained step"
            assert time.monotonic() < deadline, f"{fault}: no step was trained"
            time.sleep(0.05)
        pid = target_pid(cluster, "b", config)
        assert pid is not None, f"{fault}: no {config} process on host b"
        os.kill(pid, signal.SIGSTOP if hang else signal.SIGKILL)
        trained_before = max((r["step"] for r in read_metrics(run_dir, "trainer")), default=0)
        started_before = max([trained_before, *steps_being_written(run_dir)])
        out, _ = launcher.communicate(timeout=1200)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    seconds = round(time.monotonic() - started, 1)
    figures = restart_figures(run_dir, MAX_STEPS, launcher.returncode, started_before, uninterrupted)
    how = f"SIGSTOP {name.replace(' on host ', '@')} ({fault}) once, mid-run (stall_timeout_s {STALL_TIMEOUT_S})" \
        if hang else f"SIGKILL {name.replace(' on host ', '@')} ({fault}) once, mid-run"
    return {
        "fault": how,
        "layout": "inference on a and b, orchestrator on a, trainer over a and b (2 ranks)",
        "max_restarts": MAX_RESTARTS,
        "trained_before_kill": trained_before,
        **figures,
        "restart_lines": [line for line in out.splitlines() if line.startswith("launch: restart ")],
        # processes of the run still on a host once the launcher has exited (the stopped one, if the stop missed it)
        "processes_left": {host: len(cluster.stray_processes(host)) for host in cluster.hosts},
        "seconds": seconds,
        "tail": "" if figures["outcome"] == "finished" else out[-3000:],
    }
