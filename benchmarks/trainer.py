"""P2: one RL trainer step on packed 16k-token rows vs plain transformers training, measured in the same call.

Ours: the real `primerl.trainer.core.Trainer.step` (forward on a packed row with per-sample attention, fused chunked
log-probs and entropy, masked importance-ratio loss, backward, grad clipping, AdamW on fp32 master weights, bf16
compute) on rows of 16 samples x 1,024 tokens. Baseline: `model(input_ids, labels=input_ids).loss.backward()` +
`torch.optim.AdamW` on a bf16 model with SDPA, batch 16 x 1,024. Both on the Qwen3-0.6B architecture, random init.
Warm-up steps are excluded. Prints one JSON object (and writes it to --out).

    python benchmarks/trainer.py --out benchmarks/results/p2_trainer_h200.json      # GPU
    python benchmarks/trainer.py --tiny                                             # CPU: 2 layers, 4 x 64 tokens
    python benchmarks/trainer.py --smoke                                            # CPU: one step of 2 x 16

Also the other trainer benchmarks' shared parts: the model shapes, `write_random_model`, `fake_rows` and
`trainer_parts`, the one place a benchmark's trainer config is built.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from report import add_smoke_flag, emit  # benchmarks/report.py

QWEN3_0_6B = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
}
TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 2048,
    "tie_word_embeddings": True,
    "max_position_embeddings": 1024,
}


def write_random_model(arch: dict, out: Path) -> None:
    """A random-init Qwen3 model directory (fp32) with the tiny test tokenizer (the trainer only needs one to export)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from primerl.models import build_tiny_tokenizer

    torch.manual_seed(0)
    config = Qwen3Config(**arch)
    Qwen3ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out)


