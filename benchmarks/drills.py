"""Kill drills on the tiny CPU run: each process SIGKILLed at a point of the run (writing a batch, writing weights,
checkpointing, mid-run), then `rl --resume` to the end; and the auto-restart drills: `rl --max-restarts 3` with one
process SIGKILLed once mid-run or the trainer SIGSTOPped (the launcher resumes by itself), and with every trainer
SIGKILLed as it starts (the launcher must stop with the cause). Prints the table as JSON.

    uv run python benchmarks/drills.py --out benchmarks/results/drills.json
    uv run python benchmarks/drills.py --only auto_restart --out benchmarks/results/drills.json   # rewrites only
                                                            # the file's "auto_restart" rows, keeps the others
    uv run python benchmarks/drills.py --smoke        # the uninterrupted run and the first drill of each part
    sudo uv run python benchmarks/drills.py --only ssh --out benchmarks/results/drills.json   # the launch ssh drills

Columns of the kill drills ("drills"): fault, point, steps lost (trained steps missing at the end), steps redone
(trained before the kill, after the checkpoint the resume started from), duplicate metrics records, outcome, and
whether each step trained on the same tasks as in an uninterrupted run of the same config and seed (task_order_equal).
Of the auto-restart drills ("auto_restart.rows"): fault, restarts and their causes, steps lost, steps redone, task
order equal, exit code, the restart lines and the line the run stopped with. The drills are the `drills` tests'
(tests/integration/drills.py). "run" describes the last invocation; "auto_restart.run" that part's.

The `launch ssh` drills ("ssh_restart", only with `--only ssh`: they need root for the SSH hosts of the launcher tests,
network namespaces with their own sshd): `primerl launch ssh --max-restarts 2` of the tiny recipe over two hosts, two
inference servers and a trainer of two ranks split over both, with one server or one trainer rank SIGKILLed on its
host once mid-run, or that trainer rank SIGSTOPped there (hung: the launcher sees the run stall for `stall_timeout_s`);
the same columns, compared with an uninterrupted launch of the same layout, and the processes left on each host once
the launcher exited (tests/system/ssh_drills.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # drill_records
sys.path.insert(0, str(REPO / "tests" / "integration"))

from drills import (
    DRILLS,
    EVERY_START,
    HUNG,
    MAX_RESTARTS,
    MAX_STEPS,
    RESTART_DRILLS,
    run_drill,
    run_restart_drill,
    run_uninterrupted,
)
from report import add_smoke_flag, emit, not_run, run_facts

from primerl.launch.restart import CRASH_LOOP_FAILURES

PARTS = ("kill", "auto_restart", "ssh")
LOCAL_PARTS = ("kill", "auto_restart")  # without --only; "ssh" needs root


def _timed(run, *args) -> dict:
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as workdir:
        row = run(Path(workdir) / "run", *args)
    row["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def _ssh_drills(smoke: bool) -> dict:
    """The `launch ssh` drills on two SSH hosts made here (tests/system/ssh_drills.py); their part of the table."""
    sys.path.insert(0, str(REPO / "tests" / "system"))
    import ssh_drills
    from netns_hosts import Cluster, missing_tools

    if why := missing_tools():
        raise SystemExit(f"--only ssh: cannot make SSH hosts here: {why}")
    with tempfile.TemporaryDirectory() as workdir:
        work = Path(workdir)
        (work / "cluster").mkdir()
        cluster = Cluster(work / "cluster", ["a", "b"])
        try:
            started = time.monotonic()
            (work / "reference").mkdir()
            uninterrupted, done = ssh_drills.run_uninterrupted(cluster, work / "reference")
            if done.returncode != 0:
                raise SystemExit(f"the uninterrupted launch failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
            reference_s = round(time.monotonic() - started, 1)
            rows = []
            faults = list(ssh_drills.FAULTS)[:1] if smoke else [*ssh_drills.FAULTS, *ssh_drills.STALLS]
            for i, fault in enumerate(faults):
                (work / f"drill{i}").mkdir()
                rows.append(ssh_drills.run_ssh_drill(cluster, fault, work / f"drill{i}", uninterrupted))
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            cluster.close()
    return {"recipe": "recipes/tiny.toml", "max_steps": ssh_drills.MAX_STEPS, "checkpoint_interval": 1,
            "max_restarts": ssh_drills.MAX_RESTARTS, "stall_timeout_s": ssh_drills.STALL_TIMEOUT_S,
            "roles": ssh_drills.LAYOUT, "uninterrupted_seconds": reference_s,
            "rows": rows,
            "run": run_facts(smoke)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--only", choices=PARTS, help="run one part; with --out, the file's other rows are kept")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    parts = [args.only] if args.only else list(LOCAL_PARTS)
    result = {"benchmark": "drills", "config": "configs/debug/tiny-rl.toml", "max_steps": MAX_STEPS,
              "checkpoint_interval": 1}
    if args.only and args.out is not None and args.out.is_file():
        result = {**json.loads(args.out.read_text()), **result}
    if "ssh" in parts:
        result["ssh_restart"] = _ssh_drills(args.smoke)
        result.get("not_run", {}).pop("ssh_restart", None)
    elif "ssh_restart" not in result:
        not_run(result, "ssh_restart", "the launch ssh drills need root (network namespaces, sshd): --only ssh")
    if not {"kill", "auto_restart"} & set(parts):
        emit(result, args.out, smoke=args.smoke)
        return
    with tempfile.TemporaryDirectory() as reference:
        uninterrupted = Path(reference) / "run"
        finished = run_uninterrupted(uninterrupted)
        if finished.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{finished.stdout}{finished.stderr}")
        if "kill" in parts:
            drills = DRILLS[:1] if args.smoke else DRILLS
            result["drills"] = [_timed(lambda run, d=drill: run_drill(d, run, uninterrupted)) for drill in drills]
        if "auto_restart" in parts:
            faults = RESTART_DRILLS[:1] if args.smoke else [*RESTART_DRILLS, HUNG, EVERY_START]
            rows = [_timed(lambda run, f=fault: run_restart_drill(f, run, uninterrupted)) for fault in faults]
            result["auto_restart"] = {"max_restarts": MAX_RESTARTS, "crash_loop_failures": CRASH_LOOP_FAILURES,
                                      "rows": rows, "run": run_facts(args.smoke)}
    emit(result, args.out, smoke=args.smoke)


if __name__ == "__main__":
    main()
