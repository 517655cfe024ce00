"""Pins against reality: observe what is installed and on disk, compare it with a recipe's pins, or compute new pins.

Each pin gives one `PinCheck` with a status:
- `ok`        the pinned value was found;
- `drift`     something else was found (or nothing: a missing file, package or lock file) — the run stops unless
              `--allow-drift`;
- `unpinned`  the recipe holds the explicit placeholder `"unpinned"`; what was found is reported, nothing is verified;
- `n/a`       the pin does not apply here (an image digest outside a container, the digest of another architecture).

Package versions compare on the public version: a pin `2.13.0` accepts `2.13.0+cpu`; a pin with a local part
(`2.13.0+cu130`) must match exactly.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, Literal

from primerl.recipes.schema import UNPINNED, Recipe, is_hub_id

Status = Literal["ok", "drift", "unpinned", "n/a"]

LOCK_FILE = "uv.lock"
LOCK_FILE_ENV = "PRIMERL_LOCK_FILE"  # where the lock file is, when it is not above the recipe or the primerl sources
IMAGE_DIGEST_ENV = "PRIMERL_IMAGE_DIGEST"  # set by whoever starts a primerl container (the image cannot know it)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
DEFAULT_PACKAGES = ("torch", "transformers", "verifiers", "vllm", "flash-attn")


@dataclass(frozen=True)
class PinCheck:
    name: str  # "python", "lock", "package torch", "model revision", "model file model.safetensors", ...
    pinned: str | None
    found: str | None
    status: Status

    @property
    def found_text(self) -> str:
        return self.found if self.found is not None else "nothing"

    def line(self) -> str:
        return f"{self.name}: pinned {self.pinned}, found {self.found_text}"


@dataclass
class PinReport:
    checks: list[PinCheck] = field(default_factory=list)

    def add(self, name: str, pinned: str | None, found: str | None, same: Callable[[str, str], bool] | None = None):
        same = same or (lambda a, b: a == b)
        if pinned == UNPINNED:
            status: Status = "unpinned"
        elif found is not None and pinned is not None and same(pinned, found):
            status = "ok"
        else:
            status = "drift"
        self.checks.append(PinCheck(name, pinned, found, status))

    @property
    def drifted(self) -> list[PinCheck]:
        return [c for c in self.checks if c.status == "drift"]

    @property
    def unpinned(self) -> list[PinCheck]:
        return [c for c in self.checks if c.status == "unpinned"]

    def as_list(self) -> list[dict[str, Any]]:
        return [asdict(c) for c in self.checks]


# ---------------------------------------------------------------------------------------------------------------------
# Observations


def sha256_file(path: Path) -> str:
    from primerl.digests import sha256_file as digest

    return digest(path)


def python_version() -> str:
    return platform.python_version()


def python_matches(pinned: str, found: str) -> bool:
    """`3.11` matches any 3.11.x; `3.11.9` matches only itself."""
    return found.split(".")[: len(pinned.split("."))] == pinned.split(".")


def version_matches(pinned: str, found: str) -> bool:
    return found == pinned or ("+" not in pinned and found.split("+", 1)[0] == pinned)


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_packages() -> dict[str, str]:
    """Every installed distribution (lower-cased name) and its version, sorted by name."""
    found = {d.metadata["Name"].lower(): d.version for d in importlib.metadata.distributions() if d.metadata["Name"]}
    return dict(sorted(found.items()))


def find_lock_file(recipe_path: Path) -> Path | None:
    """`$PRIMERL_LOCK_FILE`, else the first uv.lock in the recipe's directory or above, else above primerl's sources."""
    if os.environ.get(LOCK_FILE_ENV):
        return Path(os.environ[LOCK_FILE_ENV])
    import primerl

    for start in (recipe_path.resolve().parent, Path(primerl.__file__).resolve().parent):
        for folder in (start, *start.parents):
            if (folder / LOCK_FILE).is_file():
                return folder / LOCK_FILE
    return None


def architecture() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def image_digest() -> str | None:
    """The digest of the container image this process runs in, when the container was started with it."""
    return os.environ.get(IMAGE_DIGEST_ENV) or None


def in_container() -> bool:
    return image_digest() is not None or Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()


def model_dir(source: str, revision: str | None) -> Path:
    """The local directory of a pinned model (raises `primerl.models.ModelError` when it is not there)."""
    from primerl.models import resolve_model

    return resolve_model(source, None if revision == UNPINNED else revision)


def weight_files(directory: Path) -> list[str]:
    """Relative paths of the weight files of a model directory, sorted."""
    relative = (p.relative_to(directory) for p in directory.rglob("*") if p.suffix in WEIGHT_SUFFIXES)
    return sorted(
        r.as_posix() for r in relative if not any(part.startswith(".") for part in r.parts) and (directory / r).is_file()
    )


def snapshot_revision(directory: Path) -> str | None:
    """The commit of a hub-cache snapshot directory (`.../snapshots/<commit>`), None for other directories."""
    return directory.name if directory.parent.name == "snapshots" else None


def data_file(key: str, recipe_dir: Path) -> Path | None:
    """The file a data pin names: `./path` next to the recipe, or `package/path` inside an importable package (looked
    up on sys.path: the installed package, not a module imported earlier)."""
    package, _, relative = key.partition("/")
    if package == ".":
        path = recipe_dir / relative
        return path if path.is_file() else None
    spec = PathFinder.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    return path if path.is_file() else None


# ---------------------------------------------------------------------------------------------------------------------
# Verification


def verify_pins(recipe: Recipe, progress: Callable[[str], None] | None = None) -> PinReport:
    """Compare every pin of `recipe` with this machine. Hashes large files; `progress` hears about each one."""
    say = progress or (lambda _msg: None)
    pins = recipe.pins
    report = PinReport()
    report.add("python", pins.python, python_version(), python_matches)

    lock = find_lock_file(recipe.path)
    report.add("lock", pins.lock_sha256, sha256_file(lock) if lock and lock.is_file() else None)

    for name, version in pins.packages.items():
        report.add(f"package {name}", version, installed_version(name), version_matches)

    verify_model(recipe, report, say)

    if pins.environment is not None:
        env = pins.environment
        report.add(f"environment {env.package}", env.version, installed_version(env.package))
        if env.sha256 is not None:
            say(f"hashing the source tree of {env.package}")
            report.add(f"environment {env.package} sha256", env.sha256, package_tree_sha256(env.package))
    for key, sha in pins.data.items():
        path = data_file(key, recipe.path.parent)
        say(f"hashing {key}")
        report.add(f"data {key}", sha, sha256_file(path) if path else None)

    here, digest = architecture(), image_digest()
    for arch, pinned in pins.images.items():
        if arch != here:
            report.checks.append(PinCheck(f"image {arch}", pinned, f"not checked on {here}", "n/a"))
        elif digest is None:
            report.checks.append(PinCheck(f"image {arch}", pinned, "not in a container", "n/a"))
        else:
            report.add(f"image {arch}", pinned, digest)
    return report


def verify_model(recipe: Recipe, report: PinReport, say: Callable[[str], None]) -> None:
    """Add the model's checks to `report`: present, at the pinned revision, each pinned file with its pinned hash."""
    from primerl.models import ModelError

    pin = recipe.pins.model
    try:
        say(f"resolving model {pin.source}")
        directory = model_dir(pin.source, pin.revision)
    except ModelError as e:
        report.checks.append(PinCheck(f"model {pin.source}", "present", f"not found ({e})", "drift"))
        return
    if pin.revision is not None:
        report.add("model revision", pin.revision, snapshot_revision(directory))
    if not pin.files:
        report.add("model files", UNPINNED, f"{len(weight_files(directory))} weight file(s), none pinned")
    from primerl.digests import sha256_stamped

    for name, sha in pin.files.items():
        path = directory / name
        say(f"hashing {pin.source}/{name}")
        report.add(f"model file {name}", sha, sha256_stamped(path) if path.is_file() else None)


