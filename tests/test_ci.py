"""The hosted-CI workflows under ci/workflows/ pass actionlint (from the dev group), and actionlint does catch a
broken one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = sorted((ROOT / "ci" / "workflows").glob("*.yml"))


def actionlint(*paths: Path) -> subprocess.CompletedProcess:
    binary = shutil.which("actionlint")
    if binary is None:
        pytest.skip("actionlint is not on PATH (it comes with the dev group: uv sync)")
    return subprocess.run([binary, "-no-color", *map(str, paths)], capture_output=True, text=True, check=False)


def test_workflows_pass_actionlint():
    assert {p.name for p in WORKFLOWS} >= {"tests.yml", "images.yml"}
    done = actionlint(*WORKFLOWS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_rejects_a_broken_workflow(tmp_path):
    broken = tmp_path / "images.yml"
    text = (ROOT / "ci" / "workflows" / "images.yml").read_text()
    broken.write_text(text.replace("${{ matrix.runner }}", "${{ matrix.runners }}", 1))
    done = actionlint(broken)
    assert done.returncode == 1 and "runners" in done.stdout, done.stdout + done.stderr


def test_pin_images_writes_each_recipe_the_image_it_runs_in(tmp_path):
    """The pipeline's last step: CPU recipes pin primerl:cpu, GPU recipes primerl:cuda13; cuda12 pins nothing."""
    import json
    import sys

    facts = tmp_path / "facts"
    facts.mkdir()
    ids = {}
    for n, (variant, tag, arch) in enumerate([("cpu", "cpu", "amd64"), ("cpu", "cpu", "arm64"),
                                              ("cuda", "cuda13", "amd64"), ("cuda12", "cuda12", "amd64")]):
        ids[tag, arch] = f"sha256:{n:064x}"
        (facts / f"{tag}-{arch}.json").write_text(json.dumps(
            {"variant": variant, "tag": tag, "arch": arch, "image_id": ids[tag, arch], "digest": "sha256:" + "f" * 64}
        ))
    recipes = [tmp_path / "tiny.toml", tmp_path / "gpu.toml"]
    recipes[0].write_text((ROOT / "recipes" / "tiny.toml").read_text())
    recipes[1].write_text((ROOT / "recipes" / "reverse-text-qwen3-0.6b.toml").read_text())
    done = subprocess.run([sys.executable, str(ROOT / "ci" / "pin-images.py"), str(facts), *map(str, recipes)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    from primerl.recipes import load_recipe

    assert load_recipe(recipes[0]).pins.images == {"amd64": ids["cpu", "amd64"], "arm64": ids["cpu", "arm64"]}
    assert load_recipe(recipes[1]).pins.images["amd64"] == ids["cuda13", "amd64"]
    assert load_recipe(recipes[1]).pins.images["arm64"] == "unpinned"
