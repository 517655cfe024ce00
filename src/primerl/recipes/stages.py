"""A recipe's stages as their processes see them: reading and validating a recipe file (`load_recipe`), and resolving
one stage's config (`stage_layers`, `stage_values`, `validate_stage`) from its table and includes, the command
line's overrides (`with_overrides`), its smoke variant, the pinned model revision and `${recipe_dir}`/`${run_dir}`.

The file format is in `primerl.recipes.schema`. Nothing here imports torch.
"""

from __future__ import annotations

import copy
import dataclasses
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from primerl.config.loader import ConfigError, Layers, read_toml
from primerl.recipes.schema import UNPINNED, ModelPin, Recipe, RecipeError, RecipeFile

RUN_DIR_VAR = "${run_dir}"  # in stage configs: the recipe run's directory
RECIPE_DIR_VAR = "${recipe_dir}"  # in stage configs: the directory holding the recipe file


@dataclass(frozen=True)
class StageKind:
    """How the recipe runner drives one kind of stage: its config model, its command, where its outputs go."""

    name: str
    config_model: str  # "module:Class" of the stage's config
    command: str  # the `primerl <command>` that runs a resolved config file
    run_dir_key: str  # top-level config key the runner sets to the stage's directory
    subdir: str  # the stage's directory relative to the recipe's run directory ("" = the run directory itself)

    def load_model(self) -> type[pydantic.BaseModel]:
        import importlib

        module_name, _, attr = self.config_model.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            raise RecipeError(f"stage '{self.name}' needs {self.config_model}, which this build does not have") from None

    def recipe_defaults(self) -> dict[str, Any]:
        """What a recipe's stage sets before its own table (`RECIPE_DEFAULTS` of the config's module, if any): where
        a run from a recipe wants another default than a plain config (rl: `max_restarts`)."""
        import importlib

        self.load_model()
        return dict(getattr(importlib.import_module(self.config_model.partition(":")[0]), "RECIPE_DEFAULTS", {}))


STAGE_KINDS: dict[str, StageKind] = {
    "sft": StageKind("sft", "primerl.config.sft:SFTConfig", "sft", "run_dir", "sft"),
    "rl": StageKind("rl", "primerl.config.rl:RLConfig", "rl", "output_dir", ""),
}


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe, stage configs included. Raises `RecipeError` with one line per problem."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe not found: {path}")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: invalid TOML: {e}") from None
    if not isinstance(raw.get("recipe"), dict):
        raise RecipeError(f"{path}: not a recipe (no [recipe] table)")
    try:
        parsed = RecipeFile.model_validate(raw)
    except pydantic.ValidationError as e:
        raise RecipeError(f"{path}: {_describe(e)}") from None
    stages: dict[str, dict[str, Any]] = {}
    origins: dict[str, dict[str, str]] = {}
    for name in parsed.recipe.stages:
        table = getattr(parsed, name)
        if table is None:
            raise RecipeError(f"{path}: stage '{name}' is listed in recipe.stages but has no [{name}] table")
        layers = _with_includes(table, path, name)
        stages[name], origins[name] = layers.values, layers.origin
    for name in ("sft", "rl"):
        if getattr(parsed, name) is not None and name not in stages:
            raise RecipeError(f"{path}: [{name}] is given but '{name}' is not in recipe.stages")
    for name in parsed.smoke:
        if name not in stages:
            raise RecipeError(f"{path}: [smoke.{name}] names a stage the recipe does not have")
    recipe = Recipe(path=path.resolve(), info=parsed.recipe, pins=parsed.pins, stages=stages, smoke=parsed.smoke,
                    deploy=parsed.deploy, origins=origins)
    for name in stages:
        validate_stage(recipe, name, smoke=False)
        if name in recipe.smoke:
            validate_stage(recipe, name, smoke=True)
    return recipe


def _with_includes(table: dict[str, Any], recipe_path: Path, stage: str) -> Layers:
    table = dict(table)
    includes = table.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise RecipeError(f"{recipe_path}: [{stage}] include must be a path or a list of paths")
    layers = Layers()
    try:
        for inc in includes:
            layers.merge(read_toml(recipe_path.parent / inc), f"{inc} (included by [{stage}])")
    except ConfigError as e:
        raise RecipeError(f"{recipe_path}: [{stage}] {e}") from None
    layers.merge(table, f"{recipe_path.name} [{stage}]")
    return layers


def stage_layers(recipe: Recipe, stage: str, run_dir: Path | None = None, smoke: bool = False,
                 overrides: Mapping[str, Any] | None = None) -> Layers:
    """The raw config of one stage with where each value came from: its table (and includes), the recipe's own
    command-line overrides (`with_overrides`), its smoke overrides (when `smoke`), then `overrides`; with the
    pinned model revision filled in, `${recipe_dir}` expanded and, when `run_dir` is given, `${run_dir}` expanded and
    the stage's directory set."""
    kind = STAGE_KINDS[stage]
    layers = Layers()
    layers.merge(kind.recipe_defaults(), "recipe defaults")
    layers.merge(recipe.stages[stage], f"{recipe.path.name} [{stage}]")
    layers.origin.update(recipe.origins.get(stage, {}))
    _merge_command_line(layers, recipe.overrides.get(stage, {}), stage)
    if smoke and stage in recipe.smoke:
        layers.merge(recipe.smoke[stage], f"{recipe.path.name} [smoke.{stage}]")
    if overrides:
        _merge_command_line(layers, overrides, stage)
    values = _pin_model_revision(layers.values, recipe.pins.model, recipe.path, stage)
    values = expand(values, RECIPE_DIR_VAR, str(recipe.path.parent))
    if run_dir is not None:
        values = expand(values, RUN_DIR_VAR, str(run_dir))
        values[kind.run_dir_key] = str(run_dir / kind.subdir) if kind.subdir else str(run_dir)
        layers.origin[kind.run_dir_key] = "the run directory"
    return Layers(values, layers.origin)


