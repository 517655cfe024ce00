"""`rl`: run RL on this machine, from a recipe or from a plain config.

    rl recipes/reverse-text.toml [--rl.max_steps 40]    a recipe: pins, checklist, stages (`primerl.commands.run`)
    rl @ configs/reverse-text/rl.toml [--max_steps 40] [--resume]
                                                        a plain RL config: `primerl.launch.local.run_rl`

`rl --help` without a config file shows the options as a recipe takes them; `rl` with no arguments at all prints the
usage and exits 2 (it never starts a default run nobody asked for).
"""

from __future__ import annotations

import sys

from primerl.commands.run import main as run_recipe
from primerl.config import config_from_argv
from primerl.config.rl import RLConfig
from primerl.launch.local import run_rl
from primerl.launch.processes import exit_with_parent
from primerl.recipes import recipe_in_argv

USAGE = """usage: rl recipe.toml [--<stage>.<key> value ...]     run a recipe (e.g. rl recipes/reverse-text.toml)
       rl @ config.toml [--<key> value ...]            run a plain RL config (e.g. rl @ configs/debug/tiny-rl.toml)
rl --help lists the options; rl recipe.toml --dry-run prints what a recipe would run."""


def main(argv: list[str] | None = None) -> int:
    """`rl recipe.toml` runs a recipe (pins, checklist, stages); `rl [@] config.toml` runs a plain RL config."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE, file=sys.stderr)
        return 2
    exit_with_parent()
    config_files = [a for a in argv if a == "@" or a.startswith("@") or a.endswith(".toml")]
    if recipe_in_argv(argv) or (not config_files and ("-h" in argv or "--help" in argv)):
        return run_recipe(argv, prog="rl")  # `rl --help` shows the options as a recipe takes them
    cfg = config_from_argv(RLConfig, argv, prog="rl", summary=(RLConfig.__doc__ or "").strip())
    return run_rl(cfg)
