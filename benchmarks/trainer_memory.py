"""The CPU trainer's memory over many steps, before and after the heap fix: replays `--steps` trainer steps of
demo-shaped batches through `Trainer.step` and samples the process's RSS and PSS (/proc/self/smaps_rollup) and its
malloc heap (in use, free: glibc's mallinfo2) after each.

Two modes, each in a child process of its own (the malloc settings are per process):
    before   `keep_freed_memory` only, every micro-batch at its own width (train.width_multiple = 1): the trainer as
             it was when the demo's trainer grew ~25-43 MB a step
    after    `keep_freed_memory`, then `trim_freed_memory` after each step (as `Trainer.finish_step` does) and widths
             rounded to train.width_multiple = 64

Batches: `--samples` samples a step (a prompt of 30-60 tokens, a completion of 1-48, random per step: the
reverse-text demo's shape), packed into rows of `--seq-len`, one row per micro-batch. Weights are not published and
no checkpoint is written (disk work the figure does not need). Reports per mode: RSS/PSS at the end, growth per 100
steps fitted after the warm-up (the first 20 % of the steps), the heap's use and free space, the mean step time.

    uv run python benchmarks/trainer_memory.py --out benchmarks/results/trainer_memory_cpu.json   # the demo's model
    uv run python benchmarks/trainer_memory.py --smoke                                             # tiny, 6 steps
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from procs import sample_process, slope  # benchmarks/procs.py
from report import add_smoke_flag, emit  # benchmarks/report.py

MODES = ("before", "after")


def child(mode: str, model: str, steps: int, samples: int, seq_len: int, run_dir: str) -> dict[str, Any]:
    import os

    import numpy as np

    from primerl.config import load
    from primerl.config.trainer import TrainerConfig
    from primerl.cpu import heap_bytes, keep_freed_memory, trim_freed_memory
    from primerl.trainer.core import Trainer, TrainerParts, micro_batches
    from primerl.trainer.loss import build_loss
    from primerl.trainer.rl import make_rl_loss
    from primerl.transport.rollouts import Sample, pack_samples

    keep_freed_memory()
    width = "1" if mode == "before" else "64"
    cfg, _ = load(TrainerConfig, ["--model.name", model, "--run_dir", run_dir, "--train.micro_batch_rows", "1",
                                  "--train.width_multiple", width, "--optim.lr", "1e-5"])
    trainer = Trainer(TrainerParts.of(cfg), source="trainer")
    step_loss = make_rl_loss(build_loss(cfg.loss))
    vocab = trainer.policy.causal_lm.config.vocab_size
    rng = np.random.default_rng(0)
    rows = []
    for step in range(steps):
        batch = []
        for _ in range(samples):
            prompt, completion = int(rng.integers(30, 61)), int(rng.integers(1, 49))
            ids = rng.integers(0, vocab, prompt + completion).tolist()
            batch.append(Sample(ids, [0] * prompt + [1] * completion, [-1.0] * (prompt + completion),
                                float(rng.standard_normal())))
        packed = pack_samples(batch, seq_len)
        started = time.perf_counter()
        trainer.step(micro_batches(packed.arrays, 1, trainer.device), step_loss)
        trimmed = trim_freed_memory() if mode == "after" else 0
        step_s = time.perf_counter() - started
        facts = sample_process(os.getpid()) or {}
        used, free = heap_bytes() or (0, 0)
        rows.append({"step": step + 1, "rss_mb": round(facts.get("rss_mb", 0.0), 1),
                     "pss_mb": round(facts.get("pss_mb", 0.0), 1), "heap_used_mb": round(used / 2**20, 1),
                     "heap_free_mb": round(free / 2**20, 1), "trimmed": bool(trimmed), "step_s": round(step_s, 3)})
        print(f"{mode} step {step + 1}: rss {rows[-1]['rss_mb']:.0f} MB, heap used {rows[-1]['heap_used_mb']:.0f} "
              f"free {rows[-1]['heap_free_mb']:.0f} MB, {step_s:.2f}s", file=sys.stderr, flush=True)
    return {"rows": rows}


def summarize(mode: str, rows: list[dict[str, Any]], warm_up: int) -> dict[str, Any]:
    late = [r for r in rows if r["step"] > warm_up]

    def growth(key: str) -> float | None:
        fitted = slope([r["step"] for r in late], [r[key] for r in late])
        return None if fitted is None else round(fitted * 100, 2)

    return {
        "mode": mode,
        "rss_mb_first_last": [rows[0]["rss_mb"], rows[-1]["rss_mb"]],
        "pss_mb_first_last": [rows[0]["pss_mb"], rows[-1]["pss_mb"]],
        "peak_rss_mb": max(r["rss_mb"] for r in rows),
        "rss_mb_per_100_steps_after_warm_up": growth("rss_mb"),
        "pss_mb_per_100_steps_after_warm_up": growth("pss_mb"),
        "heap_used_mb_last": rows[-1]["heap_used_mb"],
        "heap_free_mb_last": rows[-1]["heap_free_mb"],
        "steps_trimmed": sum(r["trimmed"] for r in rows),
        "mean_step_s_after_warm_up": round(sum(r["step_s"] for r in late) / max(len(late), 1), 3),
        "per_step": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.samples, args.seq_len = "tiny", 6, 4, 128
    if args.child:
        with tempfile.TemporaryDirectory(prefix="primerl-trainer-memory-") as run_dir:
            print(json.dumps(child(args.child, args.model, args.steps, args.samples, args.seq_len, run_dir)))
        return 0
    result: dict[str, Any] = {
        "benchmark": "CPU trainer memory over repeated steps: keep_freed_memory alone vs with trim and width rounding",
        "model": args.model, "steps": args.steps, "samples_per_step": args.samples, "seq_len": args.seq_len,
        "modes": {},
    }
    for mode in args.modes:
        command = [sys.executable, __file__, "--child", mode, "--model", args.model, "--steps", str(args.steps),
                   "--samples", str(args.samples), "--seq-len", str(args.seq_len)]
        done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
        rows = json.loads(done.stdout.strip().splitlines()[-1])["rows"]
        result["modes"][mode] = summarize(mode, rows, max(1, args.steps // 5))
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
