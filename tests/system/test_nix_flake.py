"""flake.nix with Debian's nix-bin: it parses, and evaluates to a flake (description, inputs, outputs) whose inputs are
the ones flake.lock pins. Nothing is fetched: nixpkgs and the binary cache are not reachable from CI, so `nix develop`
and `nix flake check` themselves do not run here (docs/containers.md says what was exercised)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from docker_helpers import CI, ROOT

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def nix_instantiate() -> str:
    if shutil.which("nix-instantiate") is None:
        done = subprocess.run([str(CI / "apt-install.sh"), "nix-bin"], check=False, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"apt cannot provide nix-bin here: {done.stderr.strip().splitlines()[-1:]}")
    return shutil.which("nix-instantiate")


def nix(nix_instantiate: str, *args: str) -> str:
    done = subprocess.run([nix_instantiate, *args], check=False, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_flake_parses(nix_instantiate):
    nix(nix_instantiate, "--parse", "flake.nix")


def test_flake_evaluates_to_inputs_that_flake_lock_pins(nix_instantiate):
    names = json.loads(nix(nix_instantiate, "--eval", "--json", "-E", "builtins.attrNames (import ./flake.nix)"))
    assert names == ["description", "inputs", "outputs"]
    inputs = json.loads(nix(nix_instantiate, "--eval", "--json", "--strict", "-E", "(import ./flake.nix).inputs"))
    lock = json.loads((ROOT / "flake.lock").read_text())
    assert sorted(inputs) == sorted(lock["nodes"][lock["root"]]["inputs"])
    for name, spec in inputs.items():
        node = lock["nodes"][name]
        for follows_name, follows in spec.get("inputs", {}).items():
            assert node["inputs"][follows_name] == [follows["follows"]], f"{name}.inputs.{follows_name}"
