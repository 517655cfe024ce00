"""The pins that the lock file, pyproject.toml, the Dockerfiles and flake.nix each state must agree.

uv.lock is the source of truth for package versions; pyproject.toml for the supported Python range. The Dockerfiles
repeat the key versions as build arguments (their labels carry them and the image build checks them against the synced
environment); flake.nix names its Python and CUDA package sets. Edit one without the others and this test says which.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from primerl.launch.images import LABEL_PINS, VARIANTS, context_build_args, dockerfile_args

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = {"cpu": ROOT / "docker/cpu.Dockerfile", "cuda": ROOT / "docker/cuda.Dockerfile"}
KEY_PACKAGES = LABEL_PINS  # Dockerfile build argument -> locked package
CUDA12 = VARIANTS["cuda12"]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def read_lock(path: Path) -> dict[str, list[dict]]:
    """Locked packages by name (a name can be locked at several versions, one per environment marker)."""
    packages: dict[str, list[dict]] = {}
    for package in tomllib.loads(path.read_text())["package"]:
        packages.setdefault(package["name"], []).append(package)
    return packages


@pytest.fixture(scope="module")
def locked() -> dict[str, list[dict]]:
    return read_lock(ROOT / "uv.lock")


@pytest.fixture(scope="module")
def locked_cuda12() -> dict[str, list[dict]]:
    return read_lock(ROOT / CUDA12.project / "uv.lock")


def locked_version(locked: dict[str, list[dict]], name: str) -> str:
    versions = {p["version"] for p in locked[name]}
    assert len(versions) == 1, f"uv.lock holds {name} at several versions {sorted(versions)}; pin one"
    return versions.pop()


@pytest.fixture(scope="module")
def flake() -> str:
    return (ROOT / "flake.nix").read_text()


def flake_python(flake: str) -> str:
    found = set(re.findall(r"pkgs\.python3(\d+)\b", flake))
    assert len(found) == 1, f"flake.nix should name exactly one Python package set, found python3{sorted(found)}"
    return f"3.{found.pop()}"


def test_dockerfiles_pin_the_locked_versions(locked):
    for path in DOCKERFILES.values():
        args = dockerfile_args(path)
        for arg, package in KEY_PACKAGES.items():
            if arg in args:
                assert args[arg] == locked_version(locked, package), (
                    f"{path.name}: {arg}={args[arg]} but uv.lock has {package} {locked_version(locked, package)}"
                )
    cuda_args = dockerfile_args(DOCKERFILES["cuda"])
    missing = [arg for arg in KEY_PACKAGES if arg not in cuda_args]
    assert not missing, f"cuda.Dockerfile does not pin {missing}"


def test_pyproject_pins_equal_the_lock(pyproject, locked):
    requirements = pyproject["project"]["dependencies"] + [
        r for extra in pyproject["project"]["optional-dependencies"].values() for r in extra
    ]
    exact = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==(\S+)", r).groups() for r in requirements if "==" in r)
    assert {"verifiers", "vllm", "flash-attn"} <= exact.keys()
    for name, version in exact.items():
        assert locked_version(locked, name) == version, f"pyproject pins {name}=={version}, uv.lock has another"
    for metadata in pyproject["tool"]["uv"]["dependency-metadata"]:
        assert locked_version(locked, metadata["name"]) == metadata["version"], (
            f"[[tool.uv.dependency-metadata]] declares {metadata['name']} {metadata['version']}, not the locked version"
        )


def test_one_python_version_everywhere(pyproject, flake):
    python = {name: dockerfile_args(path)["PYTHON_VERSION"] for name, path in DOCKERFILES.items()}
    python["flake.nix"] = flake_python(flake)
    assert len(set(python.values())) == 1, f"Python versions disagree: {python}"
    version = python["flake.nix"]
    supported = SpecifierSet(pyproject["project"]["requires-python"])
    assert Version(f"{version}.0") in supported, f"Python {version} is outside requires-python {supported}"


def torch_cuda_major(locked: dict[str, list[dict]]) -> str:
    """torch's CUDA libraries come as nvidia-*-cuXY wheels; flash-attn must be compiled with an nvcc of that major."""
    torch = locked["torch"][0]
    majors = {m for d in torch["dependencies"] for m in re.findall(r"^nvidia-.*-cu(\d+)$", d["name"])}
    assert len(majors) == 1, f"cannot tell torch's CUDA major from its locked dependencies: {majors}"
    return majors.pop()


