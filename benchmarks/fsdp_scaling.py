"""FSDP2 across GPUs: the RL trainer step on 2 ranks (torchrun, NCCL) against 1 rank, on the same global batch.

Both runs train a random-init model of the Qwen3-0.6B architecture from the same initial weights on the same packed
rows (global batch: `--rows` rows of 16 samples x 1,024 tokens; 1 rank takes all of them as micro-batches, 2 ranks
take half each, as the orchestrator deals them). What it reports:

- equality: the loss (and entropy, grad norm) of every step on 1 and 2 ranks, side by side with their difference.
  Step 1 starts from identical weights, so it isolates the numerics of sharding: 1 rank computes under autocast,
  2 ranks under FSDP2's mixed-precision policy (bf16 parameters gathered, fp32 gradient reduce-scatter), so the
  two agree to bf16 precision, not bit for bit. Later steps add the drift of the updates.
- scaling: global tokens/s of each (median step time after warm-up), the speed-up and the efficiency
  (speed-up / ranks), MFU and peak memory per device.

Prints one JSON object and writes it to --out.

    python benchmarks/fsdp_scaling.py --out benchmarks/results/fsdp_scaling_x2.json   # 2 GPUs
    python benchmarks/fsdp_scaling.py --cpu                                            # dry check: gloo, tiny model
    python benchmarks/fsdp_scaling.py --smoke                                          # --cpu, one step of 2 x 16

It stops at once, with one line, when fewer GPUs are visible than --ranks (use --cpu for the dry check).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import add_smoke_flag, emit
from trainer import QWEN3_0_6B, TINY, fake_rows, trainer_parts, write_random_model

# step 1 runs from identical weights; bf16 compute on either side (autocast vs FSDP2's cast) bounds the difference
LOSS_ATOL_BF16 = 5e-3
LOSS_ATOL_FP32 = 1e-4
STEP_KEYS = ("loss", "entropy", "grad_norm", "mismatch_kl", "num_tokens", "step_s", "tokens_per_s", "mfu",
             "peak_memory_gib")


def global_rows(args: argparse.Namespace, vocab: int, step: int) -> dict[str, np.ndarray]:
    """The step's whole batch: `args.rows` packed rows, the same on every rank and in every run."""
    rows = [fake_rows(args.samples, args.sample_len, vocab, step * args.rows + r) for r in range(args.rows)]
    return {name: np.concatenate([row[name] for row in rows]) for name in rows[0]}


# ---------------------------------------------------------------------------------------------------------------------
# One run: a trainer process per rank


def worker(args: argparse.Namespace) -> int:
    """One rank (under torchrun when there are several): real `Trainer` steps on this rank's share of each batch."""
    from primerl.trainer.core import Trainer, micro_batches, setup_logging
    from primerl.trainer.loss import load_loss
    from primerl.trainer.rl import make_rl_loss
    from primerl.transport.rollouts import split_rows

    setup_logging(int(os.environ.get("RANK", "0")), "fsdp-bench")
    parts = trainer_parts(args.work_dir / f"run_x{args.world}", args.model_dir, optim={"lr": args.lr},
                          train={"device": "cpu" if args.cpu else "cuda", "attention": args.attention,
                                 "compile": args.compile, "micro_batch_rows": 1})
    trainer = Trainer(parts, source="benchmark")
    step_loss = make_rl_loss(load_loss("primerl.trainer.loss:masked_importance_loss"))
    vocab = trainer.policy.causal_lm.config.vocab_size
    rank, world = trainer.dist.rank, trainer.dist.world_size
    steps = []
    try:
        for step in range(args.warmup + args.steps):
            mine = split_rows(global_rows(args, vocab, step), world)[rank]
            metrics = trainer.step(micro_batches(mine, 1, trainer.device), step_loss)
            steps.append({k: metrics.get(k) for k in STEP_KEYS})
        if trainer.dist.is_main:
            result = {"ranks": world, "attention": trainer.policy.attention, "peak_flops": trainer.peak_flops,
                      "device": _device_name(trainer.device), "steps": steps}
            (args.work_dir / f"result_x{world}.json").write_text(json.dumps(result))
    finally:
        trainer.close()
    return 0