def _merge_command_line(layers: Layers, overrides: Mapping[str, Any], stage: str, prefix: str = "") -> None:
    """Lay `overrides` over `layers`, each value's source named as the command-line option that gave it."""
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            _merge_command_line(layers, value, stage, dotted + ".")
            continue
        node: dict[str, Any] = {}
        leaf = node
        *parents, last = dotted.split(".")
        for part in parents:
            leaf = leaf.setdefault(part, {})
        leaf[last] = value
        layers.merge(node, f"--{stage}.{dotted} on the command line")


def stage_values(recipe: Recipe, stage: str, run_dir: Path | None = None, smoke: bool = False,
                 overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The raw config of one stage (`stage_layers` without the sources)."""
    return stage_layers(recipe, stage, run_dir, smoke, overrides).values


def validate_stage(recipe: Recipe, stage: str, run_dir: Path | None = None, smoke: bool = False,
                   overrides: Mapping[str, Any] | None = None) -> pydantic.BaseModel:
    """The stage's resolved config object (its process's config model). Raises `RecipeError` naming the key."""
    from primerl.config.loader import load

    model = STAGE_KINDS[stage].load_model()
    layers = stage_layers(recipe, stage, run_dir, smoke, overrides)
    if run_dir is None:  # validate without a run directory: `${run_dir}` stays a placeholder path
        layers = Layers(expand(layers.values, RUN_DIR_VAR, "run"), layers.origin)
    try:
        cfg, _ = load(model, [], base=layers)
    except ConfigError as e:
        where = f"[smoke.{stage}]" if smoke else f"[{stage}]"
        raise RecipeError(f"{recipe.path}: {where} {e}") from None
    return cfg


def _pin_model_revision(values: dict[str, Any], pin: ModelPin, path: Path, stage: str) -> dict[str, Any]:
    """Every `model = {name = <pinned source>}` table in the stage gets the pinned revision; a different revision
    there is an error (the pin is the one place a revision is written)."""

    def visit(node: Any, dotted: tuple[str, ...]) -> Any:
        if not isinstance(node, dict):
            return node
        out = {k: visit(v, (*dotted, k)) for k, v in node.items()}
        if dotted[-1:] == ("model",) and out.get("name") == pin.source and pin.revision not in (None, UNPINNED):
            given = out.get("revision")
            if given not in (None, pin.revision):
                key = ".".join((*dotted, "revision"))
                raise RecipeError(
                    f"{path}: [{stage}] {key} = {given!r} differs from pins.model.revision {pin.revision!r}"
                )
            out["revision"] = pin.revision
        return out

    return visit(values, ())


def expand(node: Any, variable: str, value: str) -> Any:
    """Replace `variable` (`${run_dir}`, `${recipe_dir}`) by `value` in every string of a config tree."""
    if isinstance(node, dict):
        return {k: expand(v, variable, value) for k, v in node.items()}
    if isinstance(node, list):
        return [expand(v, variable, value) for v in node]
    if isinstance(node, str):
        return node.replace(variable, value)
    return node




def with_overrides(recipe: Recipe, overrides: Mapping[str, Mapping[str, Any]]) -> Recipe:
    """`recipe` as a run with these command-line overrides sees it (`{"rl": {"max_steps": "5"}}`): every stage
    config, its smoke variant included, is resolved with them; the checklist is given this. Raises `RecipeError`
    when a stage's config is no longer valid."""
    unknown = [stage for stage in overrides if stage not in recipe.stages]
    if unknown:
        raise RecipeError(f"overrides name stages the recipe does not have: {', '.join(unknown)}")
    merged = {stage: copy.deepcopy(recipe.overrides.get(stage, {})) for stage in recipe.stages}
    for stage, table in overrides.items():
        layers = Layers(merged[stage])
        layers.merge(table, "overrides")
        merged[stage] = layers.values
    recipe = dataclasses.replace(recipe, overrides={k: v for k, v in merged.items() if v})
    for stage in recipe.stages:
        validate_stage(recipe, stage, smoke=False)
        if stage in recipe.smoke:
            validate_stage(recipe, stage, smoke=True)
    return recipe


def _describe(e: pydantic.ValidationError) -> str:
    lines = []
    for err in e.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key '{key}'")
        elif err["type"] == "missing":
            lines.append(f"missing required key '{key}'")
        else:
            lines.append(f"'{key}': {err['msg']}")
    return "; ".join(lines)
