"""`<run>/manifest.json`: everything needed to say what ran and to rerun it.

Fields: the recipe (path, sha256, name, stages, hardware, requires), every pin check (pinned, found, status) and
whether drift was allowed, the lock file and its sha256, every installed package version, primerl's version and git
commit, the container image digest, host facts (OS, CPU model and cores, memory, GPUs, driver, CUDA), the checklist's
verdict per step, the command-line overrides, the seed and whether the run is deterministic (and what that fixes:
`primerl.config.determinism`), the environment package's installed version and source-tree sha256, and per stage its
resolved config and outcome.

Two runs of one recipe on one machine give manifests that differ only in the fields listed under `volatile_fields`
(dotted paths, `*` matches any key): the run id, the times, and the run directory. Stage configs are recorded with the
run directory written as `${run_dir}`, so they compare equal across runs.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from primerl.recipes.pins import (
    architecture,
    image_digest,
    in_container,
    installed_packages,
    installed_version,
    package_tree_sha256,
)
from primerl.recipes.schema import Recipe
from primerl.recipes.stages import RUN_DIR_VAR
from primerl.storage import atomic_write

MANIFEST_FILE = "manifest.json"
SCHEMA_VERSION = 1
INTERRUPTED_EXIT_CODE = 130
VOLATILE_FIELDS = ("run_id", "created_at", "updated_at", "run_dir", "stages.*.started_at", "stages.*.finished_at")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def build_manifest(
    recipe: Recipe,
    run_dir: Path,
    pin_checks: list[dict[str, Any]],
    allow_drift: bool,
    lock_file: Path | None,
    stage_configs: Mapping[str, Mapping[str, Any]],
    overrides: Mapping[str, Any],
    checklist: Mapping[str, str] | None,
) -> dict[str, Any]:
    """The manifest of a run about to start its stages. `stage_configs` are resolved configs (JSON-able dicts)."""
    from primerl import __version__
    from primerl.digests import sha256_file

    run_dir = run_dir.resolve()
    return {
        "schema": SCHEMA_VERSION,
        "volatile_fields": list(VOLATILE_FIELDS),
        "run_id": new_run_id(),
        "created_at": now(),
        "updated_at": now(),
        "run_dir": str(run_dir),
        "recipe": {
            "name": recipe.name,
            "path": str(recipe.path),
            "sha256": sha256_file(recipe.path),
            "description": recipe.info.description,
            "stages": list(recipe.info.stages),
            "requires": list(recipe.info.requires),
            "hardware": recipe.info.hardware.model_dump(mode="json"),
        },
        "pins": {
            "declared": recipe.pins.model_dump(mode="json", exclude_none=True),
            "checks": pin_checks,
            "drift": [c["name"] for c in pin_checks if c["status"] == "drift"],
            "unpinned": [c["name"] for c in pin_checks if c["status"] == "unpinned"],
            "allow_drift": allow_drift,
        },
        "lock": {
            "path": str(lock_file) if lock_file else None,
            "sha256": sha256_file(lock_file) if lock_file and lock_file.is_file() else None,
        },
        "packages": installed_packages(),
        "primerl": {"version": __version__, **git_state(Path(__file__).resolve().parent)},
        "image": {"in_container": in_container(), "digest": image_digest(), "architecture": architecture()},
        "host": host_facts(),
        "checklist": dict(checklist) if checklist is not None else None,
        "overrides": dict(overrides),
        "determinism": determinism_record(stage_configs),
        "environment": environment_record(recipe),
        "stages": {
            name: {"config": relative_to_run_dir(dict(cfg), str(run_dir)), "status": "pending"}
            for name, cfg in stage_configs.items()
        },
    }


def stage_started(manifest: dict[str, Any], stage: str) -> None:
    """Mark `stage` running in `manifest` (in memory; `write_manifest` writes it)."""
    manifest["stages"][stage].update(status="running", started_at=now())
    manifest["updated_at"] = now()


def stage_ended(manifest: dict[str, Any], stage: str, code: int) -> str:
    """Record `stage`'s outcome from its exit code in `manifest` (in memory): completed (0), interrupted (130) or
    failed, with the code and the time. Returns the status."""
    status = {0: "completed", INTERRUPTED_EXIT_CODE: "interrupted"}.get(code, "failed")
    manifest["stages"][stage].update(status=status, exit_code=code, finished_at=now())
    manifest["updated_at"] = now()
    return status


def determinism_record(stage_configs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The RL stage's seed and whether it runs deterministically, with what a deterministic run fixes."""
    from primerl.config import determinism

    rl = stage_configs.get("rl") or {}
    deterministic = bool(rl.get("deterministic", False))
    return {"seed": rl.get("seed"), "deterministic": deterministic,
            "settings": determinism.settings() if deterministic else None}


