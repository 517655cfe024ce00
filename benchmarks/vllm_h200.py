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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from report import emit  # benchmarks/report.py

HERE = Path(__file__).resolve().parent
PROMPTS_PER_STEP, GROUP, RL_NEW_TOKENS = 16, 8, 128  # (b): P1-GPU's sizes


async def p3_side(engine_kind: str, model_dir: Path, batch: int, new_tokens: int, repeats: int) -> dict:
    """Decode throughput of one engine in this process: tokens/s of each timed run."""
    import torch
    from engine import engine_run, make_prompts  # benchmarks/engine.py: P3's own harness

    from primerl.config.common import ModelConfig
    from primerl.config.inference import VLLMSection

    if engine_kind == "hf":
        from primerl.inference.engines.hf import HFEngine

        engine = HFEngine(model_dir, device="cuda", dtype="bfloat16", max_batch_size=batch)
        seed: int | None = 0
    else:
        from primerl.inference.engines.vllm import VLLMEngine

        engine = VLLMEngine(ModelConfig(name=str(model_dir), dtype="bfloat16"), "p3", max_model_len=1024,
                            max_batch_size=batch, options=VLLMSection(gpu_memory_utilization=0.5))
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
    """Both engines, each in a fresh process (vLLM and the embedded engine never hold the GPU together)."""
    sys.path.insert(0, str(HERE))
    import torch
    from engine import random_init_dir

    result: dict = {"batch": args.batch, "new_tokens": args.new_tokens, "model": "qwen3-0.6b (random init)",
                    "dtype": "bfloat16"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_init_dir("qwen3-0.6b", torch.bfloat16, Path(tmp))
        for kind in ("hf", "vllm"):
            command = [sys.executable, __file__, "--p3-side", kind, "--model-dir", str(model_dir),
                       "--batch", str(args.batch), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
            done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=args.side_timeout_s)
            sys.stderr.write(done.stderr[-4000:])
            result[kind] = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 else {
                "error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
    if "tok_s" in result["hf"] and "tok_s" in result["vllm"]:
        result["vllm_over_embedded"] = round(result["vllm"]["tok_s"] / result["hf"]["tok_s"], 2)
    return result


def rl(args: argparse.Namespace) -> dict:
    """The reverse-text run with each engine on the same settings, through e2e_vs_trl.py."""
    runs = {}
    for kind in ("hf", "vllm"):
        out = Path(tempfile.mkdtemp()) / f"rl_{kind}.json"
        command = [sys.executable, str(HERE / "e2e_vs_trl.py"), "--trl-script", str(args.trl_script),
                   "--skip-trl", "--engine", kind, "--model-dir", str(args.model_dir), "--bf16", "--rounds", "1",
                   "--steps", str(args.steps), "--prompts-per-step", str(PROMPTS_PER_STEP), "--group", str(GROUP),
                   "--new-tokens", str(RL_NEW_TOKENS),
                   "--seq-len", "2048", "--max-batch-size", "128", "--weight-transfer", "shared",
                   "--work-dir", f"/tmp/vllm-h200-rl-{kind}", "--out", str(out)]
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
    args = parser.parse_args(argv)
    if args.p3_side:
        sys.path.insert(0, str(HERE))
        print(json.dumps(asyncio.run(p3_side(args.p3_side, args.model_dir, args.batch, args.new_tokens,
                                             args.repeats))))
        return 0
    if not args.skip_rl and args.model_dir is None:
        parser.error("--model-dir is needed for the rl runs (or --skip-rl)")
    import torch

    result: dict = json.loads(args.out.read_text()) if args.out and args.out.is_file() else {}  # parts run before
    result.update(device=torch.cuda.get_device_name(0), commit=os.environ.get("PRIMERL_COMMIT"))
    if not args.skip_p3:
        result["p3"] = p3(args)
    if not args.skip_rl:
        result["rl"] = rl(args)
    emit(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
