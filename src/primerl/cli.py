"""`primerl <command>` and its short aliases (`rl`, `sft`, `eval`, `inference`, `trainer`, `orchestrator`, `check`).

Each command lives in its own module and exposes `main(argv) -> int`; this file only dispatches, importing the
command's module lazily so `primerl --help` and `primerl check` never pay for torch or vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Sequence

from primerl.cache import use_compile_cache

# command -> (module with main(argv), one-line summary)
COMMANDS: dict[str, tuple[str, str]] = {
    "rl": ("primerl.commands.rl", "run RL end to end: inference + orchestrator + trainer (config or recipe)"),
    "sft": ("primerl.trainer.sft", "supervised fine-tuning on chat data"),
    "eval": ("primerl.eval", "evaluate a model on an environment (avg@k, pass@k)"),
    "inference": ("primerl.inference.server", "serve a model over the OpenAI-compatible HTTP API"),
    "trainer": ("primerl.trainer.rl", "the RL trainer process: rollouts/step_n -> weights/step_n"),
    "orchestrator": ("primerl.orchestrator.loop", "the orchestrator process: environments, rollouts, batches"),
    "check": ("primerl.commands.check", "run the validation checklist"),
    "run": ("primerl.commands.run", "run a recipe: pins, checklist, then its stages"),
    "recipe": ("primerl.commands.recipe", "recipe tools: lock (write the pins), verify (pins vs this machine), diff (two runs' manifests)"),
    "reproduce": ("primerl.commands.reproduce", "replay a finished recipe run's first steps and compare them"),
    "image": ("primerl.commands.image", "container images: build, run, inspect"),
    "launch": ("primerl.launch.command", "run a recipe on SSH hosts or as a Slurm job"),
    "plot": ("primerl.monitor", "write PNG plots of a run directory's metrics"),
    "models": ("primerl.models", "model registry: list, prepare the embedded model"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = [f"  {name.ljust(width)}  {summary}" for name, (_, summary) in COMMANDS.items() if _available(name)]
    return "\n".join(
        ["usage: primerl <command> [options]   (primerl <command> --help for its options)", "", "commands:", *rows]
    )


def _available(name: str) -> bool:
    try:
        return importlib.util.find_spec(COMMANDS[name][0]) is not None
    except ModuleNotFoundError:
        return False


def dispatch(command: str, argv: Sequence[str]) -> int:
    module_name, _ = COMMANDS[command]
    if not _available(command):
        print(f"primerl: '{command}' is not available in this build", file=sys.stderr)
        return 2
    use_compile_cache()  # before the command imports torch: its processes share one compile cache
    module = importlib.import_module(module_name)
    code = module.main(list(argv))
    return int(code or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from primerl import __version__

        print(f"primerl {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"primerl: unknown command '{command}'\n\n{_usage()}", file=sys.stderr)
        return 2
    return dispatch(command, rest)


def _alias(command: str):
    def entry() -> int:
        return dispatch(command, sys.argv[1:])

    entry.__name__ = f"{command}_main"
    return entry


rl_main = _alias("rl")
sft_main = _alias("sft")
eval_main = _alias("eval")
inference_main = _alias("inference")
trainer_main = _alias("trainer")
orchestrator_main = _alias("orchestrator")
check_main = _alias("check")

if __name__ == "__main__":
    raise SystemExit(main())
