"""Benchmark P1: primerl's `rl` against TRL's GRPOTrainer, end to end on the CPU, on the same work.

Both sides: SmolLM2-135M-Instruct (the same weight files), reverse-text phrases from primerl's environment with the
peer's system prompt, 16 rollouts per step (2 prompts x 8), 48 new tokens, temperature 1, lr 5e-6, 8 steps, the same
precision (float32, or bfloat16 with --bf16), no KL term. Runs alternate (primerl, TRL, primerl, TRL, ...) so drift of
the machine's speed falls on both. Throughput counts the rollouts trained on over the training time: for TRL the
peer's own clock (around `trainer.train()`, after model loading); for primerl from the moment the orchestrator starts
generating (inference healthy, models loaded) to the trainer's last step. Cold wall times (process start to exit)
are reported too.

    uv run python benchmarks/e2e_vs_trl.py --trl-script PEER/trl_grpo.py [--rounds 2] [--out results.json]

The peer runs in its own virtual environment (`--trl-venv`, default build/trl-venv), created on first use with
`uv venv` + `uv pip install` (or venv + pip when uv is absent): torch==2.13.0 trl datasets accelerate gguf.
Prints one JSON object: {"primerl_rollouts_per_s", "trl_rollouts_per_s", "ratio", "primerl_rewards",
"trl_rewards", "rounds": [...], "config": {...}}.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[1]
TRL_PACKAGES = ["torch==2.13.0", "trl", "datasets", "accelerate", "gguf"]
PROMPTS, GROUP, NEW_TOKENS, LR = 2, 8, 48, 5e-6


def peer_system_prompt(script: Path) -> str:
    """The peer's SYSTEM constant, read from its source (so both sides send the very same system prompt)."""
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SYSTEM" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit(f"{script} defines no SYSTEM prompt")


def ensure_trl_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if python.exists():
        return python
    print(f"creating {venv} for the peer", file=sys.stderr)
    if shutil.which("uv"):
        subprocess.run(["uv", "venv", "-q", "--python", f"{sys.version_info.major}.{sys.version_info.minor}",
                        str(venv)], check=True)
        subprocess.run(["uv", "pip", "install", "-q", "--python", str(python), *TRL_PACKAGES], check=True)
    else:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *TRL_PACKAGES], check=True)
    return python


def write_prompts(work: Path, system_prompt: str) -> tuple[Path, Path]:
    """The reverse-text environment's phrases (default split) as the peer's --prompts file, and the system prompt as
    the file the environment's `system_prompt` option reads."""
    import reverse_text

    from primerl.orchestrator.envkit import read_pinned

    words = read_pinned("reverse_text", "data/words.txt", reverse_text.WORDS_SHA256).decode().split()
    c = reverse_text.ReverseTextConfig()
    phrases = reverse_text.generate_phrases(words, c.seed, c.num_examples, c.min_words, c.max_words)
    rows = work / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"text": p}) + "\n" for p in phrases))
    system = work / "system_prompt.txt"
    system.write_text(system_prompt)
    return rows, system


def primerl_config(model_dir: Path, system_prompt_file: Path, steps: int, bf16: bool) -> dict:
    return {
        "model": {"name": str(model_dir), "dtype": "bfloat16" if bf16 else "float32"},
        "max_steps": steps,
        "max_async_steps": 1,
        "seq_len": 512,
        "orchestrator": {
            "env": {"id": "reverse-text", "args": {"system_prompt": str(system_prompt_file)}},
            "batch": {"tasks_per_step": PROMPTS, "group_size": GROUP},
            "sampling": {"temperature": 1.0, "max_tokens": NEW_TOKENS},
            "advantage": {"drop_zero_advantage": False},  # train on every rollout, as the peer does
        },
        "trainer": {
            "optim": {"lr": LR},
            "ckpt": {"save_at_end": False},  # the peer saves nothing either
        },
    }