def environment_record(recipe: Recipe) -> dict[str, Any] | None:
    """The pinned environment package as installed here: version and source-tree sha256."""
    env = recipe.pins.environment
    if env is None:
        return None
    return {"package": env.package, "version": installed_version(env.package),
            "sha256": package_tree_sha256(env.package)}


def write_manifest(run_dir: Path, manifest: Mapping[str, Any]) -> Path:
    """Write `<run>/manifest.json` atomically (temp file, then rename)."""
    path = run_dir / MANIFEST_FILE
    return atomic_write(path, json.dumps(manifest, indent=2, sort_keys=False) + "\n")


def read_manifest(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / MANIFEST_FILE).read_text())


def relative_to_run_dir(node: Any, run_dir: str) -> Any:
    """Write every occurrence of the run directory in a config tree as `${run_dir}`."""
    if isinstance(node, dict):
        return {k: relative_to_run_dir(v, run_dir) for k, v in node.items()}
    if isinstance(node, list):
        return [relative_to_run_dir(v, run_dir) for v in node]
    if isinstance(node, str):
        return node.replace(run_dir, RUN_DIR_VAR)
    return node


def without_volatile(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `manifest` without the fields it lists as volatile (what two runs may differ in)."""
    out = json.loads(json.dumps(manifest))
    for dotted in manifest.get("volatile_fields", []):
        _drop(out, dotted.split("."))
    return out


def _drop(node: Any, parts: list[str]) -> None:
    if not isinstance(node, dict) or not parts:
        return
    head, rest = parts[0], parts[1:]
    keys = list(node) if head == "*" else [head] if head in node else []
    for key in keys:
        if rest:
            _drop(node[key], rest)
        else:
            del node[key]


def manifest_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Dotted paths at which two manifests differ outside their volatile fields (empty: the same run setup)."""
    out: list[str] = []
    _diff(without_volatile(a), without_volatile(b), "", out)
    return out


def _diff(a: Any, b: Any, where: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            _diff(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{where}.{key}" if where else str(key), out)
    elif a != b:
        out.append(f"{where}: {json.dumps(a)} != {json.dumps(b)}")


# ---------------------------------------------------------------------------------------------------------------------
# Facts about the code and the host


def git_state(path: Path) -> dict[str, Any]:
    """The git commit of the checkout holding `path` and whether it has uncommitted changes (None outside git)."""
    if shutil.which("git") is None:
        return {"git_commit": None, "git_dirty": None}

    def git(*args: str) -> str | None:
        proc = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {"git_commit": None, "git_dirty": None}
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_commit": commit, "git_dirty": bool(status)}


def host_facts() -> dict[str, Any]:
    """OS, CPU, memory and GPUs of this machine: stable facts only (nothing that changes from one minute to the next)."""
    return {
        "hostname": platform.node(),
        "os": f"{platform.system()} {platform.release()}",
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "memory_gb": memory_gb(),
        **_gpu_facts(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_gb() -> float | None:
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    match = re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.MULTILINE)
    return round(int(match[1]) / 2**20, 1) if match else None


def _gpu_facts() -> dict[str, Any]:
    """GPUs as nvidia-smi reports them, the driver and the CUDA version torch was built with."""
    gpus, driver, driver_cuda = [], None, None
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]
        proc = subprocess.run(query, capture_output=True, text=True, check=False)
        for line in proc.stdout.strip().splitlines() if proc.returncode == 0 else []:
            name, memory, driver = (part.strip() for part in line.split(","))
            gpus.append({"name": name, "memory_mib": int(float(memory))})
        banner = subprocess.run(["nvidia-smi"], capture_output=True, text=True, check=False).stdout
        match = re.search(r"CUDA Version:\s*([\d.]+)", banner)
        driver_cuda = match[1] if match else None
    return {"gpus": gpus, "gpu_driver": driver, "driver_cuda": driver_cuda, "torch_cuda": torch_cuda_version()}


def torch_cuda_version() -> str | None:
    """`torch.version.cuda` without importing torch (seconds, on every run): torch/version.py is a generated file of
    plain assignments, read on its own."""
    import runpy
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        return runpy.run_path(str(version_file)).get("cuda")
    except (OSError, SyntaxError):
        return None
