"""A recipe about to run: `plan_run` resolves every stage's config (with the command line's `--<stage>.<key>`
overrides, `stage_overrides`) and verifies the pins, writing nothing; `start_run` then writes the manifest and each
stage's resolved config into the run directory. Drift of a pin is a `DriftError` (exit code 3) unless allowed, in
which case the manifest records it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from primerl.config import to_toml
from primerl.config.loader import closest_option, is_option, parse_args
from primerl.recipes.manifest import build_manifest, write_manifest
from primerl.recipes.pins import PinReport, find_lock_file, stderr_progress, verify_pins
from primerl.recipes.schema import Recipe, RecipeError
from primerl.recipes.stages import STAGE_KINDS, validate_stage

DRIFT_EXIT_CODE = 3


class DriftError(RecipeError):
    """Pins differ from what this machine has; the message lists pinned vs found."""

    exit_code = DRIFT_EXIT_CODE


@dataclass
class RunPlan:
    """A recipe about to run: its resolved stage configs and the verified pins."""

    recipe: Recipe
    run_dir: Path
    configs: dict[str, pydantic.BaseModel]
    overrides: dict[str, Any]
    pins: PinReport
    allow_drift: bool

    def config_file(self, stage: str) -> Path:
        return self.run_dir / "config" / f"recipe.{stage}.toml"


def plan_run(recipe: Recipe, run_dir: Path, overrides: Mapping[str, Any] | None = None, smoke: bool = False,
             allow_drift: bool = False, progress=stderr_progress) -> RunPlan:
    """Resolve the stage configs and verify the pins; raises `RecipeError` (bad config) or `DriftError`. Writes
    nothing."""
    recipe.require_supported()
    run_dir = run_dir.resolve()
    overrides = dict(overrides or {})
    configs = {
        stage: validate_stage(recipe, stage, run_dir=run_dir, smoke=smoke, overrides=overrides.get(stage))
        for stage in recipe.info.stages
    }
    pins = verify_pins(recipe, progress=progress)
    if pins.drifted and not allow_drift:
        lines = "\n".join(f"  {c.line()}" for c in pins.drifted)
        raise DriftError(
            f"recipe '{recipe.name}': {len(pins.drifted)} pin(s) differ from this machine; nothing was written:\n"
            f"{lines}\n(fix the machine, update the pins with `primerl recipe lock {recipe.path}`, or pass "
            "--allow-drift to run anyway and record the drift)"
        )
    return RunPlan(recipe, run_dir, configs, overrides, pins, allow_drift)


def start_run(plan: RunPlan, checklist: Mapping[str, str] | None) -> dict[str, Any]:
    """Write the manifest and the resolved stage configs into the run directory; returns the manifest."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    for stage, cfg in plan.configs.items():
        path = plan.config_file(stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(to_toml(cfg))
    manifest = build_manifest(
        plan.recipe,
        plan.run_dir,
        plan.pins.as_list(),
        plan.allow_drift,
        find_lock_file(plan.recipe.path),
        {stage: cfg.model_dump(mode="json") for stage, cfg in plan.configs.items()},
        plan.overrides,
        checklist,
    )
    write_manifest(plan.run_dir, manifest)
    return manifest



def stage_overrides(recipe: Recipe, argv: list[str]) -> dict[str, Any]:
    """`--rl.max_steps=5 --sft.optim.lr 1e-5` -> {"rl": {"max_steps": "5"}, "sft": {"optim": {"lr": "1e-5"}}}."""
    parsed = parse_args(argv)
    if parsed.files or parsed.dry_run:
        raise RecipeError("a recipe run takes one recipe file; stage options look like --<stage>.<key>=value")
    out: dict[str, Any] = {}
    for dotted, value in parsed.overrides:
        stage, _, key = dotted.partition(".")
        if stage not in recipe.stages or not key:
            raise RecipeError(f"--{dotted}: overrides name a stage of the recipe ({', '.join(recipe.stages)}) then a key")
        model = STAGE_KINDS[stage].load_model()
        if not is_option(model, key):
            close = closest_option(model, key)
            hint = f"did you mean --{stage}.{close}? " if close else ""
            raise RecipeError(f"--{dotted}: the {stage} stage has no option '{key}' ({hint}--help lists them)")
        node = out.setdefault(stage, {})
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