def _device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def run(ranks: int, args: argparse.Namespace, model_dir: Path, work_dir: Path, gpus: list[str]) -> dict:
    """Start the `ranks` trainer processes (torchrun for several) and return rank 0's record. They run in their own
    process group, which is killed whole on a timeout, so no rank is left holding a GPU."""
    from primerl.launch.processes import ManagedProcess, child_environment, stop_all, torchrun_command

    program = [str(Path(__file__).resolve()), "--worker", "--world", str(ranks), "--model-dir", str(model_dir),
               "--work-dir", str(work_dir), *_shared_flags(args)]
    cmd = [sys.executable, *program] if ranks == 1 else torchrun_command(ranks, program)
    env = child_environment({"OMP_NUM_THREADS": "1"} if args.cpu else {"CUDA_VISIBLE_DEVICES": ",".join(gpus[:ranks])})
    process = ManagedProcess(f"x{ranks}", cmd, work_dir / f"x{ranks}.log", env)
    started = time.perf_counter()
    process.start()
    try:
        code = process.popen.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        code = f"timeout after {args.timeout_s:.0f}s"
    finally:
        stop_all([process], grace_s=5)
    if code != 0:
        raise RuntimeError(f"the {ranks}-rank run failed ({code}); last lines of its log:\n{process.tail(40)}")
    result = json.loads((work_dir / f"result_x{ranks}.json").read_text())
    result["wall_s"] = time.perf_counter() - started
    return result


def _shared_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--rows", str(args.rows), "--samples", str(args.samples), "--sample-len", str(args.sample_len),
             "--steps", str(args.steps), "--warmup", str(args.warmup), "--attention", args.attention,
             "--lr", str(args.lr), "--compile" if args.compile else "--no-compile"]
    return flags + (["--cpu"] if args.cpu else [])


# ---------------------------------------------------------------------------------------------------------------------
# Comparison


def summarize(one: dict, many: dict, args: argparse.Namespace) -> dict:
    timed = slice(args.warmup, None)

    def median(result: dict, key: str) -> float:
        return statistics.median(s[key] for s in result["steps"][timed])

    def side_by_side(key: str) -> list[dict]:
        return [{"step": i + 1, "x1": a[key], f"x{many['ranks']}": b[key], "diff": b[key] - a[key]}
                for i, (a, b) in enumerate(zip(one["steps"], many["steps"]))]

    ranks = many["ranks"]
    tokens_per_s = {r["ranks"]: r["steps"][0]["num_tokens"] / median(r, "step_s") for r in (one, many)}
    speedup = tokens_per_s[ranks] / tokens_per_s[1]
    loss = side_by_side("loss")
    atol = LOSS_ATOL_FP32 if args.cpu else LOSS_ATOL_BF16
    return {
        "loss_step1_x1": loss[0]["x1"],
        f"loss_step1_x{ranks}": loss[0][f"x{ranks}"],
        "loss_step1_diff": loss[0]["diff"],
        "loss_max_abs_diff": max(abs(s["diff"]) for s in loss),
        "loss_atol": atol,
        "losses_match": abs(loss[0]["diff"]) <= atol,
        "tokens_per_s_x1": tokens_per_s[1],
        f"tokens_per_s_x{ranks}": tokens_per_s[ranks],
        "speedup": speedup,
        "efficiency": speedup / ranks,
        "step_s_x1": median(one, "step_s"),
        f"step_s_x{ranks}": median(many, "step_s"),
        "mfu_x1": median(one, "mfu") if one["steps"][0]["mfu"] is not None else None,
        f"mfu_x{ranks}": median(many, "mfu") if many["steps"][0]["mfu"] is not None else None,
        "peak_memory_gib_x1": one["steps"][-1]["peak_memory_gib"],
        f"peak_memory_gib_x{ranks}": many["steps"][-1]["peak_memory_gib"],
        "loss_per_step": loss,
        "entropy_per_step": side_by_side("entropy"),
        "grad_norm_per_step": side_by_side("grad_norm"),
        "step_s_all_x1": [s["step_s"] for s in one["steps"]],
        f"step_s_all_x{ranks}": [s["step_s"] for s in many["steps"]],
        "wall_s_x1": one["wall_s"],
        f"wall_s_x{ranks}": many["wall_s"],
    }


