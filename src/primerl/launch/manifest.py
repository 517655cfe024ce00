"""The manifest of a recipe run that a remote launcher starts: `<run>/manifest.json` as `primerl run` writes it
(`primerl.recipes.manifest`: the pins verified, the packages, the host's facts, the resolved rl stage config, its
outcome and its restarts), built on one host of the run, which shares the run directory with the others.

It is built from the recipe as the hosts see it and `<run>/launch/plan.json` (the command line's stage options, the
hosts, the processes and each host's checklist), which the manifest keeps under `launch`. Its packages, facts and
`checklist` are those of the host it is built on; the other hosts passed the same checklist (`launch.checklist`, and
their reports in `<run>/checklist/`). Restarts are counted in it as they happen (`primerl.launch.restart`).

    python -m primerl.launch.manifest start --run-dir RUN --recipe R --host H   # before any process starts
    python -m primerl.launch.manifest end --run-dir RUN --exit-code N           # when the run has ended

`launch ssh` runs both on its first host. A pin that drifted stops `start` with the pins named (exit 3), as it stops
`primerl run`: the launcher then starts nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from primerl.config import ConfigError
from primerl.launch.restart import restart_fields
from primerl.recipes.manifest import read_manifest, stage_ended, stage_started, write_manifest
from primerl.recipes.plan import plan_run, start_run
from primerl.recipes.schema import RecipeError
from primerl.recipes.stages import load_recipe

PLAN_FILE = "launch/plan.json"
STAGE = "rl"  # the one stage a launcher runs


def host_checklist(run_dir: Path, launch: dict[str, Any], host: str) -> dict[str, str] | None:
    """The checklist's step statuses on `host`: from the launch record (preflight's steps with them), else from the
    host's report `<run>/checklist/<host>.json`; None when neither has them."""
    if statuses := launch.get("checklist", {}).get(host):
        return dict(statuses)
    try:
        steps = json.loads((run_dir / "checklist" / f"{host}.json").read_text())["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {step["name"]: step["status"] for step in steps}


def start(run_dir: Path, recipe_path: Path, host: str) -> dict[str, Any]:
    """Verify the pins here, write the manifest with the rl stage running and the launch record; returns it. Raises
    RecipeError (DriftError for drifted pins) or ConfigError, having written nothing."""
    launch = json.loads((run_dir / PLAN_FILE).read_text())
    plan = plan_run(load_recipe(recipe_path), run_dir, launch.get("overrides") or {}, progress=lambda _line: None)
    manifest = start_run(plan, host_checklist(plan.run_dir, launch, host))
    manifest["launch"] = launch
    stage_started(manifest, STAGE)
    write_manifest(plan.run_dir, manifest)
    return manifest


def end(run_dir: Path, code: int) -> dict[str, Any]:
    """Record the rl stage's outcome (its exit code) and its restarts in the manifest; returns it."""
    manifest = read_manifest(run_dir)
    stage_ended(manifest, STAGE, code)
    manifest["stages"][STAGE].update(restart_fields(run_dir))
    write_manifest(run_dir, manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m primerl.launch.manifest", description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("start", "end"))
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--recipe", type=Path, help="start: the recipe as this host sees it")
    parser.add_argument("--host", help="start: this host's name in the launch (whose checklist the manifest keeps)")
    parser.add_argument("--exit-code", type=int, help="end: the run's exit code")
    ns = parser.parse_args(argv)
    run_dir = ns.run_dir.resolve()
    try:
        if ns.what == "start":
            if ns.recipe is None or ns.host is None:
                parser.error("start needs --recipe and --host")
            start(run_dir, ns.recipe, ns.host)
        else:
            if ns.exit_code is None:
                parser.error("end needs --exit-code")
            end(run_dir, ns.exit_code)
    except (RecipeError, ConfigError) as e:  # one line (the launcher shows the error line): the pins named in it
        print("error: " + " ".join(line.strip() for line in str(e).splitlines()), file=sys.stderr)
        return getattr(e, "exit_code", 2)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {run_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
