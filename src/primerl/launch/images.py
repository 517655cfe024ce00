"""primerl's container images through the Docker API (docker-py): the variants and their build arguments, building an
image, running a command in one, describing one. `primerl image` (primerl.commands.image) is the command over them.

`build_image` uses the daemon's classic builder with the host network (pip and uv inside the build reach the package
index directly), streams the build's steps with their elapsed time, and returns the image id `sha256:<64 hex>`:
the digest recipes pin. The image id is the sha256 of the image's configuration, which names every layer by the
sha256 of its content, so it identifies exactly what was built and is the same on every daemon that holds the image
(`docker run sha256:...` and `docker save` accept it). A repository digest (`name@sha256:...`) exists only once an
image has been pushed to a registry and depends on how the registry stores the layers; `describe` returns it when
there is one. Labels carry the pins (see docker/*.Dockerfile); a build adds the git commit of the build context as
`org.opencontainers.image.revision`.

`run_container` starts the image with the run directory mounted at /opt/primerl/runs, runs as the calling user (files
in the run directory are yours), requests the GPUs (all of them by default for a cuda image, none for cpu), keeps
primerl's model cache on the mounted directory, sets PRIMERL_IMAGE_ID for the run manifest, and streams the
container's output; its exit status is the container's.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUNS_IN_IMAGE = "/opt/primerl/runs"
PROJECT_ROOT = Path(__file__).resolve().parents[3]


class ImageError(Exception):
    """A build, run or inspection that cannot proceed; the message says why in one line."""


@dataclass(frozen=True)
class Variant:
    name: str
    dockerfile: str  # relative to the build context
    summary: str
    project: str = "."  # the uv project (relative to the context) whose uv.lock the image syncs
    build_args: tuple[tuple[str, str], ...] = ()  # fixed build arguments of this variant

    def args(self, context: Path) -> dict[str, str]:
        """The Dockerfile's defaults with this variant's build arguments over them."""
        return {**dockerfile_args(context / self.dockerfile), **dict(self.build_args)}

    def default_tag(self, context: Path) -> str:
        """`primerl:cpu`, or `primerl:cuda<major>` from the CUDA version the image builds on."""
        cuda = self.args(context).get("CUDA_VERSION")
        return f"primerl:cuda{cuda.split('.')[0]}" if cuda else f"primerl:{self.name}"


CUDA12_PROJECT = "docker/cuda12"
VARIANTS = {
    "cpu": Variant("cpu", "docker/cpu.Dockerfile", "the locked environment without the GPU extra"),
    "cuda": Variant("cuda", "docker/cuda.Dockerfile", "CUDA 13 base, uv.lock with vllm and flash-attn"),
    "cuda12": Variant(
        "cuda12",
        "docker/cuda.Dockerfile",
        f"CUDA 12.8 base, {CUDA12_PROJECT}/uv.lock (torch 2.10, vllm 0.19) with vllm and flash-attn",
        project=CUDA12_PROJECT,
        build_args=(("CUDA_VERSION", "12.8.1"), ("PROJECT", CUDA12_PROJECT)),
    ),
}
# Build argument -> the locked package whose version it states (the labels carry them; docker/check_pins.py checks).
LABEL_PINS = {
    "TORCH_VERSION": "torch",
    "TRANSFORMERS_VERSION": "transformers",
    "VERIFIERS_VERSION": "verifiers",
    "VLLM_VERSION": "vllm",
    "FLASH_ATTN_VERSION": "flash-attn",
}


def dockerfile_args(path: Path) -> dict[str, str]:
    """The default value of every build argument a Dockerfile declares (`ARG A=1 B="x y"`, continuation lines
    joined, quotes removed); an argument without a default maps to ''. A name declared twice (before and after FROM)
    keeps its first default."""
    text = re.sub(r"\\\n", " ", path.read_text())
    args: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split(None, 1)
        if len(words) == 2 and words[0].upper() == "ARG":
            for item in shlex.split(words[1], comments=True):
                name, _, value = item.partition("=")
                args.setdefault(name, value)
    return args


def locked_versions(lock: Path) -> dict[str, set[str]]:
    """Every package name in a uv.lock with its locked versions (several where environment markers split it)."""
    versions: dict[str, set[str]] = {}
    for package in tomllib.loads(lock.read_text())["package"]:
        versions.setdefault(package["name"], set()).add(package.get("version", ""))
    return versions


def context_build_args(context: Path, variant: Variant) -> dict[str, str]:
    """Build arguments computed from the build context: the variant's lock's sha256, the project's version, the
    variant's fixed arguments, and for a variant with a lock of its own the label pins read from that lock."""
    project = tomllib.loads((context / "pyproject.toml").read_text())["project"]
    lock = context / variant.project / "uv.lock"
    args = {"LOCK_SHA256": hashlib.sha256(lock.read_bytes()).hexdigest(), "PRIMERL_VERSION": project["version"]}
    if variant.project != ".":
        versions = locked_versions(lock)
        args.update({arg: ",".join(sorted(versions.get(name, {""}))) for arg, name in LABEL_PINS.items()})
    return {**args, **dict(variant.build_args)}