# ---------------------------------------------------------------------------------------------------------------------
# Locking


def compute_pins(recipe: Recipe, progress: Callable[[str], None] | None = None) -> tuple[dict[str, dict[str, str]], list[str]]:
    """The recipe's `[pins]` tables recomputed from this machine, and notes on pins it could not observe (those keep
    their current value). Tables are keyed by their TOML name (`pins`, `pins.packages`, `pins.model.files`, ...)."""
    from primerl.models import ModelError

    say = progress or (lambda _msg: None)
    pins, notes = recipe.pins, []
    found_python = python_version()
    python = found_python if len(pins.python.split(".")) == 3 else ".".join(found_python.split(".")[:2])
    lock = find_lock_file(recipe.path)
    if lock is None or not lock.is_file():
        notes.append(f"no {LOCK_FILE} found (set {LOCK_FILE_ENV}); lock_sha256 kept")
    tables: dict[str, dict[str, str]] = {
        "pins": {"python": python, "lock_sha256": sha256_file(lock) if lock and lock.is_file() else pins.lock_sha256}
    }

    packages = {}
    for name in pins.packages or DEFAULT_PACKAGES:
        version = installed_version(name)
        if version is None and name in pins.packages:
            notes.append(f"package {name} is not installed here; its pin is kept")
            version = pins.packages[name]
        if version is not None:
            packages[name] = version
    tables["pins.packages"] = packages

    model = {"source": pins.model.source}
    files = dict(pins.model.files)
    try:
        say(f"resolving model {pins.model.source}")
        directory = model_dir(pins.model.source, pins.model.revision)
    except ModelError as e:
        notes.append(f"model kept as pinned: {e}")
        if pins.model.revision is not None:
            model["revision"] = pins.model.revision
    else:
        revision = snapshot_revision(directory) if is_hub_id(pins.model.source) else None
        if revision is not None:
            model["revision"] = revision
        files = {}
        for name in weight_files(directory):
            say(f"hashing {pins.model.source}/{name}")
            files[name] = sha256_file(directory / name)
    tables["pins.model"] = model
    tables["pins.model.files"] = files

    keys = list(pins.data)
    if pins.environment is not None:
        env = pins.environment
        version = installed_version(env.package)
        if version is None:
            notes.append(f"environment {env.package} is not installed here; its pins are kept")
        tables["pins.environment"] = {"package": env.package, "version": version or env.version}
        say(f"hashing the source tree of {env.package}")
        if (tree := package_tree_sha256(env.package)) is not None:
            tables["pins.environment"]["sha256"] = tree
        elif env.sha256 is not None:
            tables["pins.environment"]["sha256"] = env.sha256
        if not any(k.partition("/")[0] != "." for k in keys):
            keys += _shipped_data(env.package)
    tables["pins.data"] = _data_hashes(keys, recipe.path.parent, say, notes, pins.data)

    images = dict(pins.images)
    if image_digest() is not None:
        images[architecture()] = image_digest()
    tables["pins.images"] = images
    return tables, notes


