"""Every recipe and config file loads and validates; bad recipes fail on load with one line naming the problem."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from recipe_helpers import RECIPES, ROOT, TINY_RECIPE, primerl

from primerl.config import ConfigError, load
from primerl.recipes import CAPABILITIES, RecipeError, UnsupportedCapabilityError, is_recipe, load_recipe
from primerl.recipes.schema import recipe_in_argv
from primerl.recipes.stages import stage_values, with_overrides

RECIPE_FILES = sorted(RECIPES.glob("*.toml"))
CONFIG_FILES = sorted((ROOT / "configs").rglob("*.toml"))


def process_config_models():
    from primerl.config.eval import EvalConfig
    from primerl.config.inference import InferenceConfig
    from primerl.config.orchestrator import OrchestratorConfig
    from primerl.config.rl import RLConfig
    from primerl.config.sft import SFTConfig
    from primerl.config.trainer import TrainerConfig

    return [RLConfig, TrainerConfig, SFTConfig, InferenceConfig, OrchestratorConfig, EvalConfig]


def test_the_recipes_directory_has_every_example():
    names = {load_recipe(path).name for path in RECIPE_FILES}
    expected = {
        "tiny", "reverse-text", "reverse-text-qwen3-0.6b", "wordle", "alphabet-sort", "wiki-search",
        "hendrycks-sanity", "qwen3-30b-a3b-math", "qwen3-30b-a3b-swe", "qwen3-30b-a3b-tools", "glm-4.5-air",
        "nemotron-3-super-120b-swe", "minimax-m2.5", "intellect-3.1", "glm-5",
    }
    assert expected <= names


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.name for p in RECIPE_FILES])
def test_every_recipe_loads_and_its_stages_validate(path):
    recipe = load_recipe(path)
    assert recipe.path == path.resolve()
    assert list(recipe.stages) == recipe.info.stages
    header = path.read_text().splitlines()[0]
    assert header.startswith(f"# {recipe.name} "), "each recipe opens with a header comment naming it"
    for label in ("What it teaches:", "Expected reward:", "Time:", "Hardware:"):
        assert label in path.read_text(), f"{path.name}: header comment lacks {label!r}"


@pytest.mark.parametrize("path", CONFIG_FILES, ids=[str(p.relative_to(ROOT)) for p in CONFIG_FILES])
def test_every_config_file_validates_against_a_process_config(path):
    errors = []
    for model in process_config_models():
        try:
            load(model, [str(path)])
            return
        except ConfigError as e:
            errors.append(f"{model.__name__}: {e}")
    pytest.fail(f"{path} validates against no process config:\n" + "\n".join(errors))


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.name for p in RECIPE_FILES])
def test_unsupported_capabilities_are_named_exactly(path):
    recipe = load_recipe(path)
    lacking = [c for c in recipe.info.requires if not CAPABILITIES[c][0]]
    if not lacking:
        recipe.require_supported()
        return
    with pytest.raises(UnsupportedCapabilityError) as info:
        recipe.require_supported()
    message = str(info.value)
    for capability in CAPABILITIES:
        assert (f"{capability} (" in message) == (capability in lacking)


def test_advanced_recipes_lack_the_capabilities_the_issue_names():
    lacking = {
        name: set(load_recipe(RECIPES / f"{name}.toml").info.missing_capabilities)
        for name in ("glm-5", "nemotron-3-super-120b-swe", "minimax-m2.5")
    }
    assert {"pd-disaggregation", "fp8"} <= lacking["glm-5"]
    assert "context-parallel" in lacking["nemotron-3-super-120b-swe"]
    assert "fp8" in lacking["minimax-m2.5"]


def test_running_an_unsupported_recipe_is_one_clear_error_with_exit_2(tmp_path):
    proc = primerl("run", "recipes/glm-5.toml", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "pd-disaggregation" in lines[0] and "fp8" in lines[0]
    assert not (tmp_path / "run").exists()


def test_is_recipe_tells_recipes_from_configs():
    assert all(is_recipe(path) for path in RECIPE_FILES)
    assert not any(is_recipe(path) for path in CONFIG_FILES)
    assert recipe_in_argv(["@", str(TINY_RECIPE), "--no-check"]) == str(TINY_RECIPE)
    assert recipe_in_argv([f"@{TINY_RECIPE}"]) == str(TINY_RECIPE)
    assert recipe_in_argv(["@", str(CONFIG_FILES[0]), "--max_steps", "3"]) is None


def write_recipe(path: Path, body: str, pins: str | None = None) -> Path:
    pins = pins if pins is not None else textwrap.dedent("""
        [pins]
        python = "3.11"
        lock_sha256 = "unpinned"
        [pins.model]
        source = "tiny"
        """)
    path.write_text(textwrap.dedent(body) + pins)
    return path


BASE = """
    [recipe]
    name = "t"
    description = "a test recipe"
    stages = ["rl"]
    [recipe.hardware]
    cpu_allowed = true
    """


def test_stage_tables_may_include_config_files(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "base.toml").write_text("max_steps = 7\nseq_len = 512\n[model]\nname = \"tiny\"\n")
    recipe = load_recipe(write_recipe(tmp_path / "r.toml", BASE + """
        [rl]
        include = ["configs/base.toml"]
        seq_len = 256
        """))
    values = stage_values(recipe, "rl", run_dir=tmp_path / "run")
    assert (values["max_steps"], values["seq_len"], values["model"]["name"]) == (7, 256, "tiny")
    assert values["output_dir"] == str(tmp_path / "run")


@pytest.mark.parametrize(
    ("body", "pins", "needle"),
    [
        (BASE + "[rl]\nmax_stepz = 3\n", None, "[rl] unknown key 'max_stepz'"),
        (BASE + "[rl]\nmax_steps = 0\n", None, "'max_steps'"),
        (BASE.replace('stages = ["rl"]', 'stages = ["rl", "sft"]') + "[rl]\n", None, "no [sft] table"),
        (BASE.replace("cpu_allowed = true", "nodes = 2\ngpus_per_node = 8") + "[rl]\n", None, "'multi-node'"),
        (BASE.replace('stages = ["rl"]', 'stages = ["rl"]\nrequires = ["warp-drive"]') + "[rl]\n", None,
         "unknown capabilities"),
        (BASE + "[rl]\n", '[pins]\npython = "3.11"\nlock_sha256 = "abc"\n[pins.model]\nsource = "tiny"\n',
         "lock_sha256"),
        (BASE + "[rl]\n", '[pins]\npython = "3.11"\nlock_sha256 = "unpinned"\n[pins.model]\nsource = "Qwen/Qwen3-0.6B"\n',
         "needs a revision"),
        (BASE + "[rl]\n", '[pins]\npython = "3.11"\nlock_sha256 = "unpinned"\n', "missing required key 'pins.model'"),
    ],
    ids=["unknown-stage-key", "bad-stage-value", "missing-stage", "nodes-without-multi-node", "unknown-capability",
         "bad-hash", "hub-model-without-revision", "missing-model-pin"],
)
def test_bad_recipes_fail_on_load_naming_the_problem(tmp_path, body, pins, needle):
    path = write_recipe(tmp_path / "r.toml", body, pins)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_a_stage_revision_that_contradicts_the_pin_is_refused(tmp_path):
    pins = textwrap.dedent("""
        [pins]
        python = "3.11"
        lock_sha256 = "unpinned"
        [pins.model]
        source = "Org/Model"
        revision = "0123456789abcdef0123456789abcdef01234567"
        """)
    ok = load_recipe(write_recipe(tmp_path / "ok.toml", BASE + '[rl.model]\nname = "Org/Model"\n', pins))
    assert stage_values(ok, "rl")["model"]["revision"] == "0123456789abcdef0123456789abcdef01234567"
    bad = write_recipe(tmp_path / "bad.toml", BASE + '[rl.model]\nname = "Org/Model"\nrevision = "main"\n', pins)
    with pytest.raises(RecipeError, match="differs from pins.model.revision"):
        load_recipe(bad)


def test_with_overrides_is_the_recipe_as_a_run_with_them_resolves_it():
    from primerl.recipes.stages import validate_stage

    recipe = load_recipe(TINY_RECIPE)
    overrides = {"rl": {"max_steps": "7", "orchestrator": {"env": {"args": {"reverse": "words"}}}}}
    changed = with_overrides(recipe, overrides)
    assert validate_stage(changed, "rl").max_steps == 7
    assert validate_stage(changed, "rl").orchestrator.env.args == {"reverse": "words"}
    smoke = validate_stage(changed, "rl", smoke=True)  # the smoke variant stays a smoke variant, with the env args
    assert smoke.max_steps == 2 and smoke.orchestrator.env.args == {"reverse": "words"}
    assert validate_stage(recipe, "rl").max_steps == 3 and recipe.overrides == {}  # the recipe itself is unchanged
    with pytest.raises(RecipeError, match=r"'max_steps'.*from --rl.max_steps on the command line"):
        with_overrides(recipe, {"rl": {"max_steps": "many"}})
    with pytest.raises(RecipeError, match="stages the recipe does not have: sft"):
        with_overrides(recipe, {"sft": {"max_steps": "1"}})