def run_primerl(config: Path, run_dir: Path, steps: int) -> dict:
    from primerl.monitor import read_metrics

    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "primerl.cli", "rl", "@", str(config), f"--output_dir={run_dir}"],
                            check=False, capture_output=True, text=True, cwd=REPO)
    wall = time.time() - started
    if result.returncode != 0:
        raise SystemExit(f"primerl rl failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    batches = sorted(read_metrics(run_dir, "orchestrator"), key=lambda r: r["step"])
    trained = sorted(read_metrics(run_dir, "trainer"), key=lambda r: r["step"])
    generation_started = batches[0]["time"] - batches[0]["step_s"]
    seconds = trained[-1]["time"] - generation_started
    return {
        "seconds": round(seconds, 2),
        "wall_s": round(wall, 2),
        "rollouts_per_s": round(PROMPTS * GROUP * steps / seconds, 4),
        "rewards": [round(r["reward_mean"], 4) for r in batches],
    }


def run_trl(python: Path, script: Path, model_dir: Path, prompts: Path, steps: int, bf16: bool) -> dict:
    command = [str(python), str(script), "--model-dir", str(model_dir), "--prompts", str(prompts),
               "--steps", str(steps), "--rollouts", str(PROMPTS * GROUP), "--group", str(GROUP),
               "--max-new-tokens", str(NEW_TOKENS), "--lr", str(LR), *(["--bf16"] if bf16 else [])]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    started = time.time()
    result = subprocess.run(command, check=False, capture_output=True, text=True, env=env)
    wall = time.time() - started
    if result.returncode != 0:
        raise SystemExit(f"the TRL peer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    return {
        "seconds": summary["seconds"],
        "wall_s": round(wall, 2),
        "rollouts_per_s": summary["rollouts_per_s"],
        "rewards": summary["rewards"],
    }


def summarize(rounds: list[dict], model: str, steps: int, bf16: bool) -> dict:
    """The benchmark's JSON: median rollouts/s of each side over the rounds, their ratio, the last round's rewards."""
    ours_rate = statistics.median(r["primerl"]["rollouts_per_s"] for r in rounds)
    peer_rate = statistics.median(r["trl"]["rollouts_per_s"] for r in rounds)
    return {
        "benchmark": "P1 e2e RL on CPU vs TRL GRPOTrainer",
        "primerl_rollouts_per_s": ours_rate,
        "trl_rollouts_per_s": peer_rate,
        "ratio": round(ours_rate / peer_rate, 3),
        "primerl_rewards": rounds[-1]["primerl"]["rewards"],
        "trl_rewards": rounds[-1]["trl"]["rewards"],
        "rounds": rounds,
        "config": {"model": model, "steps": steps, "prompts_per_step": PROMPTS, "rollouts_per_prompt": GROUP,
                   "max_new_tokens": NEW_TOKENS, "lr": LR, "precision": "bfloat16" if bf16 else "float32",
                   "primerl_max_async_steps": 1},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_1m": round(os.getloadavg()[0], 2)},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-script", type=Path, required=True, help="the peer harness trl_grpo.py")
    parser.add_argument("--trl-venv", type=Path, default=REPO / "build" / "trl-venv")
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench-p1")
    parser.add_argument("--rounds", type=int, default=2, help="primerl/TRL pairs, alternating")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 on both sides (default float32)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name (tiny checks the plumbing)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)

    from primerl.models import resolve_model

    model_dir = resolve_model(args.model)
    python = ensure_trl_venv(args.trl_venv)
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    prompts, system_file = write_prompts(work, peer_system_prompt(args.trl_script))
    config = work / "primerl.toml"
    config.write_text(tomli_w.dumps(primerl_config(model_dir, system_file, args.steps, args.bf16)))

    rounds = []
    for i in range(args.rounds):
        ours = run_primerl(config, work / f"primerl-{i}", args.steps)
        print(f"round {i}: primerl {json.dumps(ours)}", file=sys.stderr, flush=True)
        peer = run_trl(python, args.trl_script, model_dir, prompts, args.steps, args.bf16)
        print(f"round {i}: trl {json.dumps(peer)}", file=sys.stderr, flush=True)
        rounds.append({"primerl": ours, "trl": peer})
        result = summarize(rounds, args.model, args.steps, args.bf16)
        if args.out:  # after every round, so an interrupted benchmark keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
