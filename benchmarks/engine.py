"""Benchmark P3: decode throughput of the embedded engine against Hugging Face `generate`.

N concurrent requests of M sampled tokens each (temperature 1, eos ignored, so both sides decode exactly N × M
tokens) on the same weights in the same dtype. Runs alternate (engine, generate, engine, generate, ...) after one
warm-up of each; the best run of each side is reported. Prints one JSON object; `--out FILE` also writes it.

    uv run python benchmarks/engine.py                                  # CPU: SmolLM2-135M, 16 x 48, bfloat16
    python3 benchmarks/engine.py --random-init --arch qwen3-0.6b        # GPU: 64 x 128, bfloat16, CUDA graphs
    uv run python benchmarks/engine.py --smoke                          # CPU: random tiny Llama, 2 x 4, float32

On CUDA the result also holds the measured device-to-device copy bandwidth and the bandwidth limit of decode:
batch × bandwidth / weight bytes (every decode step reads every weight once).
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from report import add_smoke_flag, emit, not_run  # benchmarks/report.py
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from primerl.inference.engines.base import Engine, Finish, SamplingParams
from primerl.inference.engines.hf import HFEngine
from primerl.models import resolve_model

PROMPT_TOKENS = 32
DEFAULT_DECODE_STEPS = 8  # HFEngine's default

# Architectures to build with random weights where the real files are absent (the GPU machine); `tiny` has the
# shapes of the registry's tiny model (smoke runs).
ARCHITECTURES: dict[str, dict] = {
    "tiny": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 1028,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    },
    "smollm2-135m": {
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    },
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "pad_token_id": 151643,
    },
}


def random_init_dir(arch: str, dtype: torch.dtype, into: Path) -> Path:
    """A model directory with random weights of `arch` (fixed seed) and the tiny model's tokenizer."""
    spec = dict(ARCHITECTURES[arch])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(into)
    AutoTokenizer.from_pretrained(resolve_model("tiny")).save_pretrained(into)
    return into


def make_prompts(batch: int, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab_size, (batch, PROMPT_TOKENS), generator=generator).tolist()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def engine_run(engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str, seed: int | None = 0) -> float:
    """Seconds to complete all prompts concurrently, new_tokens each (every request with `seed`)."""
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=seed)

    async def one(i: int, prompt: list[int]) -> None:
        async for event in engine.generate(prompt, params, f"{tag}-{i}"):
            if isinstance(event, Finish):
                assert event.completion_tokens == new_tokens, event

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return time.perf_counter() - start


def generate_run(model, prompts: list[list[int]], new_tokens: int) -> float:
    input_ids = torch.tensor(prompts, device=model.device)
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
    )
    synchronize(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    synchronize(model.device)
    assert out.shape[1] == PROMPT_TOKENS + new_tokens, out.shape
    return time.perf_counter() - start


def generate_batch_run(model, prompts: list[list[int]], new_tokens: int) -> float:
    """transformers' own continuous batching (`generate_batch`), its paged cache sized for this batch."""
    from transformers import ContinuousBatchingConfig

    pages = ContinuousBatchingConfig(num_blocks=2 * len(prompts), max_batch_tokens=len(prompts) * PROMPT_TOKENS)
    config = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        eos_token_id=-1,
    )
    synchronize(model.device)
    start = time.perf_counter()
    outputs = model.generate_batch(
        prompts, generation_config=config, continuous_batching_config=pages, progress_bar=False
    )
    synchronize(model.device)
    assert all(len(o.generated_tokens) == new_tokens for o in outputs.values()), "generate_batch stopped early"
    return time.perf_counter() - start