def git_revision(context: Path) -> str | None:
    """The commit of the build context, with `-dirty` when tracked files differ from it; None outside git."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(context), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(context), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{sha}-dirty" if dirty else sha


# Seconds one Docker API call may take. Creating a container of a multi-gigabyte image takes minutes on the vfs
# storage driver (it copies the whole file system), far beyond docker-py's default of 60 s.
API_TIMEOUT_S = 900


def docker_client():
    """A docker-py client for DOCKER_HOST (default: the local socket), or ImageError when no daemon answers."""
    import docker

    try:
        client = docker.from_env(timeout=API_TIMEOUT_S)
        client.ping()
    except docker.errors.DockerException as e:
        raise ImageError(f"cannot reach a Docker daemon ({e}); start one or set DOCKER_HOST") from None
    return client


def parse_assignments(items: Iterable[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ImageError(f"{what} '{item}' is not KEY=VALUE")
        out[key] = value
    return out


# ---------------------------------------------------------------------------------------------------------- build


@dataclass(frozen=True)
class BuildResult:
    image_id: str  # sha256:<64 hex>, the digest recipes pin
    tags: list[str]
    platform: str  # os/architecture of the image
    labels: dict[str, str]
    seconds: float

    def as_json(self) -> dict[str, Any]:
        return {
            "image_id": self.image_id,
            "tags": self.tags,
            "platform": self.platform,
            "labels": self.labels,
            "seconds": round(self.seconds, 1),
        }


def build_image(
    client,
    *,
    context: Path,
    variant: Variant,
    tag: str,
    build_args: Mapping[str, str] = {},
    platform: str | None = None,
    target: str | None = None,
    network_mode: str = "host",
    no_cache: bool = False,
    progress=None,
) -> BuildResult:
    """Build `variant` from `context` with the classic builder; `progress(event)` sees every decoded build event.
    Build arguments computed from the context (lock sha256, version) come first; `build_args` override them."""
    args = {**context_build_args(context, variant), **build_args}
    labels = {}
    revision = git_revision(context)
    if revision:
        labels["org.opencontainers.image.revision"] = revision
    start = time.monotonic()
    image_id = None
    tail: list[str] = []
    events = client.api.build(
        path=str(context),
        dockerfile=variant.dockerfile,
        tag=tag,
        buildargs=args,
        labels=labels,
        platform=platform,
        target=target,
        network_mode=network_mode,
        nocache=no_cache,
        rm=True,
        forcerm=True,
        pull=False,
        decode=True,
    )
    for event in events:
        if progress is not None:
            progress(event)
        if "stream" in event:
            tail = (tail + event["stream"].splitlines())[-20:]
        if "aux" in event and "ID" in event["aux"]:
            image_id = event["aux"]["ID"]
        if "error" in event:
            detail = "\n  ".join(line for line in tail if line.strip())
            raise ImageError(f"build of {tag} failed: {event['error'].strip()}\n  last output:\n  {detail}")
    if image_id is None:
        raise ImageError(f"build of {tag} ended without an image id")
    attrs = client.images.get(image_id).attrs
    return BuildResult(
        image_id=image_id,
        tags=[tag],
        platform=f"{attrs.get('Os')}/{attrs.get('Architecture')}",
        labels=dict(attrs["Config"].get("Labels") or {}),
        seconds=time.monotonic() - start,
    )


class BuildProgress:
    """Prints each build step with the time the previous one took, and (unless quiet) the steps' own output."""

    def __init__(self, quiet: bool, out=sys.stderr):
        self.quiet = quiet
        self.out = out
        self.start = self.step_start = time.monotonic()

    def __call__(self, event: Mapping[str, Any]) -> None:
        text = event.get("stream")
        if not text:
            return
        for line in text.splitlines():
            if line.startswith("Step "):
                now = time.monotonic()
                self.out.write(f"[{now - self.start:7.1f}s | prev {now - self.step_start:6.1f}s] {line}\n")
                self.step_start = now
            elif not self.quiet and line.strip() and not line.startswith(" ---> "):
                self.out.write(f"    {line}\n")
        self.out.flush()