# ---------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="ranks (GPUs) of the sharded run, against 1")
    parser.add_argument("--cpu", action="store_true", help="dry check on the CPU: gloo, tiny model, float32")
    parser.add_argument("--rows", type=int, default=None, help="rows in the global batch (default: --ranks)")
    parser.add_argument("--samples", type=int, default=None, help="samples per row (default 16; --cpu 4)")
    parser.add_argument("--sample-len", type=int, default=None, help="tokens per sample (default 1024; --cpu 64)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="steps before timing (compilation, allocator)")
    parser.add_argument("--attention", default="auto", help="train.attention")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each decoder layer (default: on with CUDA)")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    parser.add_argument("--timeout-s", type=float, default=420, help="limit for each run")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.cpu, args.steps, args.warmup = True, 1, 0
        args.samples, args.sample_len = args.samples or 2, args.sample_len or 16
    args.rows = args.rows or args.ranks
    args.samples = args.samples or (4 if args.cpu else 16)
    args.sample_len = args.sample_len or (64 if args.cpu else 1024)
    if args.compile is None:
        args.compile = not args.cpu
    if args.worker:
        return worker(args)

    import torch
    import transformers

    from primerl.launch.local import visible_gpus
    from primerl.launch.processes import child_environment
    from primerl.multicast import MULTICAST_OFF

    gpus = visible_gpus()
    if not args.cpu and (torch.cuda.device_count() < args.ranks or len(gpus) < args.ranks):
        print(f"fsdp_scaling: needs {args.ranks} GPUs, {torch.cuda.device_count()} visible "
              f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); --cpu runs the dry check",
              file=sys.stderr)
        return 2
    if args.rows % args.ranks:
        parser.error(f"--rows ({args.rows}) must be a multiple of --ranks ({args.ranks})")

    with tempfile.TemporaryDirectory(prefix="fsdp-scaling-") as tmp:
        work_dir = Path(tmp)
        model_dir = work_dir / "model"
        write_random_model(TINY if args.cpu else QWEN3_0_6B, model_dir)
        one = run(1, args, model_dir, work_dir, gpus)
        try:
            many, error = run(args.ranks, args, model_dir, work_dir, gpus), None
        except RuntimeError as e:  # keep the 1-rank figures
            many, error = None, str(e)

    result = {
        "what": f"RL trainer step (masked importance loss, fused log-probs, AdamW on fp32 master weights) on 1 rank vs "
                f"{args.ranks} FSDP2 ranks, same initial weights, same global batch of {args.rows} rows x "
                f"{args.samples * args.sample_len} tokens ({args.samples} samples x {args.sample_len}); 1 rank: "
                f"autocast, {args.rows} micro-batches; {args.ranks} ranks: FSDP2 bf16 params / fp32 reduce, "
                f"{args.rows // args.ranks} micro-batch(es) each",
        "model": "tiny Qwen3 (2 layers), random init" if args.cpu else "Qwen3-0.6B architecture, random init",
        "backend": "gloo (CPU)" if args.cpu else "nccl",
        "device": one["device"],
        **(summarize(one, many, args) if many else {"error": f"{args.ranks} ranks: {error}", "x1": one}),
        "attention": one["attention"],
        "compile": args.compile,
        "steps_timed": args.steps,
        "warmup_steps": args.warmup,
        "transformers": transformers.__version__,
        "multicast_env": {k: child_environment()[k] for k in MULTICAST_OFF},  # what the ranks ran with
    }
    emit(result, args.out, smoke=args.smoke)
    return 0 if many else 1


if __name__ == "__main__":
    sys.exit(main())
