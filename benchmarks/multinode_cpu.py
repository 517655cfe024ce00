"""Multi-node on CPU: the tiny recipe through `primerl launch ssh` on one host vs spread over two hosts.

The hosts are network namespaces of this machine, each with its own sshd (tests/system/netns_hosts.py; needs root),
sharing the run directory through the filesystem. Layouts, each run `--steps` steps:

    one_host          inference, orchestrator and trainer on host a
    trainer_apart     inference + orchestrator on a, the trainer on b
    trainer_split     inference + orchestrator on a, the trainer over a and b (torchrun, 2 nodes, gloo)

`seconds_per_step` is the mean time between consecutive trainer records after the first step (start-up excluded);
`launch_seconds` is the launcher's whole run (preflight, checklist's light steps, start, steps, stop). All "hosts"
share this machine's cores (every process with OMP_NUM_THREADS=1), so the figures show what spreading costs or gains
on one box, not on real nodes; on a machine shared with other work they move with its load (recorded). Prints one JSON object; `--out FILE` also writes it.

    sudo uv run python benchmarks/multinode_cpu.py [--steps 4] [--out benchmarks/results/multinode_cpu.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "system"))
from netns_hosts import Cluster, missing_tools

RECIPE = REPO / "recipes" / "tiny.toml"
LAYOUTS = {
    "one_host": {"inference": ["a"], "orchestrator": "a", "trainer": ["a"]},
    "trainer_apart": {"inference": ["a"], "orchestrator": "a", "trainer": ["b"]},
    "trainer_split": {"inference": ["a"], "orchestrator": "a", "trainer": ["a", "b"]},
}
LIGHT_CHECKLIST_SKIP = ["sft_trainer", "rl_trainer", "inference", "rl_smoke"]


def trainer_times(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted(r["time"] for r in records if r.get("source") == "trainer")


def run_layout(cluster: Cluster, work: Path, name: str, roles: dict, steps: int) -> dict:
    run_dir = work / name
    hosts = {h: {"address": host.address, "user": "root", "identity_file": str(cluster.key),
                 "env": {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}} for h, host in cluster.hosts.items()}
    deploy = {"target": "ssh", "run_dir": str(run_dir), "checklist_skip": LIGHT_CHECKLIST_SKIP,
              "software": {"uv": shutil.which("uv")}, "hosts": hosts, "roles": roles}
    (work / f"{name}.toml").write_text(tomli_w.dumps({"deploy": deploy}))
    command = cluster.launcher_command(sys.executable, "-m", "primerl.cli", "launch", "ssh", str(RECIPE),
                                       "--deploy", str(work / f"{name}.toml"), f"--rl.max_steps={steps}")
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"{name}: launch failed (exit {done.returncode}):\n{done.stdout[-3000:]}")
    times = trainer_times(run_dir)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "hosts": sorted({*roles["inference"], roles["orchestrator"], *roles["trainer"]}),
        "roles": roles,
        "steps_completed": len(times),
        "seconds_per_step": round(sum(gaps) / len(gaps), 2) if gaps else None,
        "launch_seconds": round(seconds, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    why = missing_tools()
    if why:
        raise SystemExit(f"cannot make hosts here: {why}")
    work = Path(tempfile.mkdtemp(prefix="primerl-multinode-"))
    cluster = Cluster(work, ["a", "b"])
    try:
        results = {name: run_layout(cluster, work, name, roles, args.steps) for name, roles in LAYOUTS.items()}
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    one = results["one_host"]["seconds_per_step"]
    for name in ("trainer_apart", "trainer_split"):
        spread = results[name]["seconds_per_step"]
        results[name]["vs_one_host"] = round(spread / one, 2) if one and spread else None
    report = {
        "benchmark": "multinode_cpu",
        "recipe": "recipes/tiny.toml",
        "steps": args.steps,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_avg_1m": os.getloadavg()[0]},
        "note": "hosts are network namespaces sharing this machine's cores (every process OMP_NUM_THREADS=1) with "
                "whatever else runs on it (load_avg_1m); each figure is the mean of steps-1 intervals of one run",
        "layouts": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
