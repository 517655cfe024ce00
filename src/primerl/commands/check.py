"""`primerl check [recipe.toml]`: run the validation checklist (`primerl.checklist`) and say whether this machine can
run the recipe.

    primerl check recipes/tiny.toml [--only a,b] [--skip c] [--run-dir DIR] [--report FILE] [--log-dir DIR]
        [--stall-timeout S]

The console gets progress lines and a table; the JSON report goes to `--report` (default `<run dir>/checklist.json`),
the heavy steps' configs and logs to `--log-dir` (default `<run dir>/logs/checklist/`; a launcher gives every host
its own, `<run dir>/logs/checklist/<host>/`, so the checklists of hosts sharing a run directory never mix). Exit code:
0 when nothing failed, 1 when a step failed (or the report cannot be written), 2 on a usage or recipe error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from primerl.checklist.context import STALL_TIMEOUT_S
from primerl.checklist.report import write_report
from primerl.checklist.runner import CHECKLIST_LOGS, run_checklist
from primerl.checklist.steps import STEPS, select_steps
from primerl.config.checklist import STEP_NAMES
from primerl.recipes.schema import RecipeError
from primerl.recipes.stages import load_recipe

DEFAULT_RUN_DIR = Path("runs/check")


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="primerl check",
        description="Run the validation checklist: can this machine run the recipe? Steps: " + ", ".join(STEP_NAMES),
    )
    parser.add_argument("recipe", nargs="?", help="recipe file (pins, hardware and smoke variant to check against)")
    parser.add_argument("--only", type=_names, default=[], help="comma-separated steps to run (default: all)")
    parser.add_argument("--skip", type=_names, default=[], help="comma-separated steps to leave out")
    parser.add_argument("--run-dir", type=Path, help=f"run directory to check (default: runs/<recipe> or {DEFAULT_RUN_DIR})")
    parser.add_argument("--report", type=Path, help="JSON report path (default: <run dir>/checklist.json)")
    parser.add_argument("--log-dir", type=Path, help="the heavy steps' configs and logs (default: <run "
                        "dir>/logs/checklist); every host of a launch gets its own")
    parser.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT_S, metavar="S",
                        help="fail a heavy step after S seconds without progress: no new output and no CPU time spent "
                        f"by its processes (default {STALL_TIMEOUT_S:.0f})")
    parser.add_argument("--list", action="store_true", help="list the steps and exit")
    args = parser.parse_args(argv)
    if args.list:
        for step in STEPS:
            print(f"{step.name:12s} {step.summary} ({step.limit(args.stall_timeout)})")
        return 0
    try:
        steps = select_steps(args.only, args.skip)
        recipe = load_recipe(args.recipe) if args.recipe else None
        if recipe is not None:
            recipe.require_supported()
    except (ValueError, RecipeError) as e:
        print(f"primerl check: error: {e}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or (Path("runs") / recipe.name if recipe else DEFAULT_RUN_DIR)
    if args.stall_timeout <= 0:
        print("primerl check: error: --stall-timeout must be positive", file=sys.stderr)
        return 2
    try:
        report = run_checklist(recipe, run_dir, steps, log_dir=args.log_dir or run_dir / CHECKLIST_LOGS,
                               stall_timeout_s=args.stall_timeout)
    except KeyboardInterrupt:  # the checklist said so in one line and stopped the step that ran
        return 130
    print("\n" + report.table())
    report_path = args.report or run_dir / "checklist.json"
    try:
        write_report(report, report_path)
        print(f"report: {report_path}")
    except OSError as e:
        print(f"primerl check: cannot write the report {report_path}: {e}", file=sys.stderr)
        return 1
    if report.failed:
        print(f"primerl check: failed: {', '.join(s.name for s in report.failed)} (logs: {report.log_dir})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
