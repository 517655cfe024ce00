"""`primerl launch <target> recipe.toml`: run a recipe beyond this machine. One module per target:

    primerl launch ssh   recipe.toml [--deploy hosts.toml] [--run-dir DIR] [--dry-run] [--accept-new-host-keys]
                         [--max-restarts N] [--rl.max_steps=5]
    primerl launch slurm recipe.toml [--deploy slurm.toml] [--run-dir DIR] [--dry-run] [--rl.max_steps=5]

The deployment comes from the recipe's `[deploy]` table merged with each `--deploy` file's (`primerl.config.deploy`);
stage options are overridden as in `primerl run`. A bad recipe, deploy key or option is one line and exit code 2.
This module parses the command line (`parse_request`); the target's module runs it (`launch(request)`).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGETS = {
    "ssh": ("primerl.launch.ssh", "SSH hosts (fabric): preflight, checklist on every host, then the roles"),
    "slurm": ("primerl.launch.slurm", "a Slurm job (sbatch from templates), followed until it ends"),
}
USAGE_ERROR = 2


@dataclass
class LaunchRequest:
    """What a target's command line asked for, loaded and validated."""

    recipe: Any  # primerl.recipes.schema.Recipe
    deploy: Any  # primerl.config.deploy.DeployConfig
    overrides: dict[str, Any]
    dry_run: bool


def parse_request(target: str, argv: list[str], describe: str) -> LaunchRequest | int:
    """Parse `primerl launch <target>`'s arguments and load recipe and deployment; an int is the exit code of a
    usage error (already reported in one line)."""
    from primerl.config import ConfigError
    from primerl.launch.plan import PlanError, load_deploy
    from primerl.recipes.plan import stage_overrides
    from primerl.recipes.schema import RecipeError
    from primerl.recipes.stages import load_recipe

    prog = f"primerl launch {target}"
    parser = argparse.ArgumentParser(prog=prog, description=describe)
    parser.add_argument("recipe", help="the recipe file (an RL recipe)")
    parser.add_argument("--deploy", type=Path, action="append", default=[], metavar="FILE",
                        help="a TOML file with a [deploy] table, merged over the recipe's (repeatable)")
    parser.add_argument("--run-dir", help="deploy.run_dir: an absolute path every host sees")
    parser.add_argument("--dry-run", action="store_true", help="print the plan (and script) and exit")
    parser.add_argument("--accept-new-host-keys", action="store_true",
                        help="deploy.accept_new_host_keys: accept the key of an SSH host seen for the first time, "
                        "record it in deploy.known_hosts (default ~/.ssh/known_hosts) and log its fingerprint; without "
                        "it an unknown host key is refused")
    if target == "ssh":
        parser.add_argument("--max-restarts", type=int, metavar="N",
                            help="rl.max_restarts: restart the whole run from its last checkpoint after a process "
                            "failed or the run hung, at most N times (default: the rl stage's, 3 for a recipe; "
                            "0 = off)")
    args, rest = parser.parse_known_args(argv)
    try:
        recipe = load_recipe(args.recipe)
        overrides = stage_overrides(recipe, rest)
        if getattr(args, "max_restarts", None) is not None:
            overrides.setdefault("rl", {})["max_restarts"] = args.max_restarts
        deploy = load_deploy(recipe, args.deploy, run_dir=args.run_dir, target=target,
                             accept_new_host_keys=args.accept_new_host_keys or None)
    except (RecipeError, ConfigError, PlanError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    return LaunchRequest(recipe, deploy, overrides, args.dry_run)


def _usage() -> str:
    rows = [f"  {name:6s} {summary}" for name, (_, summary) in TARGETS.items()]
    return "usage: primerl launch <target> recipe.toml [options]\n\ntargets:\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else USAGE_ERROR
    if argv[0] not in TARGETS:
        print(f"primerl launch: unknown target '{argv[0]}'\n\n{_usage()}", file=sys.stderr)
        return USAGE_ERROR
    module = importlib.import_module(TARGETS[argv[0]][0])  # its `launch(request)` runs the request
    request = parse_request(argv[0], argv[1:], module.__doc__.splitlines()[0])
    if isinstance(request, int):
        return request
    return int(module.launch(request) or 0)