def test_cuda_major_follows_the_locked_torch(locked, flake):
    major = torch_cuda_major(locked)
    base_cuda = dockerfile_args(DOCKERFILES["cuda"])["CUDA_VERSION"]
    assert base_cuda.split(".")[0] == major, f"cuda.Dockerfile builds on CUDA {base_cuda}, torch needs CUDA {major}"
    flake_cuda = set(re.findall(r"pkgs\.cudaPackages_(\d+)\b", flake))
    assert flake_cuda == {major}, f"flake.nix uses cudaPackages_{sorted(flake_cuda)}, torch needs CUDA {major}"


def test_dockerfiles_share_their_tooling_versions():
    shared = ["PYTHON_VERSION", "UV_VERSION", "TORCH_VERSION", "TRANSFORMERS_VERSION", "VERIFIERS_VERSION"]
    args = {name: dockerfile_args(path) for name, path in DOCKERFILES.items()}
    for arg in shared:
        values = {name: a[arg] for name, a in args.items()}
        assert len(set(values.values())) == 1, f"{arg} differs between Dockerfiles: {values}"


def test_flake_lock_pins_every_input_by_rev_and_nar_hash(flake):
    lock = json.loads((ROOT / "flake.lock").read_text())
    assert lock["version"] == 7
    nodes = lock["nodes"]
    inputs = set(re.findall(r"^    ([a-z][a-z0-9-]*)(?: = \{|\.url = )", flake, flags=re.MULTILINE))
    assert set(nodes[lock["root"]]["inputs"]) == inputs, "flake.lock's root inputs differ from flake.nix's inputs"
    for name, node in nodes.items():
        if name == lock["root"]:
            continue
        locked_ref = node["locked"]
        assert re.fullmatch(r"[0-9a-f]{40}", locked_ref["rev"]), f"{name}: rev is not a full commit"
        assert re.fullmatch(r"sha256-[A-Za-z0-9+/]{43}=", locked_ref["narHash"]), f"{name}: narHash is not SRI sha256"
        url = re.search(rf'{re.escape(name)}(?:\.url = | = {{\s*url = )"github:([^/]+)/([^/"]+)(?:/([^"]+))?"', flake)
        assert url, f"flake.nix has no github url for input {name}"
        owner, repo, ref = url.groups()
        original = node["original"]
        assert (original["owner"], original["repo"], original.get("ref")) == (owner, repo, ref), (
            f"{name}: flake.lock locks {original}, flake.nix asks for {url.group(0)}"
        )


def test_cuda12_image_pins_its_own_lock(locked, locked_cuda12):
    """primerl:cuda12 builds from the same Dockerfile with the CUDA 12 lock: its label pins are read from that lock
    (one version each), the base's CUDA major is the one its torch was built for, and what both stacks share
    (verifiers, flash-attn, Python) is the same as in the main lock."""
    args = context_build_args(ROOT, CUDA12)
    for arg, package in KEY_PACKAGES.items():
        assert args[arg] == locked_version(locked_cuda12, package), f"cuda12: {arg}={args[arg]}"
    assert args["TORCH_VERSION"] == "2.10.0" and args["TRANSFORMERS_VERSION"].startswith("4.57.")
    assert args["CUDA_VERSION"].split(".")[0] == torch_cuda_major(locked_cuda12) == "12"
    for package in ("verifiers", "flash-attn"):
        assert locked_version(locked_cuda12, package) == locked_version(locked, package), package
    cuda12 = tomllib.loads((ROOT / CUDA12.project / "pyproject.toml").read_text())
    python = dockerfile_args(DOCKERFILES["cuda"])["PYTHON_VERSION"]
    assert Version(f"{python}.0") in SpecifierSet(cuda12["project"]["requires-python"])
    assert args["LOCK_SHA256"] != context_build_args(ROOT, VARIANTS["cuda"])["LOCK_SHA256"]


def test_cuda12_lock_overrides_only_the_stack(pyproject):
    """The CUDA 12 project depends on primerl itself (its extras mirror primerl's) and overrides only the packages
    that make the stack; everything else resolves from primerl's own requirements."""
    cuda12 = tomllib.loads((ROOT / CUDA12.project / "pyproject.toml").read_text())
    overridden = {re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in cuda12["tool"]["uv"]["override-dependencies"]}
    assert overridden == {"torch", "transformers", "vllm"}
    assert set(cuda12["project"]["optional-dependencies"]) == set(pyproject["project"]["optional-dependencies"])
    members = {tomllib.loads(p.read_text())["project"]["name"] for p in ROOT.glob("environments/*/pyproject.toml")}
    assert set(cuda12["project"]["dependencies"]) == {"primerl"} | members