# ------------------------------------------------------------------------------------------------------------ run


def gpu_requests(gpus: str, variant: str | None) -> list:
    """Device requests for `--gpus`: 'auto' = all GPUs for a cuda image and none otherwise; 'all', 'none', a count,
    or comma-separated device ids."""
    import docker

    if gpus == "auto":
        gpus = "all" if variant == "cuda" else "none"
    if gpus == "none":
        return []
    if gpus == "all":
        return [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
    if gpus.isdigit():
        return [docker.types.DeviceRequest(count=int(gpus), capabilities=[["gpu"]])]
    return [docker.types.DeviceRequest(device_ids=gpus.split(","), capabilities=[["gpu"]])]


def run_container(
    client,
    image: str,
    command: list[str],
    *,
    run_dir: Path,
    gpus: str = "auto",
    user: str | None = None,
    network_mode: str | None = None,
    environment: Mapping[str, str] = {},
    output=None,
) -> int:
    """Run `command` in `image` with `run_dir` mounted at /opt/primerl/runs; stream its output to `output`
    (bytes, default stdout); return its exit status. The container is removed afterwards, also on Ctrl-C."""
    img = client.images.get(image)
    variant = (img.attrs["Config"].get("Labels") or {}).get("io.primerl.variant")
    run_dir.mkdir(parents=True, exist_ok=True)
    requests = gpu_requests(gpus, variant)
    env = {
        "PRIMERL_IMAGE_ID": img.id,
        "PRIMERL_CACHE": f"{RUNS_IN_IMAGE}/.cache/primerl",
        "HOME": "/tmp",
        **environment,
    }
    container = client.containers.run(
        img.id,
        command=command,
        detach=True,
        init=True,  # signals reach the launcher; zombies are reaped
        user=user if user is not None else f"{os.getuid()}:{os.getgid()}",
        environment=env,
        volumes={str(run_dir.resolve()): {"bind": RUNS_IN_IMAGE, "mode": "rw"}},
        device_requests=requests,
        ipc_mode="host" if requests else None,  # NCCL and torch workers need more shared memory than 64 MB
        network_mode=network_mode,
    )
    out = output or sys.stdout.buffer
    try:
        for chunk in container.logs(stream=True, follow=True):
            out.write(chunk)
            out.flush()
        return int(container.wait()["StatusCode"])
    except KeyboardInterrupt:
        container.stop(timeout=30)
        return 130
    finally:
        container.remove(force=True)


# -------------------------------------------------------------------------------------------------------- inspect


def describe(client, image: str) -> dict[str, Any]:
    """What recipes pin and what the labels claim, for one local image."""
    attrs = client.images.get(image).attrs
    labels = attrs["Config"].get("Labels") or {}
    return {
        "image_id": attrs["Id"],
        "repo_digests": attrs.get("RepoDigests") or [],
        "tags": attrs.get("RepoTags") or [],
        "platform": f"{attrs.get('Os')}/{attrs.get('Architecture')}",
        "created": attrs.get("Created"),
        "size_bytes": attrs.get("Size"),
        "layers": len(attrs.get("RootFS", {}).get("Layers", [])),
        "labels": dict(sorted(labels.items())),
    }