def fake_rows(num_samples: int, sample_len: int, vocab: int, step: int) -> dict[str, np.ndarray]:
    """One packed row of `num_samples` samples; inference log-probs near a random-init model's (-log V)."""
    from primerl.transport.rollouts import Sample, pack_samples

    rng = np.random.default_rng(step)
    samples = []
    for _ in range(num_samples):
        ids = rng.integers(0, vocab, sample_len).tolist()
        mask = [0] * (sample_len // 4) + [1] * (sample_len - sample_len // 4)
        logq = (-np.log(vocab) + rng.normal(0, 0.1, sample_len)).tolist()
        samples.append(Sample(ids, mask, logq, float(rng.standard_normal())))
    return pack_samples(samples, num_samples * sample_len).arrays


def trainer_parts(run_dir: Path, model: str | Path, **sections: dict):
    """The config sections a benchmark's `Trainer` is built from, validated as `primerl trainer` validates its own:
    `sections` are TrainerConfig's tables (`train={...}`, `optim={...}`, `weights={...}`) over its defaults, and,
    unless they say otherwise, no checkpoint at the end and no weight export (a benchmark times what it asks for)."""
    from primerl.config.trainer import TrainerConfig
    from primerl.trainer.core import TrainerParts

    tables = {"ckpt": {"save_at_end": False}, "weights": {"interval": None}, **sections}
    return TrainerParts.of(TrainerConfig(run_dir=run_dir, model={"name": str(model)}, **tables))


def bench_ours(model_dir: Path, args, device: str) -> dict:
    from primerl.trainer.core import Trainer, micro_batches
    from primerl.trainer.loss import load_loss
    from primerl.trainer.rl import make_rl_loss

    parts = trainer_parts(
        Path(tempfile.mkdtemp(prefix="p2-")), model_dir, optim={"lr": 1e-6},
        train={"device": device, "attention": args.attention, "activation_checkpointing": args.activation_checkpointing,
               "compile": args.compile, "logprob_chunk_tokens": args.chunk_tokens},
    )
    trainer = Trainer(parts, source="benchmark")
    step_loss = make_rl_loss(load_loss("primerl.trainer.loss:masked_importance_loss"))
    vocab = trainer.policy.causal_lm.config.vocab_size
    times, last = [], {}
    for step in range(args.warmup + args.steps):
        batch = micro_batches(fake_rows(args.samples, args.sample_len, vocab, step), 1, trainer.device)
        last = trainer.step(batch, step_loss)
        if step >= args.warmup:
            times.append(last["step_s"])
    step_s = statistics.median(times)
    tokens = args.samples * args.sample_len
    result = {
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        "mfu": last["mfu"] * last["step_s"] / step_s if last["mfu"] is not None else None,
        "tflops_per_s": last["tflops_per_device"] * last["step_s"] / step_s,
        "peak_memory_gib": last["peak_memory_gib"],
        "attention": trainer.policy.attention,
        "peak_flops": trainer.peak_flops,
        "loss": last["loss"],
        "step_s_all": times,
    }
    del trainer
    return result


def bench_hf_baseline(model_dir: Path, args, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").to(device)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    vocab = model.config.vocab_size
    times = []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(step)
        input_ids = torch.randint(0, vocab, (args.samples, args.sample_len), generator=g).to(device)
        _sync(device)
        start = time.perf_counter()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
    del model, optimizer
    return {"tokens_per_s": args.samples * args.sample_len / step_s, "step_s": step_s, "peak_memory_gib": peak}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _reset_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model and 4 x 64-token samples (CPU smoke test)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation, allocator)")
    parser.add_argument("--samples", type=int, default=None, help="samples per row (default 16; --tiny 4)")
    parser.add_argument("--sample-len", type=int, default=None, help="tokens per sample (default 1024; --tiny 64)")
    parser.add_argument("--attention", default="auto", help="train.attention for ours")
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each decoder layer (ours; default: on with CUDA)",
    )
    parser.add_argument("--activation-checkpointing", action="store_true", help="ours: recompute layers in backward")
    parser.add_argument("--chunk-tokens", type=int, default=4096, help="ours: tokens per log-prob chunk")
    parser.add_argument("--skip-baseline", action="store_true", help="measure ours only")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tiny, args.steps, args.warmup = True, 1, 0
        args.samples, args.sample_len = args.samples or 2, args.sample_len or 16
    args.samples = args.samples or (4 if args.tiny else 16)
    args.sample_len = args.sample_len or (64 if args.tiny else 1024)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.compile is None:
        args.compile = device == "cuda"
    arch = TINY if args.tiny else QWEN3_0_6B

    with tempfile.TemporaryDirectory(prefix="p2-model-") as tmp:
        model_dir = Path(tmp)
        write_random_model(arch, model_dir)
        _reset_memory(device)
        ours = bench_ours(model_dir, args, device)
        _reset_memory(device)
        baseline = None if args.skip_baseline else bench_hf_baseline(model_dir, args, device)

    import transformers

    result = {
        "model": "Qwen3-0.6B architecture, random init" if not args.tiny else "tiny Qwen3 (2 layers), random init",
        "layout": f"1 row x {args.samples * args.sample_len} tokens packed from {args.samples} samples x "
        f"{args.sample_len}; baseline batch {args.samples} x {args.sample_len}",
        "tokens_per_s": ours["tokens_per_s"],
        "hf_baseline_tokens_per_s": baseline["tokens_per_s"] if baseline else None,
        "ratio": ours["tokens_per_s"] / baseline["tokens_per_s"] if baseline else None,
        "mfu": ours["mfu"],
        "peak_memory_gib": ours["peak_memory_gib"],
        "step_s": ours["step_s"],
        "hf_baseline_step_s": baseline["step_s"] if baseline else None,
        "hf_baseline_peak_memory_gib": baseline["peak_memory_gib"] if baseline else None,
        "tflops_per_s": ours["tflops_per_s"],
        "peak_flops_used": ours["peak_flops"],
        "attention": ours["attention"],
        "compile": args.compile,
        "activation_checkpointing": args.activation_checkpointing,
        "logprob_chunk_tokens": args.chunk_tokens,
        "precision": "ours: fp32 master weights + AdamW states, bf16 autocast compute; baseline: bf16 params + AdamW"
        if device == "cuda"
        else "float32 (CPU)",
        "steps_timed": args.steps,
        "warmup_steps": args.warmup,
        "step_s_all": ours["step_s_all"],
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "transformers": transformers.__version__,
    }
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
