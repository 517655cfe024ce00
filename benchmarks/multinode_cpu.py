"""Multi-node on CPU: the tiny recipe through `primerl launch ssh` on one host vs spread over two hosts.

The hosts are network namespaces of this machine, each with its own sshd (tests/system/netns_hosts.py; needs root),
sharing the run directory through the filesystem. Layouts, each run `--steps` steps:

    one_host          inference, orchestrator and trainer on host a
    trainer_apart     inference + orchestrator on a, the trainer on b
    trainer_split     inference + orchestrator on a, the trainer over a and b (torchrun, 2 nodes, gloo)

`seconds_per_step` is the mean time between consecutive trainer records after the first step (start-up excluded);
`launch_seconds` is the launcher's whole run (preflight, checklist's light steps, start, steps, stop). All "hosts"
share this machine's cores (every process with OMP_NUM_THREADS=1), so the figures show what spreading costs or gains
on one box, not on real nodes; on a machine shared with other work they move with its load (recorded). Prints one
JSON object; `--out FILE` also writes it.

    sudo uv run python benchmarks/multinode_cpu.py [--steps 4] [--out benchmarks/results/multinode_cpu.json]
    uv run python benchmarks/multinode_cpu.py --smoke      # no hosts: each layout's deploy file and launch plan

--smoke needs no root: it writes each layout's deploy file and builds the launcher's plan from it (hosts, processes,
commands), the part of `primerl launch ssh` before it contacts a host; the runs themselves are named under "not_run"
(the launcher tests' group runs one: tests/benchmarks/test_smoke.py).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "system"))
sys.path.insert(0, str(REPO / "benchmarks"))
from netns_hosts import Cluster, missing_tools
from report import add_smoke_flag, emit, not_run

RECIPE = REPO / "recipes" / "tiny.toml"
LAYOUTS = {
    "one_host": {"inference": ["a"], "orchestrator": "a", "trainer": ["a"]},
    "trainer_apart": {"inference": ["a"], "orchestrator": "a", "trainer": ["b"]},
    "trainer_split": {"inference": ["a"], "orchestrator": "a", "trainer": ["a", "b"]},
}
LIGHT_CHECKLIST_SKIP = ["sft_trainer", "rl_trainer", "inference", "rl_smoke"]
PLAN_ADDRESSES = {"a": "10.200.0.1", "b": "10.200.0.2"}  # --smoke: the plan only, no host answers there


def trainer_times(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return sorted(r["time"] for r in records if r.get("source") == "trainer")


def write_deploy(work: Path, name: str, roles: dict, addresses: dict[str, str], key: Path,
                 known_hosts: Path | None = None) -> Path:
    """The layout's deploy file: the hosts its roles use (a listed host without a role is refused), each as root with
    `key`, one thread per process, the light checklist; the hosts' keys in `known_hosts`."""
    used = {*roles["inference"], roles["orchestrator"], *roles["trainer"]}
    hosts = {h: {"address": address, "user": "root", "identity_file": str(key),
                 "env": {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}}
             for h, address in addresses.items() if h in used}
    deploy = {"target": "ssh", "run_dir": str(work / name), "checklist_skip": LIGHT_CHECKLIST_SKIP,
              "software": {"uv": shutil.which("uv") or "uv"}, "hosts": hosts, "roles": roles,
              **({"known_hosts": str(known_hosts)} if known_hosts else {})}
    path = work / f"{name}.toml"
    path.write_text(tomli_w.dumps({"deploy": deploy}))
    return path


def plan_layout(work: Path, name: str, roles: dict, steps: int) -> dict:
    """What `primerl launch ssh` plans for the layout before it contacts a host."""
    from primerl.launch.plan import build_plan, load_deploy
    from primerl.recipes import load_recipe

    recipe = load_recipe(RECIPE)
    deploy_file = write_deploy(work, name, roles, PLAN_ADDRESSES, work / "key")
    plan = build_plan(recipe, load_deploy(recipe, [deploy_file]), {"rl": {"max_steps": steps}})
    return {"hosts": plan.hosts, "processes": [p.label for p in plan.processes], "max_steps": plan.max_steps}


def run_layout(cluster: Cluster, work: Path, name: str, roles: dict, steps: int) -> dict:
    run_dir = work / name
    deploy_file = write_deploy(work, name, roles, {h: host.address for h, host in cluster.hosts.items()}, cluster.key,
                               cluster.known_hosts)
    command = cluster.launcher_command(sys.executable, "-m", "primerl.cli", "launch", "ssh", str(RECIPE),
                                       "--deploy", str(deploy_file), f"--rl.max_steps={steps}")
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="layouts to run, in order")
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    layouts = {name: LAYOUTS[name] for name in args.layouts.split(",") if name}
    work = Path(tempfile.mkdtemp(prefix="primerl-multinode-"))
    report = {
        "benchmark": "multinode_cpu",
        "recipe": "recipes/tiny.toml",
        "steps": args.steps,
        "note": "hosts are network namespaces sharing this machine's cores (every process OMP_NUM_THREADS=1) with "
                "whatever else runs on it (run.load_average_*); each figure is the mean of steps-1 intervals of one "
                "run",
    }
    try:
        if args.smoke:
            report["plans"] = {name: plan_layout(work, name, roles, args.steps) for name, roles in layouts.items()}
            not_run(report, "layouts", "--smoke builds the plans only; the runs need root for network namespaces "
                    "and sshd (the launchers group runs one)")
        else:
            report["layouts"] = run_layouts(work, layouts, args.steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(report, args.out, smoke=args.smoke)


def run_layouts(work: Path, layouts: dict[str, dict], steps: int) -> dict:
    why = missing_tools()
    if why:
        raise SystemExit(f"cannot make hosts here: {why}")
    cluster = Cluster(work, sorted({h for roles in layouts.values() for h in
                                    (*roles["inference"], roles["orchestrator"], *roles["trainer"])}))
    try:
        results = {name: run_layout(cluster, work, name, roles, steps) for name, roles in layouts.items()}
    finally:
        cluster.close()
    one = results.get("one_host", {}).get("seconds_per_step")
    for name in ("trainer_apart", "trainer_split"):
        if name in results:
            spread = results[name]["seconds_per_step"]
            results[name]["vs_one_host"] = round(spread / one, 2) if one and spread else None
    return results


if __name__ == "__main__":
    main()
