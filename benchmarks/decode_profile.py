"""Where a decode step's time goes: kernels launched and device time per step of the fast decoder, eager against
compiled (benchmarks/NOTES.md, section 4). Random weights of an architecture `benchmarks/engine.py` knows; batch
rows decoding one token each at a 256-position span, no CUDA graph (so each kernel is seen), then the same step
captured and replayed (the engine's path).

    python benchmarks/decode_profile.py --arch smollm2-135m --rows 64 --out FILE
    python benchmarks/decode_profile.py --smoke     # CPU, random tiny Llama: the eager step's and the sampler's ops

On the CPU (--smoke) the profile counts the CPU operators of the same decode step and sampler; the CUDA graphs and
the compiled layer need a GPU and are named under "not_run".
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import ARCHITECTURES, DECODE_VARIANTS, apply_decode_variant, random_init_dir, synchronize
from report import add_smoke_flag, emit, not_run

from primerl.inference.engines.llama import LlamaDecoder


def measure(model, rows: int, compile: bool, steps: int) -> dict:
    """The step's kernels and device time; on CUDA also its graph's replay time, with and without sampling."""
    cuda = model.device.type == "cuda"
    started = time.perf_counter()
    decoder = LlamaDecoder(model, rows, 512, cuda_graphs=cuda, compile=compile)
    decoder.warm_up()
    tokens, positions = [1] * rows, [100] * rows
    span = decoder._span(101)
    if cuda:
        static = decoder.static_tokens[:rows], decoder.static_positions[:rows]
        decoder._load_static_inputs(tokens, positions)
    else:
        static = torch.tensor(tokens), torch.tensor(positions)
    for _ in range(3):  # warm: compiles for this shape, autotunes
        decoder._decode_forward(*static, span)
    synchronize(model.device)
    setup_s = time.perf_counter() - started
    kernels, top = kernel_profile(lambda: decoder._decode_forward(*static, span), steps, model.device)
    result = {
        "kernels_per_step": kernels / steps,
        "kernel_time_us_per_step": round(sum(top.values()), 1),
        "setup_s": round(setup_s, 1),
        "top_kernels_us": {k: round(v, 1) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]},
    }
    # the sampling alone, kernel by kernel, on this step's logits
    logits = decoder._decode_forward(*static, span)
    temperature = torch.full((rows,), 0.8, device=logits.device)
    uniform = torch.rand(rows, dtype=torch.float64, device=logits.device)
    decoder._sample(logits, temperature, uniform)  # the engine's sampler (compiled with the layer), warm
    synchronize(model.device)
    sampling_kernels, sampling_top = kernel_profile(lambda: decoder._sample(logits, temperature, uniform), steps,
                                                    model.device)
    result.update(
        sampling_kernels_per_step=sampling_kernels / steps,
        sampling_kernel_time_us_per_step=round(sum(sampling_top.values()), 1),
        top_sampling_kernels_us={k: round(v, 1) for k, v in sorted(sampling_top.items(), key=lambda kv: -kv[1])[:8]},
    )
    if cuda:
        result.update(graph_replays(decoder, tokens, positions, span, steps, rows))
    return result


def graph_replays(decoder: LlamaDecoder, tokens: list[int], positions: list[int], span: int, steps: int,
                  rows: int) -> dict:
    """Device time per replay of the step's CUDA graph, and of the engine's graph (the step with sampling)."""
    decoder.decode(tokens, positions)  # captures the graph of this shape
    graph = decoder.graphs[(decoder._load_static_inputs(tokens, positions), span)]
    replay_us = replay_time_us(graph, steps)
    # the engine's graph: the same step with sampling over the vocabulary, the token fed back
    decoder.static_temperature[:rows].fill_(0.8)
    decoder.static_uniform[:rows].fill_(0.5)
    sampling_graph = decoder._capture(rows, span, sampling=True)
    sampling_replay_us = replay_time_us(sampling_graph, steps, before=lambda: decoder._load_static_inputs(tokens, positions))
    return {
        "graph_replay_us_per_step": round(replay_us, 1),
        "tokens_per_s_graph": round(rows / (replay_us / 1e6), 1),
        "sampling_graph_replay_us_per_step": round(sampling_replay_us, 1),
    }


def kernel_profile(call, steps: int, device: torch.device) -> tuple[int, dict[str, float]]:
    """`call()` `steps` times under the profiler, no graph: the kernels launched, and each kernel's device time per
    call (us), by name. On the CPU: its operators and their CPU time (nested ones counted too)."""
    activity, kind = ((ProfilerActivity.CUDA, torch.autograd.DeviceType.CUDA) if device.type == "cuda" else
                      (ProfilerActivity.CPU, torch.autograd.DeviceType.CPU))
    with profile(activities=[activity]) as prof:
        for _ in range(steps):
            call()
        synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == kind]
    per_name: dict[str, float] = {}
    for e in kernels:
        per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us() / steps
    return len(kernels), per_name


def replay_time_us(graph: torch.cuda.CUDAGraph, steps: int, before=None) -> float:
    """Device time per replay of `graph`, `steps` replays in a row (`before` runs first, outside the timing)."""
    if before is not None:
        before()
    graph.replay()  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variant", choices=DECODE_VARIANTS, default="default",
                        help="default: eager, then compiled; else only the compiled layer with this experiment "
                        "(benchmarks/engine.py apply_decode_variant)")
    parser.add_argument("--out", type=Path)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.arch, args.rows, args.steps = "tiny", 2, 2
    elif not torch.cuda.is_available():
        print("decode_profile: needs a CUDA device (--smoke runs the CPU check)", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM

    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        path = random_init_dir(args.arch, dtype, Path(tmp))
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    result = {"arch": args.arch, "rows": args.rows, "span": 256}
    with torch.inference_mode():
        if args.smoke:  # the eager step and sampler on the CPU; graphs and compilation need the GPU
            apply_decode_variant(args.variant)
            result["eager"] = measure(model, args.rows, False, args.steps)
            not_run(result, "graph_replay", "CUDA graphs need a CUDA device")
            not_run(result, "compiled", "the compiled decode layer is profiled on a CUDA device only")
        elif args.variant == "default":
            for compile in (False, True):
                result["compiled" if compile else "eager"] = measure(model, args.rows, compile, args.steps)
        else:
            apply_decode_variant(args.variant)
            result[f"compiled_{args.variant}"] = measure(model, args.rows, True, args.steps)
    emit(result, args.out, smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
