"""The recipe file: `[recipe]` (what and on which hardware), `[pins]` (what exactly), then one table per stage.

A recipe is a TOML file with a top-level `[recipe]` table — that table is what tells a recipe from a plain config.

    [recipe]            name, description, stages = ["sft", "rl"], requires = [capabilities]
    [recipe.hardware]   gpus_per_node, gpu_memory_gb, nodes, cpu_allowed, min_memory_gb, min_disk_gb
    [pins]              python, lock_sha256
    [pins.packages]     distribution = "version"
    [pins.model]        source, revision   and  [pins.model.files]  "relative/path" = "sha256"
    [pins.environment]  package, version, sha256 (of its source tree: primerl.digests.sha256_tree)
    [pins.data]         "package/path" or "./path" = "sha256"
    [pins.images]       amd64 / arm64 = "sha256:<digest>"
    [sft] / [rl]        the stage's config: the schema of `primerl sft` / `primerl rl`; `include = [...]` pulls in
                        config files (paths relative to the recipe); strings may use `${recipe_dir}` and
                        `${run_dir}` (the run's directory, e.g. to start RL from the SFT stage's weights)
    [smoke.sft] / [smoke.rl]   overrides that turn a stage into its few-step smoke variant (used by the checklist)
    [deploy]            where it runs beyond this machine: `primerl launch ssh|slurm` (schema: `primerl.config.deploy`)

A pin whose value is `"unpinned"` is known to be missing: verification reports it as unpinned, never as verified.
Loading (`primerl.recipes.stages.load_recipe`) validates everything, including each stage's config against its
process's schema, and raises `RecipeError` with one line per problem. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from primerl.config.base import Section, known_names

UNPINNED = "unpinned"

_SHA256 = re.compile(r"[0-9a-f]{64}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_IMAGE_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


class RecipeError(Exception):
    """A recipe that cannot be loaded or run as written. The message names the file and the problem."""

    exit_code = 2


class UnsupportedCapabilityError(RecipeError):
    """The recipe needs capabilities this build of primerl does not have."""


# Capabilities a recipe may declare in `requires`, and whether this build of primerl has them.
CAPABILITIES: dict[str, tuple[bool, str]] = {
    "fsdp": (True, "FSDP2 data-parallel training over several GPUs"),
    "lora": (True, "LoRA adapter training (merged for inference)"),
    "multi-turn": (True, "multi-turn environments"),
    "tools": (True, "tool-calling environments"),
    "tensor-parallel-inference": (True, "vLLM tensor-parallel inference"),
    "multi-node": (False, "training and inference spread over several nodes"),
    "expert-parallel": (False, "expert parallelism for mixture-of-experts models"),
    "context-parallel": (False, "context parallelism for sequences longer than one GPU holds"),
    "pd-disaggregation": (False, "prefill/decode-disaggregated inference"),
    "fp8": (False, "FP8 training and inference"),
    "code-sandbox": (False, "sandboxed code execution for software-engineering environments"),
}


def _check_sha256(value: str, what: str) -> str:
    if value != UNPINNED and not _SHA256.fullmatch(value):
        raise ValueError(f"{what} must be 64 lowercase hex digits or {UNPINNED!r}, got {value!r}")
    return value


class Hardware(Section):
    """What the machine must have. `gpus_per_node = 0` means the recipe runs on CPU."""

    gpus_per_node: int = Field(0, ge=0, description="GPUs each node needs (0: a CPU recipe)")
    gpu_memory_gb: float = Field(0, ge=0, description="memory each of those GPUs needs, GiB")
    nodes: int = Field(1, ge=1, description="nodes the run spans")
    cpu_allowed: bool = Field(False, description="the recipe also runs (slowly) on a machine without GPUs")
    min_memory_gb: float = Field(0, ge=0, description="host memory the run needs, GiB")
    min_disk_gb: float = Field(1, ge=0, description="free disk the run directory needs, GiB")

    @model_validator(mode="after")
    def _cpu_recipe_runs_on_cpu(self) -> Hardware:
        if self.gpus_per_node == 0 and not self.cpu_allowed:
            raise ValueError("a recipe with gpus_per_node = 0 runs on CPU: set cpu_allowed = true")
        return self

    @property
    def needs_gpu(self) -> bool:
        return self.gpus_per_node > 0 and not self.cpu_allowed


class RecipeInfo(Section):
    name: str = Field(..., pattern=r"^[a-z0-9][a-z0-9.-]*$", description="short name; the default run directory")
    description: str = Field(..., min_length=1, description="one paragraph: what the recipe teaches")
    stages: list[Literal["sft", "rl"]] = Field(..., min_length=1, description="stages, run in this order")
    requires: Annotated[list[str], known_names(CAPABILITIES, "capabilities", "known")] = Field(
        default_factory=list, description="capabilities the recipe needs (see CAPABILITIES)"
    )
    hardware: Hardware = Field(default_factory=Hardware, description="hardware the recipe needs")

    @field_validator("stages")
    @classmethod
    def _unique(cls, stages: list[str]) -> list[str]:
        if len(set(stages)) != len(stages):
            raise ValueError(f"stages must not repeat, got {stages}")
        return stages

    @model_validator(mode="after")
    def _multi_node_declared(self) -> RecipeInfo:
        if self.hardware.nodes > 1 and "multi-node" not in self.requires:
            raise ValueError(f"hardware.nodes = {self.hardware.nodes} needs 'multi-node' in requires")
        return self

    @property
    def missing_capabilities(self) -> list[str]:
        return [c for c in self.requires if not CAPABILITIES[c][0]]


class ModelPin(Section):
    """The base model: a registry name (`tiny`, `smollm2-135m-instruct`) or a hub id at a commit."""

    source: str = Field(..., description="registry name or hub id, as `model.name` in the stage configs")
    revision: str | None = Field(None, description="hub commit (40 hex digits) or 'unpinned'; none for registry names")
    files: dict[str, str] = Field(default_factory=dict, description="weight file (relative path) -> sha256")

    @field_validator("revision")
    @classmethod
    def _commit(cls, value: str | None) -> str | None:
        if value is not None and value != UNPINNED and not _COMMIT.fullmatch(value):
            raise ValueError(f"must be a 40-hex-digit commit or {UNPINNED!r}, got {value!r}")
        return value

    @field_validator("files")
    @classmethod
    def _hashes(cls, files: dict[str, str]) -> dict[str, str]:
        return {name: _check_sha256(sha, f"files[{name!r}]") for name, sha in files.items()}

    @model_validator(mode="after")
    def _hub_needs_revision(self) -> ModelPin:
        if is_hub_id(self.source) and self.revision is None:
            raise ValueError(f"hub model {self.source} needs a revision (a commit, or {UNPINNED!r})")
        return self


class EnvironmentPin(Section):
    package: str = Field(..., description="distribution name of the environment package, e.g. reverse-text")
    version: str = Field(..., description="its installed version")
    sha256: str | None = Field(
        None, description="sha256 of its source tree (primerl.digests.sha256_tree of the importable package)"
    )

    @field_validator("sha256")
    @classmethod
    def _tree(cls, value: str | None) -> str | None:
        return None if value is None else _check_sha256(value, "sha256")


class Pins(Section):
    python: str = Field(..., pattern=r"^\d+\.\d+(\.\d+)?$", description="Python version: 3.11 or 3.11.9")
    lock_sha256: str = Field(..., description="sha256 of uv.lock")
    packages: dict[str, str] = Field(default_factory=dict, description="distribution -> version")
    model: ModelPin = Field(..., description="the base model")
    environment: EnvironmentPin | None = Field(None, description="the environment package")
    data: dict[str, str] = Field(
        default_factory=dict,
        description="data file -> sha256: 'package/path' inside an importable package, or './path' next to the recipe",
    )
    images: dict[Literal["amd64", "arm64"], str] = Field(
        default_factory=dict, description="container image digest per architecture"
    )

    @field_validator("lock_sha256")
    @classmethod
    def _lock(cls, value: str) -> str:
        return _check_sha256(value, "lock_sha256")

    @field_validator("data")
    @classmethod
    def _data(cls, data: dict[str, str]) -> dict[str, str]:
        for name in data:
            if "/" not in name or name.startswith("/") or ".." in name.split("/"):
                raise ValueError(f"data key {name!r} must be 'package/relative/path' or './path/next/to/the/recipe'")
        return {name: _check_sha256(sha, f"data[{name!r}]") for name, sha in data.items()}

    @field_validator("images")
    @classmethod
    def _digests(cls, images: dict[str, str]) -> dict[str, str]:
        for arch, digest in images.items():
            if digest != UNPINNED and not _IMAGE_DIGEST.fullmatch(digest):
                raise ValueError(f"images.{arch} must be 'sha256:<64 hex digits>' or {UNPINNED!r}, got {digest!r}")
        return images


class RecipeFile(Section):
    """The typed part of a recipe file; stage tables are validated against their own process's config."""

    recipe: RecipeInfo
    pins: Pins
    sft: dict[str, Any] | None = None
    rl: dict[str, Any] | None = None
    smoke: dict[Literal["sft", "rl"], dict[str, Any]] = Field(default_factory=dict)
    deploy: dict[str, Any] | None = None  # validated by the launchers, merged with deploy files first


