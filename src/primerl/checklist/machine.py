"""The light steps of the checklist: facts of this machine checked against the recipe, each in seconds.

python, torch, flash_attn, disk, memory, ports, run_dir, model, environment: see `primerl.checklist.steps` for their
order and limits. What could crash or hang the checklist's own process (importing torch, flash_attn, an environment)
runs in a child Python (`python_child`).
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Iterator
from typing import Any

from primerl.checklist.context import Context, Fail, Skip, python_child
from primerl.recipes.stages import stage_values, validate_stage


def check_python(ctx: Context) -> str:
    from primerl.recipes.pins import python_matches, python_version

    found = python_version()
    if ctx.recipe is None:
        return f"Python {found} (no recipe, no pin to match)"
    pinned = ctx.recipe.pins.python
    if not python_matches(pinned, found):
        raise Fail(f"Python {found}, the recipe pins {pinned}")
    return f"Python {found} matches the pin {pinned}"


def check_torch(ctx: Context) -> str:
    facts = ctx.torch_facts()
    gpus = facts["gpus"]
    seen = f"torch {facts['version']}, {len(gpus)} GPU(s)" + (f": {gpus[0]['name']}" if gpus else "")
    hw = ctx.recipe.info.hardware if ctx.recipe else None
    if hw is None or hw.gpus_per_node == 0:
        return seen
    enough = [g for g in gpus if g["memory_gb"] >= hw.gpu_memory_gb]
    if len(enough) >= hw.gpus_per_node:
        return f"{seen}; the recipe needs {hw.gpus_per_node} with {hw.gpu_memory_gb:g} GiB"
    if hw.cpu_allowed and not gpus:
        return f"{seen}; the recipe will run on CPU (it asks for {hw.gpus_per_node} GPU(s) but allows CPU)"
    raise Fail(f"{seen}; the recipe needs {hw.gpus_per_node} GPU(s) with >= {hw.gpu_memory_gb:g} GiB each")


def check_flash_attn(ctx: Context) -> str:
    if ctx.recipe is not None and not ctx.gpu_recipe():
        raise Skip("CPU recipe: flash-attn is not used")
    if ctx.gpu_count == 0:
        raise Skip("no CUDA GPU on this machine")
    version = python_child("import flash_attn; print(flash_attn.__version__)", failed="import flash_attn failed: {}")
    return f"flash_attn {version}"


def check_disk(ctx: Context) -> str:
    need = ctx.recipe.info.hardware.min_disk_gb if ctx.recipe else 1.0
    folder = ctx.run_dir.resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free / 2**30
    if free < need:
        raise Fail(f"{free:.1f} GiB free under {folder}, the recipe needs {need:g} GiB")
    return f"{free:.1f} GiB free under {folder} (needs {need:g})"


def check_memory(ctx: Context) -> str:
    from primerl.recipes.manifest import memory_gb

    need = ctx.recipe.info.hardware.min_memory_gb if ctx.recipe else 0.0
    total = memory_gb()
    if total is None:
        raise Skip("cannot read the host's memory size")
    if total < need:
        raise Fail(f"{total:g} GiB of memory, the recipe needs {need:g} GiB")
    return f"{total:g} GiB of memory (needs {need:g})"


def check_ports(ctx: Context) -> str:
    ports = sorted(set(_ports_of(_stage_tree(ctx)))) if ctx.recipe else []
    if not ports:
        return "the run binds no fixed port (servers pick a free one)"
    busy = [p for p in ports if not _port_free(p)]
    if busy:
        raise Fail(f"port(s) {busy} are in use")
    return f"port(s) {ports} are free"


def check_run_dir(ctx: Context) -> str:
    try:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        probe = ctx.run_dir / f".checklist-probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise Fail(f"{ctx.run_dir} is not writable: {e.strerror or e}") from None
    return f"{ctx.run_dir} is writable"


def check_model(ctx: Context) -> str:
    from primerl.recipes.pins import PinReport, verify_model

    if ctx.recipe is None:
        raise Skip("no recipe given: no pinned model")
    report = PinReport()
    verify_model(ctx.recipe, report, ctx.say)
    if report.drifted:
        raise Fail("; ".join(c.line() for c in report.drifted))
    files = [c for c in report.checks if c.name.startswith("model file")]
    unpinned = [c for c in report.checks if c.status == "unpinned"]
    note = f"; {len(unpinned)} pin(s) unpinned (present, not verified)" if unpinned else ""
    return f"{ctx.recipe.pins.model.source}: {len(files) - len(unpinned)} file(s) match their pins{note}"


ENV_PROBE = (
    "import sys\n"
    "from primerl.config.orchestrator import EnvSection\n"
    "from primerl.orchestrator.verifiers_bridge import EnvConfigError, probe_env\n"
    "try:\n"
    "    print(probe_env(EnvSection.model_validate_json(sys.argv[1])))\n"
    "except EnvConfigError as e:\n"
    "    sys.exit(str(e))\n"
)


def check_environment(ctx: Context) -> str:
    """The rl stage's environment loads with the recipe's `env.args` and yields a task: seconds, in a child process
    (verifiers stays out of the checklist's own), instead of a failed smoke run a minute later."""
    if ctx.recipe is None:
        raise Skip("no recipe given: no environment to load")
    if "rl" not in ctx.recipe.stages:
        raise Skip("the recipe has no rl stage")
    section = validate_stage(ctx.recipe, "rl").orchestrator.env
    return python_child(ENV_PROBE, section.model_dump_json(), failed="[rl.orchestrator.env] {}")


def _stage_tree(ctx: Context) -> dict[str, Any]:
    assert ctx.recipe is not None
    return {name: stage_values(ctx.recipe, name, run_dir=ctx.run_dir) for name in ctx.recipe.stages}


def _ports_of(node: Any) -> Iterator[int]:
    """Every non-zero integer `port` in a config tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "port" and isinstance(value, int) and value > 0:
                yield value
            else:
                yield from _ports_of(value)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

