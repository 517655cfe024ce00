"""The trainer's step on the CPU with the bfloat16 backward against the float32 one, and what `auto` picks here.

`train.backward_dtype = auto` runs the backward matmuls in bfloat16 on a CPU with bfloat16 dot products (AVX512-BF16,
AMX; aarch64's BF16), where they ran 2-3.5x the float32 rate (benchmarks/NOTES.md). On a CPU without them oneDNN still
accepts bfloat16 and converts in software. This script times the real `Trainer.step` (SmolLM2-135M-Instruct, one
packed row of `--samples` x `--sample-len` tokens, one thread) with each backward dtype, the two trainers alternating
step by step so that a busy machine slows both alike, and records the CPU's flags and the dtype `auto` resolves to.
Prints one JSON object (and writes it to --out).

    uv run python benchmarks/backward_dtype.py --out benchmarks/results/backward_dtype_cpu.json
    uv run python benchmarks/backward_dtype.py --smoke      # the tiny model, one step each
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_smoke_flag, emit
from trainer import fake_rows, trainer_parts

DTYPES = ("float32", "bfloat16")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name or model directory")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per dtype (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first, per dtype")
    parser.add_argument("--samples", type=int, default=8, help="samples per packed row")
    parser.add_argument("--sample-len", type=int, default=64, help="tokens per sample (P1's batches: ~500-600 tokens)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the CPU trainer's default)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.steps, args.warmup, args.samples, args.sample_len = "tiny", 1, 0, 2, 16

    from primerl.cpu import cpu_has_bf16_dot_products, onednn_bf16
    from primerl.models import resolve_model
    from primerl.trainer.core import Trainer, micro_batches
    from primerl.trainer.loss import load_loss
    from primerl.trainer.model import backward_dtype_for
    from primerl.trainer.rl import make_rl_loss

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model, None)
    trainers = {}
    with tempfile.TemporaryDirectory(prefix="backward-dtype-") as tmp:
        for dtype in DTYPES:
            parts = trainer_parts(Path(tmp) / dtype, model_dir, optim={"lr": 1e-6},
                                  train={"device": "cpu", "backward_dtype": dtype})
            trainers[dtype] = Trainer(parts, source="benchmark")
        step_loss = make_rl_loss(load_loss("primerl.trainer.loss:masked_importance_loss"))
        vocab = trainers["float32"].policy.causal_lm.config.vocab_size
        times: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
        for step in range(args.warmup + args.steps):
            rows = fake_rows(args.samples, args.sample_len, vocab, step)
            for dtype, trainer in trainers.items():  # alternating: the same load on both
                done = trainer.step(micro_batches(rows, 1, trainer.device), step_loss)
                if step >= args.warmup:
                    times[dtype].append(round(done["step_s"], 3))
    step_s = {dtype: statistics.median(values) for dtype, values in times.items()}
    auto = backward_dtype_for("auto", torch.float32, torch.device("cpu"))
    result = {
        "model": str(args.model),
        "layout": f"1 row x {args.samples * args.sample_len} tokens from {args.samples} samples x {args.sample_len}",
        "threads": args.threads,
        "step_s": step_s,
        "steps_s": times,
        "bfloat16_over_float32": round(step_s["bfloat16"] / step_s["float32"], 3),
        "cpu_bf16_dot_products": cpu_has_bf16_dot_products(),
        "onednn_reports_bf16": bool(torch.backends.mkldnn.is_available()
                                    and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "auto_uses_bf16": onednn_bf16(),
        "auto_resolves_to": str(auto).removeprefix("torch."),
        "faster": min(step_s, key=step_s.get),
    }
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
