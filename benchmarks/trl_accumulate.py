"""Run the TRL GRPOTrainer peer harness (../peers/trl_grpo.py, unchanged) with each step's rollouts trained in
micro-batches, as a TRL user fits a large step on one GPU: `per_device_train_batch_size` becomes the micro-batch and
`gradient_accumulation_steps` the number of them, so one generation of all the step's rollouts is followed by one
optimizer step over them (TRL's `steps_per_generation` defaults to the accumulation steps), as before.

The harness builds `GRPOConfig(per_device_train_batch_size=ROLLOUTS, ...)`: every rollout of the step in one forward
and backward. At the matrix's real sizes that cannot fit (Qwen3-0.6B, 64 x 8 rollouts of 512 tokens: the logits alone
are about 80 GB in bfloat16), so `benchmarks/e2e_vs_trl.py --trl-micro-batch N` starts the harness through this file:

    python3 benchmarks/trl_accumulate.py --micro-batch 16 PEER_SCRIPT [the harness's own arguments]

The split is printed as one JSON line before the harness's output.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys


def split(rollouts: int, micro_batch: int) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) for `rollouts` rows a step in micro-batches of at
    most `micro_batch` rows: the largest micro-batch that divides the rollouts (TRL needs equal micro-batches)."""
    if rollouts < 1 or micro_batch < 1:
        raise ValueError(f"rollouts ({rollouts}) and micro-batch ({micro_batch}) must be positive")
    size = min(micro_batch, rollouts)
    while rollouts % size:
        size -= 1
    return size, rollouts // size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--micro-batch", type=int, required=True, help="rows per forward and backward")
    parser.add_argument("script", help="the peer harness trl_grpo.py")
    args, rest = parser.parse_known_args(argv)
    if args.micro_batch < 1:
        parser.error(f"--micro-batch must be positive, got {args.micro_batch}")

    import trl

    peer_config = trl.GRPOConfig

    class AccumulatingConfig(peer_config):
        def __init__(self, *positional, per_device_train_batch_size: int = 8, **named):
            size, steps = split(per_device_train_batch_size, args.micro_batch)
            print(json.dumps({"trl_micro_batch": size, "gradient_accumulation_steps": steps,
                              "rollouts_per_step": per_device_train_batch_size}), flush=True)
            super().__init__(*positional, per_device_train_batch_size=size, gradient_accumulation_steps=steps,
                             **named)

    AccumulatingConfig.__name__ = AccumulatingConfig.__qualname__ = peer_config.__name__
    trl.GRPOConfig = AccumulatingConfig
    sys.argv = [args.script, *rest]
    runpy.run_path(args.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
