"""`rl --deterministic`: the settings under which a run on the CPU replays bit for bit (`primerl reproduce`).

What varies between two runs of one config and seed otherwise (docs/rl.md, "What repeats"): the async loop lets a
weight update land while a step's rollouts run; the server batches whatever requests are in flight, and matmul kernels
are not bitwise batch-invariant; thread pools split reductions by their size; the CPU trainer's backward runs in
bfloat16 where the CPU has bfloat16 dot products. A deterministic run fixes each of them:

- the CPU only (GPU kernels are not bit-reproducible here): a run that would use a GPU is refused;
- `max_async_steps = 0`: every step's rollouts come from the weights of the step before, no update lands mid-step;
- the embedded (hf) engine decoding one sequence at a time (`max_batch_size = 1`), not compiled, no overlap: a
  request's logits depend on its own tokens only;
- one thread for the engine and one for the trainer;
- float32 compute and a float32 backward;
- `torch.use_deterministic_algorithms(True)` in the trainer, the run's seed in every process (as always);
- the trainer logs `weight_checksum` (sha256 of the weights after each step) for the replay to compare.

These settings win over what a recipe or config file says (the demo recipe's `max_async_steps = 1` and
`max_batch_size = 16` included): a deterministic run is slower, never different. Nothing here imports torch; the
launcher's config (`RLConfig`) calls `check` when it validates and `apply` when it builds the process configs.
"""

from __future__ import annotations

from typing import Any

THREADS = 1
ENGINE = "hf"
DTYPE = "float32"


def check(engine: str) -> None:
    """ValueError when the run cannot be made deterministic by `apply` (the settings it fixes are overridden, whatever
    a recipe or a config file says; the engine is not: another engine would serve another model build)."""
    if engine != ENGINE:
        raise ValueError(f"deterministic = true needs the embedded engine (inference.engine = '{ENGINE}'), got "
                         f"'{engine}'")


def check_devices(inference: list[int], trainer: list[int]) -> None:
    """ValueError when a deterministic run would put a process on a GPU."""
    if inference or trainer:
        raise ValueError(
            "deterministic = true runs on the CPU only (GPU kernels are not bit-reproducible): set "
            "devices.inference = [] and devices.trainer = [], or drop --deterministic"
        )


def apply(inference: dict[str, Any], orchestrator: dict[str, Any], trainer: dict[str, Any]) -> None:
    """Fix the process configs (plain dicts, as `RLConfig.process_configs` builds them) for a deterministic run."""
    inference["model"]["dtype"] = DTYPE
    inference.update(threads=THREADS, max_batch_size=1, compile=False, overlap=False)
    orchestrator["max_async_steps"] = 0
    orchestrator["model"]["dtype"] = DTYPE
    trainer["model"]["dtype"] = DTYPE
    trainer["train"].update(threads=THREADS, backward_dtype=DTYPE, deterministic=True, weight_checksum=True)


def settings() -> dict[str, Any]:
    """What a deterministic run fixes, as the manifest records it."""
    return {"device": "cpu", "max_async_steps": 0, "engine": ENGINE, "engine_max_batch_size": 1,
            "threads": THREADS, "dtype": DTYPE, "backward_dtype": DTYPE, "deterministic_algorithms": True}
