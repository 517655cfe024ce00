"""vLLM beside the embedded engine on one GPU: P3 decode throughput and a reverse-text `rl` run with each engine.

(a) P3: 64 concurrent requests x 128 sampled tokens (temperature 1, eos ignored) on Qwen3-0.6B's architecture with
    random weights (benchmarks/engine.py's `random_init_dir`), bfloat16; each engine in its own process (one warm-up
    run, then `--repeats` timed runs, the best reported). The embedded engine runs as P3 always does (seeded requests,
    its default decode steps); vLLM through primerl's adapter (`VLLMEngine`) with unseeded requests, its fast path.
(b) rl: `benchmarks/e2e_vs_trl.py --skip-trl` with `--engine hf` and `--engine vllm` on the same settings (SmolLM2's
    architecture with random weights from `--model-dir`, shared weight handoff): steps, rollouts/s and the trainer's
    `mismatch_kl` per step (inference log-probs against the trainer's for the same tokens).

    python3 benchmarks/vllm_h200.py --model-dir /tmp/primerl-smollm2-random --trl-script PEER --out OUT.json
    python3 benchmarks/vllm_h200.py --skip-rl ...        # P3 only (then --skip-p3 with the same --out adds the rl part)
    uv run python benchmarks/vllm_h200.py --smoke        # CPU: (a)'s embedded side on a random tiny Llama, 2 x 4

--smoke runs what the CPU can: (a)'s embedded-engine side through the same side process, on a random tiny Llama in
float32; it imports primerl's vLLM adapter (named under "not_run" with the reason where vLLM is missing) and builds
(b)'s two `e2e_vs_trl.py` command lines and parses them with that script's own parser (its `--smoke` runs the
embedded engine's rl on the CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from report import add_smoke_flag, emit, not_run  # benchmarks/report.py

HERE = Path(__file__).resolve().parent
PROMPTS_PER_STEP, GROUP, RL_NEW_TOKENS = 16, 8, 128  # (b): P1-GPU's sizes


def vllm_engine_parts(model_dir: Path):
    """vLLM's side of (a): primerl's adapter and the config sections it is built from."""
    from primerl.config.common import ModelConfig
    from primerl.config.inference import VLLMSection
    from primerl.inference.engines.vllm import VLLMEngine

    return VLLMEngine, ModelConfig(name=str(model_dir), dtype="bfloat16"), VLLMSection(gpu_memory_utilization=0.5)


async def p3_side(engine_kind: str, model_dir: Path, batch: int, new_tokens: int, repeats: int,
                  device: str = "cuda") -> dict:
    """Decode throughput of one engine in this process: tokens/s of each timed run."""
    import torch
    from engine import engine_run, make_prompts  # benchmarks/engine.py: P3's own harness

    if engine_kind == "hf":
        from primerl.inference.engines.hf import HFEngine

        engine = HFEngine(model_dir, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                          max_batch_size=batch)
        seed: int | None = 0
    else:
        VLLMEngine, model, options = vllm_engine_parts(model_dir)
        engine = VLLMEngine(model, "p3", max_model_len=1024, max_batch_size=batch, options=options)
        seed = None
    await engine.start()
    try:
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        prompts = make_prompts(batch, vocab)
        runs = []
        for round_ in range(repeats + 1):  # round 0 warms up (CUDA graphs, compilation)
            seconds = await engine_run(engine, prompts, new_tokens, f"{engine_kind}-{round_}", seed=seed)
            if round_:
                runs.append(batch * new_tokens / seconds)
            print(f"{engine_kind} round {round_}: {batch * new_tokens / seconds:.1f} tok/s", file=sys.stderr)
    finally:
        await engine.stop()
    result = {"tok_s": round(max(runs), 1), "runs_tok_s": [round(r, 1) for r in runs]}
    if engine_kind == "vllm":
        import vllm

        result["vllm"] = vllm.__version__
    result["torch"] = torch.__version__
    return result


def p3(args: argparse.Namespace) -> dict:
    """Both engines, each in a fresh process (vLLM and the embedded engine never hold the GPU together); --smoke:
    the embedded engine on the CPU."""
    sys.path.insert(0, str(HERE))
    import torch
    from engine import random_init_dir

    arch, dtype = ("tiny", torch.float32) if args.smoke else ("qwen3-0.6b", torch.bfloat16)
    result: dict = {"batch": args.batch, "new_tokens": args.new_tokens, "model": f"{arch} (random init)",
                    "dtype": str(dtype).removeprefix("torch.")}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_init_dir(arch, dtype, Path(tmp))
        for kind in ("hf",) if args.smoke else ("hf", "vllm"):
            command = [sys.executable, __file__, "--p3-side", kind, "--model-dir", str(model_dir),
                       "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                       *(["--smoke"] if args.smoke else [])]
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=args.side_timeout_s)
            sys.stderr.write(done.stderr[-4000:])
            result[kind] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                "error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    if "tok_s" in result["hf"] and "tok_s" in result.get("vllm", {}):
        result["vllm_over_embedded"] = round(result["vllm"]["tok_s"] / result["hf"]["tok_s"], 2)
    return result


def rl_command(args: argparse.Namespace, kind: str, out: Path) -> list[str]:
    """(b)'s run with engine `kind`: e2e_vs_trl.py, primerl's side alone."""
    return [sys.executable, str(HERE / "e2e_vs_trl.py"), "--trl-script", str(args.trl_script),
            "--skip-trl", "--engine", kind, "--model-dir", str(args.model_dir), "--bf16", "--rounds", "1",
            "--steps", str(args.steps), "--prompts-per-step", str(PROMPTS_PER_STEP), "--group", str(GROUP),
            "--new-tokens", str(RL_NEW_TOKENS),
            "--seq-len", "2048", "--max-batch-size", "128", "--weight-transfer", "shared",
            "--work-dir", f"/tmp/vllm-h200-rl-{kind}", "--out", str(out)]


def smoke_rl(args: argparse.Namespace) -> dict:
    """(b) without running it: each engine's command line, parsed by e2e_vs_trl.py's own parser."""
    from e2e_vs_trl import parse_args

    args.model_dir = args.model_dir or Path("model")
    commands = {kind: rl_command(args, kind, Path(f"rl_{kind}.json")) for kind in ("hf", "vllm")}
    parsed = {kind: vars(parse_args(command[2:])) for kind, command in commands.items()}
    return {kind: {"engine": p["engine"], "steps": p["steps"], "weight_transfer": p["weight_transfer"]}
            for kind, p in parsed.items()}


def rl(args: argparse.Namespace) -> dict:
    """The reverse-text run with each engine on the same settings, through e2e_vs_trl.py."""
    runs = {}
    for kind in ("hf", "vllm"):
        out = Path(tempfile.mkdtemp()) / f"rl_{kind}.json"
        command = rl_command(args, kind, out)
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=args.side_timeout_s)
        sys.stderr.write(done.stderr[-4000:])
        if done.returncode != 0 or not out.is_file():
            runs[kind] = {"error": f"exit {done.returncode}: {(done.stdout + done.stderr).strip()[-1500:]}"}
            continue
        primerl = json.loads(out.read_text())["rounds"][0]["primerl"]
        kl = [v for v in primerl.get("mismatch_kl", []) if v is not None]
        runs[kind] = {**primerl, "steps": args.steps, "mismatch_kl_mean": statistics.fmean(kl) if kl else None,
                      "weight_transfer": "shared", "rollouts_per_step": PROMPTS_PER_STEP * GROUP,
                      "new_tokens": RL_NEW_TOKENS}
    for key in ("rollouts_per_s", "steady_rollouts_per_s"):
        if all(runs[k].get(key) for k in ("hf", "vllm")):
            runs[f"vllm_over_embedded_{key}"] = round(runs["vllm"][key] / runs["hf"][key], 2)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="(b): the model directory both rl runs train")
    parser.add_argument("--trl-script", type=Path, default=HERE.parent / ".carry" / "peers" / "trl_grpo.py",
                        help="(b): the P1 peer harness, whose system prompt both runs use")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="(b): rl steps per engine")
    parser.add_argument("--skip-rl", action="store_true")
    parser.add_argument("--skip-p3", action="store_true")
    parser.add_argument("--side-timeout-s", type=float, default=280.0, help="limit of each engine's process")
    parser.add_argument("--p3-side", choices=["hf", "vllm"], help=argparse.SUPPRESS)  # one P3 side, in this process
    parser.add_argument("--out", type=Path, help="also write the JSON here (updating the parts this run measured)")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.new_tokens, args.repeats = 2, 4, 1
    if args.p3_side:
        sys.path.insert(0, str(HERE))
        print(json.dumps(asyncio.run(p3_side(args.p3_side, args.model_dir, args.batch, args.new_tokens,
                                             args.repeats, device="cpu" if args.smoke else "cuda"))))
        return 0
    if args.smoke:
        return smoke(args)
    if not args.skip_rl and args.model_dir is None:
        parser.error("--model-dir is needed for the rl runs (or --skip-rl)")
    import torch

    result: dict = json.loads(args.out.read_text()) if args.out and args.out.is_file() else {}  # parts run before
    result.update(device=torch.cuda.get_device_name(0))
    if not args.skip_p3:
        result["p3"] = p3(args)
    if not args.skip_rl:
        result["rl"] = rl(args)
    emit(result, args.out)
    return 0


def smoke(args: argparse.Namespace) -> int:
    """What the CPU can run of both parts (module docstring); the rest named under not_run."""
    result: dict = {"device": "cpu", "p3": p3(args), "rl_commands": smoke_rl(args)}
    try:
        vllm_engine_parts(Path("model"))
    except ImportError as e:
        not_run(result, "p3.vllm", f"primerl's vLLM adapter does not import here: {e}")
    else:
        installed = importlib.util.find_spec("vllm") is not None
        not_run(result, "p3.vllm", "vLLM needs a CUDA device" if installed else
                "vLLM is not installed (a GPU-only extra); primerl's adapter imports")
    not_run(result, "rl", "runs each engine's rl on a GPU; e2e_vs_trl.py --smoke runs the embedded engine's on the CPU")
    emit(result, args.out, smoke=True)
    return 0 if "tok_s" in result["p3"]["hf"] else 1


if __name__ == "__main__":
    sys.exit(main())
