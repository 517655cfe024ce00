"""`primerl run recipe.toml` (and `rl recipe.toml`): pins, then the checklist, then the stages.

1. Load the recipe; refuse one that needs a capability this build lacks, or more GPUs than this machine has, before
   anything runs or is written (exit 2). Resolve every stage's config.
2. Verify every pin against this machine. Drift stops the run before anything is written (exit 3), printing pinned
   vs found for each drifted pin — unless `--allow-drift`, which proceeds and records the drift in the manifest.
3. Run the validation checklist (`primerl check`) on the recipe with the command line's overrides, unless
   `--no-check`; a failed step stops the run (exit 1), Ctrl-C stops it with one line (exit 130).
4. Write `<run>/manifest.json` and each stage's resolved config (`<run>/config/recipe.<stage>.toml`), then run the
   stages in order, each as its own `primerl <stage>` process; the manifest records each stage's outcome.

Stage options can be overridden on the command line as `--<stage>.<key>=value` (e.g. `--rl.max_steps=5`); overrides
are recorded in the manifest. `--dry-run` prints the resolved plan (stages, configs, pins) and exits 0, writing
nothing. `--rl.resume=true` on a run that already trained all its steps says so and exits 0, leaving it untouched.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w

from primerl.checklist.report import write_report
from primerl.checklist.runner import CHECKLIST_LOGS, run_checklist
from primerl.checklist.steps import STEPS
from primerl.config import ConfigError
from primerl.launch.console import stop_quietly
from primerl.launch.preflight import LaunchError, require_writable, visible_gpus
from primerl.launch.processes import Terminated, exit_with_parent, primerl_command, raise_terminated
from primerl.launch.restart import restart_fields
from primerl.recipes.manifest import (
    INTERRUPTED_EXIT_CODE,
    MANIFEST_FILE,
    stage_ended,
    stage_started,
    write_manifest,
)
from primerl.recipes.pins import format_checks
from primerl.recipes.plan import RunPlan, plan_run, stage_overrides, start_run
from primerl.recipes.schema import Recipe, RecipeError, recipe_in_argv
from primerl.recipes.stages import STAGE_KINDS, load_recipe, validate_stage, with_overrides

CHECK_FAILED_EXIT_CODE = 1


def run_stages(plan: RunPlan, manifest: dict[str, Any]) -> int:
    """Run each stage as `primerl <command> @ <its config>`; stop at the first that fails. Returns its exit code."""
    for stage in plan.recipe.info.stages:
        stage_started(manifest, stage)
        if stage == "rl":  # a resumed run's restarts so far (a requeued Slurm job's among them)
            manifest["stages"][stage].update(restart_fields(plan.configs[stage].output_dir))
        write_manifest(plan.run_dir, manifest)
        command = primerl_command(STAGE_KINDS[stage].command, "@", str(plan.config_file(stage)))
        print(f"primerl: stage {stage}: {' '.join(command[2:])}", file=sys.stderr, flush=True)
        try:
            code = subprocess.run(command, check=False).returncode
        except KeyboardInterrupt:
            code = INTERRUPTED_EXIT_CODE
        status = stage_ended(manifest, stage, code)
        if stage == "rl":  # counted at each restart too (by the rl stage's launcher, in the file)
            manifest["stages"][stage].update(restart_fields(plan.configs[stage].output_dir))
        write_manifest(plan.run_dir, manifest)
        if code != 0:
            print(f"primerl: stage {stage} {status} (exit code {code}); see {plan.run_dir}", file=sys.stderr)
            return code
    print(f"primerl: recipe {plan.recipe.name} finished; manifest: {plan.run_dir / MANIFEST_FILE}", file=sys.stderr)
    return 0


def stage_options_help(stages: list[str]) -> str:
    """Every option of each stage as it is given on a recipe's command line (`--rl.max_steps`); the stage directory
    key is left out (the runner sets it from --run-dir)."""
    from primerl.config.cli import field_help

    lines = []
    for stage in stages:
        kind = STAGE_KINDS[stage]
        lines += ["", f"{stage} stage options (override the recipe's [{stage}] table):"]
        lines += [line for line in field_help(kind.load_model(), f"{stage}.")
                  if not line.startswith(f"  --{stage}.{kind.run_dir_key} ")]
    return "\n".join(lines)


def _help_stages(argv: list[str], prog: str) -> list[str]:
    """The stages whose options `--help` lists: the recipe's, else the command's own (rl), else every kind."""
    if (path := recipe_in_argv(argv)) is not None:
        try:
            return list(load_recipe(path).info.stages)
        except RecipeError:
            pass
    return ["rl"] if prog == "rl" else list(STAGE_KINDS)


def _parser(prog: str, help_stages: list[str] | None = None) -> argparse.ArgumentParser:
    epilog = stage_options_help(help_stages) if help_stages else None
    if prog == "rl" and help_stages:
        epilog += ("\n\nWithout a recipe, rl runs a plain config: rl @ config.toml [--key value ...] takes the same "
                   "options\nwithout the 'rl.' prefix (rl @ config.toml --max_steps 5; rl @ config.toml --help).")
    parser = argparse.ArgumentParser(
        prog=prog,
        usage=f"{prog} recipe.toml [--run-dir DIR] [--allow-drift] [--no-check] [--smoke] [--dry-run] "
              "[--deterministic] [--<stage>.<key> value ...]",
        description="Run a recipe: verify its pins, run the checklist, then its stages. Stage options: "
        "--<stage>.<key> value (e.g. --rl.max_steps 5).",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("recipe", help="the recipe file")
    parser.add_argument("--run-dir", type=Path, help="run directory (default: runs/<recipe name>)")
    parser.add_argument("--allow-drift", action="store_true", help="run even if pins differ; record the drift")
    parser.add_argument("--no-check", action="store_true", help="do not run the validation checklist first")
    parser.add_argument("--smoke", action="store_true", help="run each stage's smoke variant (a few steps)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the resolved plan (stages, configs, pins) and exit; nothing is run or written")
    parser.add_argument("--deterministic", action="store_true",
                        help="the RL stage replays bit for bit (--rl.deterministic true: CPU, synchronous, one "
                        "thread per process; `primerl reproduce` checks it)")
    return parser


def main(argv: list[str] | None = None, prog: str = "primerl run") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = [a for a in argv if a != "@"]
    argv = [a[1:] if a.startswith("@") and a.endswith(".toml") else a for a in argv]
    wants_help = "-h" in argv or "--help" in argv
    args, rest = _parser(prog, _help_stages(argv, prog) if wants_help else None).parse_known_args(argv)
    exit_with_parent()
    try:
        recipe = load_recipe(args.recipe)
        recipe.require_supported()  # a capability this build lacks is the first thing to say
        overrides = stage_overrides(recipe, rest)
        if args.deterministic:
            if "rl" not in recipe.stages:
                raise RecipeError(f"--deterministic applies to an RL stage; recipe '{recipe.name}' has none")
            overrides.setdefault("rl", {})["deterministic"] = "true"
        checked = with_overrides(recipe, overrides)  # what the checklist checks: the recipe as this run resolves it
        run_dir = (args.run_dir or Path("runs") / recipe.name).resolve()
        if args.dry_run:
            print(describe_plan(checked, run_dir, smoke=args.smoke))
            return 0
        require_gpus(recipe)
        if (run_dir / MANIFEST_FILE).exists() and not _resumes(overrides):
            raise RecipeError(f"{run_dir} already holds a run; pass --run-dir for a new one (or --rl.resume=true)")
        if (run_dir / MANIFEST_FILE).exists() and (done := finished_run(checked, run_dir, args.smoke)):
            print(f"{prog}: nothing to do: {done}; the run directory is left as it is", file=sys.stderr)
            return 0
        plan = plan_run(recipe, run_dir, overrides, smoke=args.smoke, allow_drift=args.allow_drift)
        require_writable(plan.run_dir)
    except (RecipeError, ConfigError, LaunchError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)
    print(f"primerl: pins of {recipe.name}:\n{format_checks(plan.pins.checks)}", file=sys.stderr)
    if plan.pins.drifted:
        print(f"primerl: running with {len(plan.pins.drifted)} drifted pin(s) (--allow-drift); the manifest records "
              "them", file=sys.stderr)

    statuses = None
    if not args.no_check:
        statuses = run_checks(plan, checked, prog)
        if isinstance(statuses, int):
            return statuses
    manifest = start_run(plan, statuses)
    return run_stages(plan, manifest)


def run_checks(plan: RunPlan, checked: Recipe, prog: str, steps=STEPS) -> dict[str, str] | int:
    """Run the checklist on `checked` (the recipe with this run's command-line overrides): the step statuses, or the
    exit code when a step failed (1) or the checklist was interrupted (130: one line, no traceback)."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_term = signal.signal(signal.SIGTERM, raise_terminated) if in_main_thread else None
    try:
        report = run_checklist(checked, plan.run_dir, steps, log_dir=plan.run_dir / CHECKLIST_LOGS)
    except (KeyboardInterrupt, Terminated):
        stop_quietly(prog)  # the checklist said so in one line and stopped its steps; a further signal: one line
        return INTERRUPTED_EXIT_CODE
    if in_main_thread:
        signal.signal(signal.SIGTERM, previous_term)
    print("\n" + report.table(), flush=True)
    write_report(report, plan.run_dir / "checklist.json")
    if report.failed:
        names = ", ".join(s.name for s in report.failed)
        print(f"{prog}: checklist failed ({names}); nothing was trained. Report: {plan.run_dir / 'checklist.json'}"
              " (--no-check skips the checklist)", file=sys.stderr)
        return CHECK_FAILED_EXIT_CODE
    return report.statuses()


def describe_plan(recipe: Recipe, run_dir: Path, smoke: bool = False) -> str:
    """`--dry-run`: the resolved plan — stages, each stage's config as it would be written, the pins — without
    verifying the pins (`primerl recipe verify` does) or writing anything."""
    from primerl.config import to_toml

    stages = ", ".join(recipe.info.stages)
    hw = recipe.info.hardware
    where = f"{hw.gpus_per_node} GPU(s) per node" if hw.gpus_per_node else "CPU"
    lines = [f"recipe {recipe.name} ({recipe.path}): stages {stages}{' (smoke variant)' if smoke else ''}",
             f"run directory: {run_dir}", (f"hardware: {where}, {hw.min_memory_gb:g} GiB memory, "
             f"{hw.min_disk_gb:g} GiB disk")]
    if hw.needs_gpu and (found := len(visible_gpus())) < hw.gpus_per_node:
        lines.append(f"note: this machine has {found} GPU(s); the run itself would be refused here")
    if recipe.overrides:
        lines.append(f"command-line overrides: {recipe.overrides}")
    for stage in recipe.info.stages:
        cfg = validate_stage(recipe, stage, run_dir=run_dir, smoke=smoke)
        config_file = run_dir / "config" / f"recipe.{stage}.toml"
        lines += ["", f"# stage {stage}: `primerl {STAGE_KINDS[stage].command} @ {config_file}`", to_toml(cfg).rstrip()]
    pins = tomli_w.dumps({"pins": recipe.pins.model_dump(mode="json", exclude_none=True)}).rstrip()
    lines += ["", f"# pins (not verified here: `uv run primerl recipe verify {recipe.path}`)", pins, "",
              "nothing was run or written (--dry-run)"]
    return "\n".join(lines)


def finished_run(recipe: Recipe, run_dir: Path, smoke: bool = False) -> str | None:
    """What says the run in `run_dir` has nothing left to do: every stage completed and, for an rl stage, as many
    steps trained as its (possibly overridden) `max_steps`; None when something is left to run."""
    from primerl.monitor import read_metrics
    from primerl.recipes.manifest import read_manifest

    try:
        stages = read_manifest(run_dir).get("stages", {})
    except (OSError, ValueError):
        return None
    if any(stages.get(stage, {}).get("status") != "completed" for stage in recipe.info.stages):
        return None
    if "rl" not in recipe.info.stages:
        return f"{run_dir} completed its stages ({', '.join(recipe.info.stages)})"
    max_steps = validate_stage(recipe, "rl", run_dir=run_dir, smoke=smoke).max_steps
    rl_dir = run_dir / STAGE_KINDS["rl"].subdir if STAGE_KINDS["rl"].subdir else run_dir
    trained = max((int(r["step"]) for r in read_metrics(rl_dir, "trainer")), default=0)
    if trained < max_steps:
        return None
    return (f"{run_dir} already trained {trained}/{max_steps} step(s) (a larger --rl.max_steps trains on from the "
            "last checkpoint)")


def require_gpus(recipe: Recipe) -> None:
    """RecipeError when the recipe needs more GPUs per node than this machine shows (no torch import, no subprocess
    beyond `nvidia-smi -L`): refused before the checklist and before anything is written."""
    hardware = recipe.info.hardware
    if hardware.needs_gpu and (found := len(visible_gpus())) < hardware.gpus_per_node:
        raise RecipeError(
            f"recipe '{recipe.name}' needs {hardware.gpus_per_node} GPU(s) per node and this machine has {found}; "
            "nothing was run or written (run it on a GPU machine; tiny.toml and reverse-text.toml run on CPU)"
        )


def _resumes(overrides: Mapping[str, Any]) -> bool:
    return str(overrides.get("rl", {}).get("resume", "")).lower() in ("1", "true", "yes")