async def device_busy(run) -> dict:
    """One more engine run under the CUDA profiler: the device's kernel time against the run's wall time, and the
    idle gaps between kernels (the host's share of a step: scheduling, sampling's inputs, the copies back)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        started = time.perf_counter()
        await run("busy")
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - started
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    )
    busy_us, gaps, reach = 0.0, [], None
    for start, end in spans:  # union of kernel intervals; gaps between them
        if reach is None or start > reach:
            if reach is not None:
                gaps.append(start - reach)
            busy_us += end - start
            reach = end
        elif end > reach:
            busy_us += end - reach
            reach = end
    window_us = (reach - spans[0][0]) if spans else 0.0
    long_gaps = [g for g in gaps if g >= 50]
    return {
        "wall_s": round(wall_s, 3),
        "kernels": len(spans),
        "kernel_busy_s": round(busy_us / 1e6, 3),
        "first_to_last_kernel_s": round(window_us / 1e6, 3),
        "gaps_over_50us": len(long_gaps),
        "gaps_over_50us_s": round(sum(long_gaps) / 1e6, 3),
        "largest_gaps_us": [round(g) for g in sorted(gaps, reverse=True)[:10]],
    }


DECODE_VARIANTS = ("default", "autotune", "grouped", "one-level-cdf", "no-overlap")


def apply_decode_variant(name: str) -> None:
    """Experiments on the compiled decode layer, for the profile (benchmarks/NOTES.md, section 9): `autotune`
    compiles it with inductor's max-autotune (Triton matmul templates with fused epilogues; no cudagraphs, the engine
    captures its own); `grouped` computes decode attention on CUDA with the grouped products the CPU uses (two batched
    products and a softmax) instead of SDPA; `one-level-cdf` samples with the sampler the engine had before section
    11: log-softmax written out, then one cumulative sum along each whole row of the vocabulary (not compiled);
    `no-overlap` has the engine read each chunk's tokens before it launches the next (`HFEngine(overlap=False)`,
    read by `benchmark`)."""
    from primerl.inference.engines import llama

    if name == "autotune":
        plain = torch.compile

        def compile_autotuned(function, **kwargs):
            return plain(function, **kwargs, mode="max-autotune-no-cudagraphs")

        torch.compile = compile_autotuned  # for this process: the decode layer is all it compiles
    elif name == "grouped":
        llama._sdpa_decode_attention = llama._decode_attention
    elif name == "one-level-cdf":
        llama.sample_unfiltered = sample_one_level
        llama._compiled_sampler = lambda function: function
    elif name not in ("default", "no-overlap"):
        raise ValueError(f"unknown decode variant {name!r}; one of {', '.join(DECODE_VARIANTS)}")


def sample_one_level(logits: torch.Tensor, temperature: torch.Tensor, uniform: torch.Tensor):
    """The engine's sampler before section 11 of benchmarks/NOTES.md, kept as that experiment's baseline."""
    logits = logits.float()
    greedy = temperature == 0
    logprobs = torch.log_softmax(logits / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
    cdf = logprobs.exp().cumsum(dim=-1)
    target = (uniform * cdf[:, -1].double()).float()[:, None]
    tokens = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logprobs.shape[-1] - 1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (best of 10 copies of 1 GiB)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return 2 * src.numel() / best


async def benchmark(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_init:
            model_dir, model_label = random_init_dir(args.arch, dtype, Path(tmp)), f"{args.arch} (random init)"
        else:
            model_dir, model_label = resolve_model(args.model), args.model
        engine = HFEngine(
            model_dir, device=str(device), dtype=args.dtype, max_batch_size=args.batch, cuda_graphs=args.cuda_graphs,
            compile=args.compile, overlap=False if args.decode_variant == "no-overlap" else None,
        )
        started = time.perf_counter()
        await engine.start()
        start_s = time.perf_counter() - started
        model = engine.model  # the same weights serve HF generate
        prompts = make_prompts(args.batch, model.config.vocab_size)
        total = args.batch * args.new_tokens
        def engine_side(steps: int):
            def run(tag: str):
                engine.decode_steps = steps  # read by the scheduler at every step; set between runs
                return engine_run(engine, prompts, args.new_tokens, tag)

            return run

        sides = {
            f"engine_tok_s_decode_steps_{k}" if len(args.decode_steps) > 1 else "engine_tok_s": engine_side(k)
            for k in args.decode_steps
        }
        sides["hf_generate_tok_s"] = lambda tag: asyncio.to_thread(generate_run, model, prompts, args.new_tokens)
        if args.generate_batch:
            sides["hf_generate_batch_tok_s"] = lambda tag: asyncio.to_thread(
                generate_batch_run, model, prompts, args.new_tokens
            )
        runs: dict[str, list[float]] = {name: [] for name in sides}
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for name, run in sides.items():
                seconds = await run(f"{name}-{round_}")
                if round_:
                    runs[name].append(total / seconds)
                print(f"round {round_} {name}: {total / seconds:.1f} tok/s", file=sys.stderr)
        busy = await device_busy(engine_side(args.decode_steps[0])) if args.device_busy else None
        await engine.stop()
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    result = {name: round(max(values), 1) for name, values in runs.items()}
    if len(args.decode_steps) > 1:  # the engine's figure is its default setting's
        result["engine_tok_s"] = result[f"engine_tok_s_decode_steps_{DEFAULT_DECODE_STEPS}"] if (
            DEFAULT_DECODE_STEPS in args.decode_steps) else max(result[f"engine_tok_s_decode_steps_{k}"]
                                                                 for k in args.decode_steps)
    result.update(
        ratio=round(result["engine_tok_s"] / result["hf_generate_tok_s"], 2),
        batch=args.batch,
        new_tokens=args.new_tokens,
        prompt_tokens=PROMPT_TOKENS,
        model=model_label,
        dtype=args.dtype,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        cuda_graphs=engine.cuda_graphs,
        compile=engine.compile,
        overlap=engine.overlap,
        chunks_ahead=engine.chunks_ahead,
        engine_start_s=round(start_s, 1),
        decode_steps=args.decode_steps,
        runs_tok_s={name: [round(v, 1) for v in values] for name, values in runs.items()},
        threads=torch.get_num_threads(),
    )
    if busy is not None:
        result["device_busy"] = busy
    if args.smoke:
        for part in ("device_busy", "copy_bandwidth_gb_s"):
            not_run(result, part, "needs a CUDA device (the CUDA profiler; a device-to-device copy)")
    if device.type == "cuda":
        bandwidth = copy_bandwidth(device)
        result["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
        result["weight_bytes"] = weight_bytes
        result["bandwidth_limit_tok_s"] = round(args.batch * bandwidth / weight_bytes, 1)
        result["engine_fraction_of_bandwidth_limit"] = round(result["engine_tok_s"] / result["bandwidth_limit_tok_s"], 4)
    return result


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or directory (real weights)")
    parser.add_argument("--random-init", action="store_true", help="random weights of --arch instead of --model")
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=64 if cuda else 16, help="concurrent requests")
    parser.add_argument("--new-tokens", type=int, default=128 if cuda else 48, help="sampled tokens per request")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each side, alternating")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="capture decode steps as CUDA graphs (default: on for CUDA)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the decode layer (inference.compile; default: the engine's, on for CUDA); "
        "engine_start_s includes the compile",
    )
    parser.add_argument("--decode-variant", choices=DECODE_VARIANTS, default="default",
                        help="an experiment on the compiled decode layer (see apply_decode_variant)")
    parser.add_argument("--generate-batch", action="store_true", help="also time transformers' generate_batch")
    parser.add_argument("--decode-steps", type=lambda v: [int(x) for x in v.split(",")], default=[DEFAULT_DECODE_STEPS],
                        help="the engine's decode_steps; a comma list times each (e.g. 1,8,16)")
    parser.add_argument("--device-busy", action="store_true",
                        help="one more engine run under the CUDA profiler: kernel time against wall time, idle gaps")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:  # both sides and transformers' generate_batch, on a random tiny Llama
        args.random_init, args.arch, args.dtype, args.device = True, "tiny", "float32", "cpu"
        args.batch, args.new_tokens, args.repeats, args.generate_batch = 2, 4, 1, True
    apply_decode_variant(args.decode_variant)
    result = asyncio.run(benchmark(args))
    result["decode_variant"] = args.decode_variant
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
