"""Kill drills on the tiny CPU run: each process SIGKILLed at a point of the run (writing a batch, writing weights,
checkpointing, mid-run), then `rl --resume` to the end; prints the table as JSON.

    uv run python benchmarks/drills.py --out benchmarks/results/drills.json
    uv run python benchmarks/drills.py --smoke        # the uninterrupted run and the first drill only

Columns: fault, point, steps lost (trained steps missing at the end), steps redone (trained before the kill, after
the checkpoint the resume started from), duplicate metrics records, outcome, and whether each step trained on the same
tasks as in an uninterrupted run of the same config and seed (task_order_equal). The drills are the `drills` tests'
(tests/integration/drills.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from drills import DRILLS, MAX_STEPS, run_drill, run_uninterrupted
from report import add_smoke_flag, emit


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    drills = DRILLS[:1] if args.smoke else DRILLS
    rows = []
    with tempfile.TemporaryDirectory() as reference:
        uninterrupted = Path(reference) / "run"
        finished = run_uninterrupted(uninterrupted)
        if finished.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{finished.stdout}{finished.stderr}")
        for drill in drills:
            started = time.monotonic()
            with tempfile.TemporaryDirectory() as workdir:
                row = run_drill(drill, Path(workdir) / "run", uninterrupted)
            row["seconds"] = round(time.monotonic() - started, 1)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"benchmark": "drills", "config": "configs/debug/tiny-rl.toml", "max_steps": MAX_STEPS,
              "checkpoint_interval": 1, "drills": rows}
    emit(result, args.out, smoke=args.smoke)


if __name__ == "__main__":
    main()