def package_tree_sha256(distribution: str) -> str | None:
    """`sha256_tree` of an installed environment package's importable directory (module = the distribution name with
    `_` for `-`, looked up on sys.path), None when it is not installed. The same files whether the package was
    installed from its wheel or from its source tree (editable)."""
    from primerl.digests import sha256_tree

    spec = PathFinder.find_spec(distribution.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    return sha256_tree(Path(next(iter(spec.submodule_search_locations))))


def _shipped_data(distribution: str) -> list[str]:
    """Every file under `<module>/data/` of an environment package (module = distribution name with `_` for `-`)."""
    module = distribution.replace("-", "_")
    spec = PathFinder.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(next(iter(spec.submodule_search_locations)))
    return sorted(f"{module}/{p.relative_to(root).as_posix()}" for p in (root / "data").rglob("*") if p.is_file())


def _data_hashes(keys: list[str], recipe_dir: Path, say: Callable[[str], None], notes: list[str],
                 old: dict[str, str]) -> dict[str, str]:
    out = {}
    for key in keys:
        path = data_file(key, recipe_dir)
        if path is None:
            notes.append(f"data file {key} is not found here; its pin is kept")
            if key in old:
                out[key] = old[key]
            continue
        say(f"hashing {key}")
        out[key] = sha256_file(path)
    return out


def stderr_progress(message: str) -> None:
    print(f"primerl: {message}", file=sys.stderr, flush=True)


def format_checks(checks: list[PinCheck], verbose: bool = False) -> str:
    """One line per pin that is not `ok` (every pin when `verbose`): status, name, pinned and found."""
    shown = [c for c in checks if verbose or c.status != "ok"]
    width = max((len(c.name) for c in shown), default=0)
    lines = [f"  {c.status:8s} {c.name.ljust(width)}  pinned {c.pinned}  found {c.found_text}" for c in shown]
    ok = sum(c.status == "ok" for c in checks)
    lines.append(f"  {ok} of {len(checks)} pins verified")
    return "\n".join(lines)