@dataclass(frozen=True)
class Recipe:
    """A loaded, validated recipe. `stages[name]` is the stage's raw config (includes merged, no run dir set);
    `overrides[name]` the command line's `--<stage>.<key>` values laid over it (`stages.with_overrides`), below the
    smoke variant; `origins[name]` says which file gave each dotted key of `stages[name]`."""

    path: Path
    info: RecipeInfo
    pins: Pins
    stages: dict[str, dict[str, Any]]
    smoke: dict[str, dict[str, Any]]
    deploy: dict[str, Any] | None = None  # validated by the launchers, merged with deploy files first
    overrides: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    origins: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.info.name

    def require_supported(self) -> None:
        """Raise `UnsupportedCapabilityError` naming every capability the recipe needs and this build lacks."""
        missing = self.info.missing_capabilities
        if missing:
            needs = "; ".join(f"{c} ({CAPABILITIES[c][1]})" for c in missing)
            raise UnsupportedCapabilityError(
                f"recipe '{self.name}' needs capabilities this version of primerl lacks: {needs}; nothing was run"
            )


def is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~"))


def is_recipe(path: str | Path) -> bool:
    """True when `path` is a TOML file with a top-level `[recipe]` table (a plain config never has one)."""
    p = Path(path)
    if p.suffix != ".toml" or not p.is_file():
        return False
    try:
        return isinstance(tomllib.loads(p.read_text()).get("recipe"), dict)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError):
        return False


def recipe_in_argv(argv: list[str]) -> str | None:
    """The recipe file named by the first config file in `argv` (`x.toml`, `@ x.toml`, `@x.toml`), or None."""
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "@" and i + 1 < len(argv) else arg.removeprefix("@")
        if path.endswith(".toml"):
            return path if is_recipe(path) else None
    return None
