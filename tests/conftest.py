"""Shared fixtures. Models come from primerl's own registry (built or converted once, then cached).

The layout mirrors src/primerl/: the tests of `primerl.<package>` live in tests/<package>/ (config, inference, launch,
orchestrator, recipes, trainer, transport), those of a top-level module `primerl.<module>` in tests/test_<module>*.py.
Beside them, directories by kind rather than by package: integration/ (whole `rl` runs), system/ (daemons: docker,
sshd, Slurm), fuzz/, gpu/, environments/ (the environment packages), benchmarks/ (the benchmark scripts' smoke runs).
pytest puts this directory on sys.path (it imports this file in its default `prepend` mode), so helper modules at the
top of tests/ (trainer_helpers.py) import by name from every directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from primerl.ports import free_port

# A test run started in the background of a script (`pytest ... &`, nohup) inherits SIGINT ignored, and so would every
# process the tests start: the tests that press Ctrl-C (SIGINT to a process they started) then waited for processes
# that could not hear it. The processes get the default back on exec once this one handles SIGINT, as under a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from primerl.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from primerl.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture
def perturbed_tiny_model(tiny_model_dir: Path) -> Callable[..., Path]:
    """`make(out, scale=0.5)`: the tiny model with seeded noise (`scale` x N(0, 1), the same on every call) added to
    every weight, saved as a model directory at `out` (config and safetensors; transformers stores the tied head
    once). Weights that answer differently from the tiny model's, for the tests of weight updates."""

    def make(out: Path, scale: float = 0.5) -> Path:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * scale)
        model.save_pretrained(out)
        return out

    return make


PROBE_PACKAGES = Path(__file__).parent / "environments" / "packages"


@pytest.fixture(scope="session")
def probe_envs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test environment packages under tests/environments/packages/ (one per shape verifiers 0.4 allows: a
    taskset alone, a taskset with its own harness, a tool environment, a multi-turn env), built and installed into a
    fresh target directory, as a user installs an environment next to primerl. The directory is on this process's
    sys.path and on PYTHONPATH for the processes the tests start, so verifiers resolves the ids
    (probe-taskset, ...) by importing the installed modules."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.fail("the test environment packages are installed with uv, which is not on PATH")
    site = tmp_path_factory.mktemp("probe-envs")
    packages = sorted(str(p) for p in PROBE_PACKAGES.iterdir() if (p / "pyproject.toml").is_file())
    done = subprocess.run([uv, "pip", "install", "--no-deps", "--python", sys.executable, "--target", str(site),
                           *packages], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"installing the test environment packages failed:\n{done.stderr[-3000:]}")
    sys.path.insert(0, str(site))
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), previous]))
    yield site
    sys.path.remove(str(site))
    if previous is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = previous


@pytest.fixture
def inductor_cpu() -> None:
    """Skip, with the reason, where torch.compile cannot build CPU code (e.g. no setuptools in the environment)."""
    import torch

    try:
        torch.compile(lambda x: x + 1)(torch.ones(2))
    except Exception as error:  # noqa: BLE001 -- whatever stops inductor here is the reason to print
        pytest.skip(f"torch.compile cannot build CPU code here: {type(error).__name__}: {str(error)[:200]}")


@pytest.fixture
def port() -> int:
    return free_port()


_TIER_ORDER = {"fuzz": 1, "integration": 2, "drills": 2, "slow": 1, "system": 3, "launchers": 4, "images": 4}


def pytest_collection_modifyitems(config, items):
    """Run cheap tests first: unit tests, then tests on the embedded model, then integration, then system tests
    (which start daemons). A quick failure is reported before the heavy set-up begins."""

    def tier(item) -> int:
        return max((_TIER_ORDER[m.name] for m in item.iter_markers() if m.name in _TIER_ORDER), default=0)

    items.sort(key=tier)
