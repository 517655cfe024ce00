"""Kill drills on the tiny CPU run: each process SIGKILLed at a point of the run (writing a batch, writing weights,
checkpointing, mid-run), then `rl --resume` to the end; prints the table as JSON.

    uv run python benchmarks/drills.py --out benchmarks/results/drills.json

Columns: fault, point, steps lost (trained steps missing at the end), steps redone (trained before the kill, after
the checkpoint the resume started from), duplicate metrics records, outcome, and whether each step trained on the same
tasks as in an uninterrupted run of the same config and seed (task_order_equal). The drills are the `drills` tests'
(tests/integration/drills.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from drills import DRILLS, MAX_STEPS, run_drill, run_uninterrupted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as reference:
        uninterrupted = Path(reference) / "run"
        finished = run_uninterrupted(uninterrupted)
        if finished.returncode != 0:
            raise SystemExit(f"the uninterrupted run failed:\n{finished.stdout}{finished.stderr}")
        for drill in DRILLS:
            started = time.monotonic()
            with tempfile.TemporaryDirectory() as workdir:
                row = run_drill(drill, Path(workdir) / "run", uninterrupted)
            row["seconds"] = round(time.monotonic() - started, 1)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    result = {"benchmark": "drills", "machine": platform.machine(), "config": "configs/debug/tiny-rl.toml",
              "max_steps": MAX_STEPS, "checkpoint_interval": 1, "drills": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
