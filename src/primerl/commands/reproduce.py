"""`primerl reproduce RUN_DIR --steps K`: replay the first K steps of a finished recipe run and compare them.

1. Read `RUN_DIR/manifest.json` and verify its pins (lock, model, data, environment, image) against this machine;
   drift is refused in one line (exit 3), unless `--allow-drift`, which replays anyway and says so.
2. Replay the RL stage's recorded config (its seeds included) for K steps in a new run directory (`--out`, default
   `RUN_DIR.replay-<n>`), as `primerl rl @ <out>/config/replay.rl.toml`.
3. Print a table per step — the batch's token ids equal or not, reward, loss, grad norm, weight checksum — and write
   it to `<out>/reproduce.json`. A deterministic run (`rl --deterministic`) must match exactly; another is compared
   within tolerances, and the table says why (`primerl.recipes.replay`). Exit 1 at a difference, naming the first
   differing step and field; 0 when every compared field agrees.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from primerl.config import ConfigError, load, to_toml
from primerl.config.rl import RLConfig
from primerl.launch.processes import exit_with_parent, primerl_command
from primerl.recipes.manifest import MANIFEST_FILE, read_manifest
from primerl.recipes.pins import stderr_progress, verify_pins
from primerl.recipes.plan import DRIFT_EXIT_CODE
from primerl.recipes.replay import ReplayError, compare_steps, is_deterministic, read_steps, replay_config
from primerl.recipes.schema import Pins, Recipe, RecipeError, RecipeInfo

PROG = "primerl reproduce"
DIFFERENCE_EXIT_CODE = 1
RESULT_FILE = "reproduce.json"


def recipe_of(manifest: dict[str, Any]) -> Recipe:
    """The recipe a manifest recorded, rebuilt from the manifest alone (its pins as declared when the run started);
    the recipe file itself need not exist any more."""
    try:
        info = manifest["recipe"]
        recipe_info = RecipeInfo.model_validate({k: info[k] for k in ("name", "description", "stages", "requires",
                                                                      "hardware")})
        pins = Pins.model_validate(manifest["pins"]["declared"])
    except (KeyError, TypeError, ValueError) as e:
        raise ReplayError(f"the manifest does not hold a recipe's pins ({e.__class__.__name__}: {e})") from None
    return Recipe(path=Path(info["path"]), info=recipe_info, pins=pins, stages={}, smoke={})


def default_out(run_dir: Path) -> Path:
    n = 1
    while (out := run_dir.with_name(f"{run_dir.name}.replay-{n}")).exists():
        n += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description="Replay the first steps of a finished recipe run from its "
                                     "manifest and compare them step by step.")
    parser.add_argument("run_dir", type=Path, help="the run directory (holds manifest.json)")
    parser.add_argument("--steps", type=int, default=2, help="steps to replay (default 2)")
    parser.add_argument("--out", type=Path, help="the replay's run directory (default: RUN_DIR.replay-<n>)")
    parser.add_argument("--allow-drift", action="store_true", help="replay even if pins differ from this machine")
    args = parser.parse_args(argv)
    exit_with_parent()
    run_dir = args.run_dir.resolve()
    try:
        if not (run_dir / MANIFEST_FILE).is_file():
            raise ReplayError(f"{run_dir} has no {MANIFEST_FILE} (only recipe runs write one: rl recipe.toml)")
        manifest = read_manifest(run_dir)
        out = (args.out or default_out(run_dir)).resolve()
        if out.exists() and any(out.iterdir()):
            raise ReplayError(f"{out} already exists and is not empty; pass another --out")
        replay_cfg, _ = load(RLConfig, [], base=replay_config(manifest, out, args.steps))
        original = read_steps(run_dir, args.steps)
        if all(s.loss is None for s in original):
            raise ReplayError(f"{run_dir} has no trainer metrics for steps 1..{args.steps} (did the run train?)")
        recipe = recipe_of(manifest)
        report = verify_pins(recipe, progress=stderr_progress)
    except (ReplayError, RecipeError, ConfigError, OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if report.drifted:
        drift = "; ".join(c.line() for c in report.drifted)
        if not args.allow_drift:
            print(f"{PROG}: error: {len(report.drifted)} pin(s) of {run_dir.name} differ from this machine ({drift}); "
                  "nothing was replayed (--allow-drift replays anyway)", file=sys.stderr)
            return DRIFT_EXIT_CODE
        print(f"{PROG}: replaying with {len(report.drifted)} drifted pin(s) (--allow-drift): {drift}",
              file=sys.stderr)
    exact = is_deterministic(manifest)
    print(f"{PROG}: replaying {args.steps} step(s) of {run_dir} into {out} "
          f"({'deterministic: every field must be equal' if exact else 'not deterministic: within tolerances'})",
          file=sys.stderr, flush=True)
    config_file = out / "config" / "replay.rl.toml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text(to_toml(replay_cfg))
    code = subprocess.run(primerl_command("rl", "@", str(config_file)), check=False).returncode
    comparison = compare_steps(original, read_steps(out, args.steps), exact)
    result = {"run_dir": str(run_dir), "replay_dir": str(out), "steps": args.steps, "replay_exit_code": code,
              "drift": [c.name for c in report.drifted], "allow_drift": args.allow_drift, **comparison.as_json()}
    (out / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    print(comparison.table())
    if comparison.note:
        print(f"note: {comparison.note}")
    first = comparison.first_difference
    if code != 0:
        where = f"; first difference at step {first[0]}, {first[1]}" if first else ""
        print(f"{PROG}: the replay failed (exit code {code}; logs in {out / 'logs'}){where}", file=sys.stderr)
        return DIFFERENCE_EXIT_CODE
    if first is not None:
        print(f"{PROG}: step {first[0]} differs first, in {first[1]} (details: {out / RESULT_FILE})", file=sys.stderr)
        return DIFFERENCE_EXIT_CODE
    print(f"{PROG}: {args.steps} step(s) reproduced: every compared field "
          f"{'is equal' if exact else 'agrees within its tolerance'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
