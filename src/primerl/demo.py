"""The reverse-text demo on the CPU: SFT warm-up on generated reversal pairs, then RL, then the reward plot.

    python -m primerl.demo [--output-dir runs/reverse-text] [--results demo.json] [--sft-steps 16] [--rl-steps 16]

Stage 1 writes reversal conversations (phrases from the reverse-text environment's pinned word list, drawn with a
different seed than its RL tasks) and fine-tunes SmolLM2-135M-Instruct on them (`configs/reverse-text/sft.toml`).
Stage 2 runs `rl` from those weights (`configs/reverse-text/rl.toml`). At the end it writes the run's plots and a
summary — reward at the first and last RL step, steps, seconds — printed as JSON and written to `--results`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from primerl.config import load
from primerl.config.rl import RLConfig

SFT_DATA_SEED = 1  # the RL tasks are the environment's seed-0 split
SFT_CONVERSATIONS = 512


def reverse_text_conversations(count: int, seed: int) -> list[list[dict[str, str]]]:
    """`count` reversal conversations [system, user, assistant]: phrases drawn with `seed` from the reverse-text
    environment's pinned word list under its default lengths, each answered with the phrase reversed letter by
    letter (the environment's default task and instruction)."""
    import reverse_text

    from primerl.orchestrator.envkit import read_pinned

    words = read_pinned("reverse_text", "data/words.txt", reverse_text.WORDS_SHA256).decode().split()
    defaults = reverse_text.ReverseTextConfig()
    phrases = reverse_text.generate_phrases(words, seed, count, defaults.min_words, defaults.max_words)
    return [
        [
            {"role": "system", "content": reverse_text.SYSTEM_PROMPT},
            {"role": "user", "content": phrase},
            {"role": "assistant", "content": reverse_text.reversed_text(phrase)},
        ]
        for phrase in phrases
    ]


def write_sft_data(path: Path, count: int = SFT_CONVERSATIONS, seed: int = SFT_DATA_SEED) -> Path:
    """Reversal conversations in the format `primerl sft` reads: {"messages": [system, user, assistant]} per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for messages in reverse_text_conversations(count, seed):
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def run_sft(config: Path, run_dir: Path, data: Path, steps: int) -> Path:
    """Stage 1; returns the directory of the fine-tuned weights."""
    command = [sys.executable, "-m", "primerl.cli", "sft", "@", str(config), f"--run_dir={run_dir}",
               f"--data.path={data}", f"--train.max_steps={steps}"]
    subprocess.run(command, check=True)
    weights = run_dir / "weights" / f"step_{steps}"
    if not (weights / "STABLE").is_file():
        raise RuntimeError(f"SFT finished without publishing {weights}")
    return weights


def summarize(rl_dir: Path) -> dict:
    from primerl.monitor import read_metrics

    rewards = [r["reward_mean"] for r in sorted(read_metrics(rl_dir, "orchestrator"), key=lambda r: r["step"])]
    if not rewards:
        raise RuntimeError(f"no orchestrator metrics in {rl_dir}")
    window = max(1, min(3, len(rewards) // 3))
    return {
        "steps": len(rewards),
        "first_step_reward": round(rewards[0], 4),
        "last_step_reward": round(rewards[-1], 4),
        f"first_{window}_steps_reward": round(statistics.fmean(rewards[:window]), 4),
        f"last_{window}_steps_reward": round(statistics.fmean(rewards[-window:]), 4),
        "rewards": [round(r, 4) for r in rewards],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m primerl.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/reverse-text"))
    parser.add_argument("--configs", type=Path, default=Path("configs/reverse-text"), help="sft.toml and rl.toml")
    parser.add_argument("--sft-steps", type=int, default=16)
    parser.add_argument("--rl-steps", type=int, default=16)
    parser.add_argument("--results", type=Path, help="also write the summary JSON here")
    parser.add_argument("--plot", type=Path, help="also copy the reward plot here")
    args = parser.parse_args(argv)

    from primerl.launch.local import run_rl
    from primerl.monitor import plot_run

    out = args.output_dir.resolve()
    started = time.time()
    data = write_sft_data(out / "sft_data.jsonl")
    weights = run_sft(args.configs / "sft.toml", out / "sft", data, args.sft_steps)
    sft_seconds = time.time() - started

    cfg, _ = load(RLConfig, ["@", str(args.configs / "rl.toml"), f"--output_dir={out / 'rl'}",
                             f"--model.name={weights}", f"--max_steps={args.rl_steps}"])
    rl_started = time.time()
    code = run_rl(cfg)
    if code != 0:
        return code
    summary = {
        "demo": "reverse-text",
        "model": "smollm2-135m-instruct",
        "device": "cpu",
        "sft_steps": args.sft_steps,
        "rl_steps": cfg.max_steps,
        "rollouts_per_step": cfg.orchestrator.batch.tasks_per_step * cfg.orchestrator.batch.group_size,
        **summarize(out / "rl"),
        "sft_seconds": round(sft_seconds, 1),
        "rl_seconds": round(time.time() - rl_started, 1),
        "seconds": round(time.time() - started, 1),
    }
    plots = plot_run(out / "rl")
    print(json.dumps(summary))
    if args.results:
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(summary, indent=1) + "\n")
    reward_plot = next((p for p in plots if p.name == "reward.png"), None)
    if args.plot and reward_plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(reward_plot, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
