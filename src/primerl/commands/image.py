"""`primerl image build | run | inspect`: primerl's container images through the Docker API (docker-py).

    primerl image build [--variant cpu|cuda|cuda12] [--tag T] [--platform linux/arm64] [--base-image IMG] [--build-arg K=V]
    primerl image run [--run-dir DIR] [--gpus auto|all|none|N|0,1] IMAGE rl recipes/tiny.toml --run-dir runs/tiny
    primerl image inspect IMAGE

The images, variants and Docker calls are in primerl.launch.images. `build` uses the daemon's classic builder with
the host network (pip and uv inside the build reach the package index directly), streams the build's steps with their elapsed time, and ends by printing the image id `sha256:<64 hex>`:
the digest recipes pin. The image id is the sha256 of the image's configuration, which names every layer by the
sha256 of its content, so it identifies exactly what was built and is the same on every daemon that holds the image
(`docker run sha256:...` and `docker save` accept it). A repository digest (`name@sha256:...`) exists only once an
image has been pushed to a registry and depends on how the registry stores the layers; `inspect` prints it when there
is one. Labels carry the pins (see docker/*.Dockerfile); `build` adds the git commit of the build context as
`org.opencontainers.image.revision`.

`run` takes its options before IMAGE, like `docker run`: everything after IMAGE is the command. It starts the image
with the run directory mounted at /opt/primerl/runs, runs as the calling user (files in the run
directory are yours), requests the GPUs (all of them by default for a cuda image, none for cpu), keeps primerl's model
cache on the mounted directory, sets PRIMERL_IMAGE_ID for the run manifest, and streams the container's output; its
exit status is the container's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from primerl.launch.images import (
    PROJECT_ROOT,
    RUNS_IN_IMAGE,
    VARIANTS,
    BuildProgress,
    ImageError,
    build_image,
    describe,
    docker_client,
    parse_assignments,
    run_container,
)


def _print_description(info: Mapping[str, Any]) -> None:
    print(f'image id      {info["image_id"]}   (pin: {info["platform"]} = "{info["image_id"]}")')
    for digest in info["repo_digests"]:
        print(f"repo digest   {digest}")
    print(f"tags          {', '.join(info['tags']) or '-'}")
    print(f"platform      {info['platform']}")
    print(f"size          {info['size_bytes'] / 1e9:.2f} GB in {info['layers']} layers")
    for key, value in info["labels"].items():
        print(f"label         {key} = {value}")



def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="primerl image", description="primerl's container images (docker-py).")
    sub = parser.add_subparsers(dest="action", required=True)

    build = sub.add_parser("build", help="build an image; prints the image id recipes pin")
    build.add_argument("--variant", choices=sorted(VARIANTS), default="cpu", help="which Dockerfile (default cpu)")
    build.add_argument("--tag", help="image tag (default primerl:cpu or primerl:cuda<major>)")
    build.add_argument("--platform", help="target platform, e.g. linux/amd64 or linux/arm64 (default: the daemon's)")
    build.add_argument("--base-image", help="the BASE_IMAGE build argument: a local image standing in for the default")
    build.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    build.add_argument("--target", help="stop at this stage of a multi-stage Dockerfile")
    build.add_argument("--context", type=Path, default=PROJECT_ROOT, help="build context (default: the project)")
    build.add_argument("--network", default="host", help="network of the build's RUN steps (default host)")
    build.add_argument("--no-cache", action="store_true", help="rebuild every layer")
    build.add_argument("--quiet", action="store_true", help="print only the steps, not their output")
    build.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")

    run = sub.add_parser("run", help="run a command in an image with a run directory mounted (options before IMAGE)")
    run.add_argument("image", help="tag or image id")
    run.add_argument("--run-dir", type=Path, default=Path("runs"), help=f"mounted at {RUNS_IN_IMAGE} (default runs)")
    run.add_argument("--gpus", default="auto", help="auto (cuda image: all), all, none, a count, or ids '0,1'")
    run.add_argument("--user", help="uid:gid in the container (default: yours; 'image' keeps the image's user)")
    run.add_argument("--network", help="container network mode (default: the daemon's default)")
    run.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="repeatable")
    run.add_argument("command", nargs=argparse.REMAINDER, help="everything after IMAGE, e.g. rl recipes/tiny.toml")

    inspect = sub.add_parser("inspect", help="print an image's id, digests, platform and pins")
    inspect.add_argument("image", help="tag or image id")
    inspect.add_argument("--json", action="store_true", help="print as one JSON object")
    return parser


def _build(args: argparse.Namespace) -> int:
    client = docker_client()
    context = args.context.resolve()
    variant = VARIANTS[args.variant]
    build_args = parse_assignments(args.build_arg, "--build-arg")
    if args.base_image:
        build_args["BASE_IMAGE"] = args.base_image
    tag = args.tag or variant.default_tag(context)
    print(f"building {tag} from {variant.dockerfile} ({variant.summary})", file=sys.stderr)
    result = build_image(
        client,
        context=context,
        variant=variant,
        tag=tag,
        build_args=build_args,
        platform=args.platform,
        target=args.target,
        network_mode=args.network,
        no_cache=args.no_cache,
        progress=BuildProgress(quiet=args.quiet),
    )
    if args.json:
        print(json.dumps(result.as_json()))
    else:
        print(f"built {tag} for {result.platform} in {result.seconds:.0f}s")
        print(f"image id {result.image_id}")
    return 0


def _run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    user = None if args.user is None else ("" if args.user == "image" else args.user)
    return run_container(
        docker_client(),
        args.image,
        command,
        run_dir=args.run_dir,
        gpus=args.gpus,
        user=user,
        network_mode=args.network,
        environment=parse_assignments(args.env, "--env"),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.action == "build":
            return _build(args)
        if args.action == "run":
            return _run(args)
        info = describe(docker_client(), args.image)
        print(json.dumps(info, indent=2)) if args.json else _print_description(info)
        return 0
    except ImageError as e:
        print(f"primerl image: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
