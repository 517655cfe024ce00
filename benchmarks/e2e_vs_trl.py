"""Benchmark P1: primerl's `rl` against TRL's GRPOTrainer, end to end on the CPU, on the same work.

Both sides: SmolLM2-135M-Instruct (the same weight files), reverse-text phrases from primerl's environment with the
peer's system prompt, 16 rollouts per step (2 prompts x 8), 48 new tokens, temperature 1, lr 5e-6, 8 steps, the same
precision (float32, or bfloat16 with --bf16), no KL term. Runs alternate (primerl, TRL, primerl, TRL, ...) so drift of
the machine's speed falls on both. Throughput counts the rollouts trained on over the training time: for TRL the
peer's own clock (around `trainer.train()`, after model loading); for primerl from the moment the orchestrator starts
generating (inference healthy, models loaded) to the trainer's last step. The two clocks differ (TRL's covers all of
`train()`, primerl's starts after its processes are up), so cold wall times are reported beside them on both sides,
process start to exit (for primerl the whole `rl` command), with `cold_rollouts_per_s` and `cold_ratio`. The result
names primerl's backward dtype (`train.backward_dtype`, the setting and what the trainer resolved it to: `auto` is
bfloat16 for a float32 model on a CPU with bfloat16 dot products; `--backward-dtype float32` makes it float32) and
the package versions each side ran with (transformers, torch, trl, accelerate, vllm).

    uv run python benchmarks/e2e_vs_trl.py --trl-script PEER/trl_grpo.py [--rounds 2] [--out results.json]

On a GPU (P1-GPU: 16 prompts x 8, 128 new tokens, bf16, inference and trainer sharing the GPU, weights handed over
through the shared buffer) where there is no uv, name the peer's interpreter and the sizes:

    python3 benchmarks/e2e_vs_trl.py --trl-script peers/trl_grpo.py --trl-python python3 --model-dir DIR --bf16 \
        --prompts-per-step 16 --group 8 --new-tokens 128 --steps 10 --max-batch-size 128 --weight-transfer shared

Steady throughput leaves the first step out on both sides (compilation, graph capture, warm-up): for primerl from
its first trained step to its last, for TRL from its first logged step to its last. Lost rollouts are the rollouts
primerl's orchestrator saw fail (the `errors` of every step).

`--trl-vllm-colocate` runs the stronger GPU peer: TRL generating through vLLM inside its own process on the same GPU
(the peer's `--vllm-colocate`; `--trl-vllm-memory` is vLLM's share of the GPU memory, default 0.3, `--trl-vllm-sleep`
its sleep mode between generations); the setting used is written into the result (`config.trl_generation`). The peer
then runs as one torch.distributed rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as torchrun would).

`--smoke`: primerl's side alone on the tiny model (one round of 2 steps, 1 prompt x 2 rollouts, 4 new tokens); the
peer needs its own virtual environment with TRL, which a smoke run does not build (named under "not_run").

The peer runs in its own virtual environment (`--trl-venv`, default build/trl-venv), created on first use with
`uv venv` + `uv pip install` (or venv + pip when uv is absent): torch==2.13.0 trl datasets accelerate gguf.
Prints one JSON object: {"primerl_rollouts_per_s", "trl_rollouts_per_s", "ratio", "primerl_rewards",
"trl_rewards", "rounds": [...], "config": {...}}.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import tomli_w
from report import add_smoke_flag, emit, not_run
from sides import package_versions

REPO = Path(__file__).resolve().parents[1]
TRL_PACKAGES = ["torch==2.13.0", "trl", "datasets", "accelerate", "gguf"]
VERSIONS = ["transformers", "torch", "trl", "accelerate", "vllm"]  # recorded for each side
PROMPTS, GROUP, NEW_TOKENS, LR = 2, 8, 48, 5e-6  # P1 on the CPU; the GPU variant sets its sizes on the command line
SMOKE_SYSTEM_PROMPT = "Reverse the text you are given, character by character."  # no peer script in a smoke run


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


def primerl_config(model_dir: Path, system_prompt_file: Path, args: argparse.Namespace) -> dict:
    threads = {}
    if args.threads:  # engine,trainer CPU threads instead of `rl`'s split of the cores
        engine_threads, trainer_threads = (int(x) for x in args.threads.split(","))
        threads = {"inference": {"threads": engine_threads}, "trainer": {"train": {"threads": trainer_threads}}}
    return {
        "model": {"name": str(model_dir), "dtype": "bfloat16" if args.bf16 else "float32"},
        "max_steps": args.steps,
        "max_async_steps": 1,
        "seq_len": args.seq_len,
        "weight_transfer": args.weight_transfer,
        "inference": {
            "max_batch_size": args.max_batch_size, "engine": args.engine, **threads.get("inference", {}),
            **({} if args.engine_compile is None else {"compile": args.engine_compile}),
            **({} if args.decode_steps is None else {"decode_steps": args.decode_steps}),
            **({} if args.engine_overlap is None else {"overlap": args.engine_overlap}),
        },
        "orchestrator": {
            "env": {"id": "reverse-text", "args": {"system_prompt": str(system_prompt_file)}},
            "batch": {"tasks_per_step": args.prompts_per_step, "group_size": args.group},
            "sampling": {"temperature": 1.0, "max_tokens": args.new_tokens},
            "advantage": {"drop_zero_advantage": False},  # train on every rollout, as the peer does
        },
        "trainer": {
            "optim": {"lr": args.lr},
            **threads.get("trainer", {}),
            **({} if args.backward_dtype is None and args.micro_batch_rows is None else {"train": {
                **threads.get("trainer", {}).get("train", {}),
                **({} if args.backward_dtype is None else {"backward_dtype": args.backward_dtype}),
                **({} if args.micro_batch_rows is None else {"micro_batch_rows": args.micro_batch_rows})}}),
            "ckpt": {"save_at_end": False},  # the peer saves nothing either
        },
    }


def _steady_rate(times: list[float], rollouts_per_step: int) -> float | None:
    """Rollouts per second between the first and the last of `times` (one per step, first step excluded)."""
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return round(rollouts_per_step * (len(times) - 1) / (times[-1] - times[0]), 4)


def rl_command(config: Path, run_dir: Path, overrides: list[str] | None = None) -> list[str]:
    """`rl @ config` into `run_dir`, with each `KEY=VALUE` of `overrides` as `--KEY=VALUE` (rl's own flags)."""
    return [sys.executable, "-m", "primerl.cli", "rl", "@", str(config), f"--output_dir={run_dir}",
            *(f"--{item}" for item in overrides or [])]


def primerl_override(item: str) -> str:
    """argparse type of `--primerl-set`: KEY=VALUE with a dotted key (one of rl's flags without its dashes)."""
    key, sep, _ = item.partition("=")
    if not sep or not key or key.startswith("-") or " " in key:
        raise argparse.ArgumentTypeError(f"{item!r}: expected KEY=VALUE, e.g. trainer.train.compile=true")
    return item


def run_primerl(config: Path, run_dir: Path, args: argparse.Namespace) -> dict:
    from primerl.monitor import read_metrics

    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.time()
    try:
        result = subprocess.run(rl_command(config, run_dir, args.primerl_set), check=False, capture_output=True,
                                text=True, cwd=REPO, timeout=args.side_timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"primerl rl did not finish within {args.side_timeout_s:.0f} s") from None
    wall = time.time() - started
    if result.returncode != 0:
        raise SystemExit(f"primerl rl failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    batches = sorted(read_metrics(run_dir, "orchestrator"), key=lambda r: r["step"])
    trained = sorted(read_metrics(run_dir, "trainer"), key=lambda r: r["step"])
    generation_started = batches[0]["time"] - batches[0]["step_s"]
    seconds = trained[-1]["time"] - generation_started
    per_step = args.prompts_per_step * args.group
    return {
        "seconds": round(seconds, 2),
        "wall_s": round(wall, 2),
        "clock": "from the first generation to the trainer's last step",
        "launch_to_first_step_s": round(trained[0]["time"] - started, 2),  # `rl` started -> the trainer's step 1
        "rollouts_per_s": round(per_step * args.steps / seconds, 4),
        "cold_rollouts_per_s": round(per_step * args.steps / wall, 4),
        "backward_dtype": backward_dtype(run_dir, args),
        "steady_rollouts_per_s": _steady_rate([r["time"] for r in trained], per_step),
        "steady_s_per_step": round(statistics.median(b["time"] - a["time"] for a, b in itertools.pairwise(trained)), 3)
        if len(trained) > 1 else None,
        "lost_rollouts": sum(r.get("errors") or 0 for r in batches),
        "completion_tokens": round(sum((r.get("completion_len_mean") or 0) * per_step for r in batches)),
        "rewards": [round(r["reward_mean"], 4) for r in batches],
        "mismatch_kl": [r.get("mismatch_kl") for r in trained],
        "trainer_step_s": [round(r.get("step_s") or 0, 3) for r in trained],
        "trainer_forward_backward_s": [round(r.get("forward_backward_s") or 0, 3) for r in trained],
        "trainer_wait_s": [round(r.get("wait_s") or 0, 3) for r in trained],
        "orchestrator_step_s": [round(r.get("step_s") or 0, 3) for r in batches],
        "weight_handoff_s": [r.get("weights_shared_s") or r.get("weights_broadcast_s") or r.get("weights_export_s")
                             for r in trained],
    }


def backward_dtype(run_dir: Path, args: argparse.Namespace) -> dict:
    """primerl's `train.backward_dtype`: the setting, and the dtype the trainer resolved it to (its start-up log)."""
    log = run_dir / "logs" / "trainer.log"
    match = re.search(r"compute (\w+) \(backward (\w+)\)", log.read_text()) if log.is_file() else None
    return {"setting": args.backward_dtype or "auto", "compute": match[1] if match else None,
            "backward": match[2] if match else None}


def primerl_versions() -> dict:
    """The versions primerl's processes import (this interpreter, this environment)."""
    return package_versions(sys.executable, VERSIONS)


def trl_env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    if args.trl_pythonpath is not None:
        env["PYTHONPATH"] = args.trl_pythonpath
    else:
        env.pop("PYTHONPATH", None)
    if args.trl_vllm_colocate:  # vLLM's external launcher reads torch.distributed's variables: one rank, as torchrun
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    return env


def trl_generation(args: argparse.Namespace) -> dict:
    """How the peer generates, as written into the result."""
    if not args.trl_vllm_colocate:
        return {"mode": "generate"}
    return {"mode": "vllm-colocate", "vllm_gpu_memory_utilization": args.trl_vllm_memory,
            "vllm_sleep": args.trl_vllm_sleep}


def run_trl(python: Path, script: Path, model_dir: Path, prompts: Path, args: argparse.Namespace) -> dict:
    accumulate = ([str(REPO / "benchmarks" / "trl_accumulate.py"), "--micro-batch", str(args.trl_micro_batch)]
                  if args.trl_micro_batch else [])  # each step's rollouts in micro-batches (benchmarks/trl_accumulate.py)
    command = [str(python), *accumulate, str(script), "--model-dir", str(model_dir), "--prompts", str(prompts),
               "--steps", str(args.steps), "--rollouts", str(args.prompts_per_step * args.group),
               "--group", str(args.group), "--max-new-tokens", str(args.new_tokens), "--lr", str(args.lr),
               *(["--bf16"] if args.bf16 else []),
               *(["--vllm-colocate", "--vllm-gpu-memory-utilization", str(args.trl_vllm_memory)]
                 if args.trl_vllm_colocate else []),
               *(["--vllm-sleep"] if args.trl_vllm_colocate and args.trl_vllm_sleep else [])]
    env = trl_env(args)
    started = time.time()
    try:
        result = subprocess.run(command, check=False, capture_output=True, text=True, env=env,
                                timeout=args.side_timeout_s)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"the TRL peer did not finish within {args.side_timeout_s:.0f} s") from None
    wall = time.time() - started
    if result.returncode != 0:
        raise SystemExit(f"the TRL peer failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    steps = [json.loads(line) for line in result.stdout.replace("\r", "\n").splitlines()
             if line.startswith('{"step"')]
    return {
        "seconds": summary["seconds"],
        "wall_s": round(wall, 2),
        "clock": "trainer.train()",
        "generation": trl_generation(args),
        **({"micro_batch": next(json.loads(line) for line in result.stdout.splitlines()
                                if line.startswith('{"trl_micro_batch"'))} if args.trl_micro_batch else {}),
        "rollouts_per_s": summary["rollouts_per_s"],
        "cold_rollouts_per_s": round(args.prompts_per_step * args.group * args.steps / wall, 4),
        "steady_rollouts_per_s": _steady_rate([s["t"] for s in steps], args.prompts_per_step * args.group),
        "rewards": summary["rewards"],
    }


def summarize(rounds: list[dict], model: str, args: argparse.Namespace) -> dict:
    """The benchmark's JSON: median rollouts/s of each side over the rounds (steady: first step excluded), their
    ratios, lost rollouts, the last round's rewards."""
    def median(side: str, key: str) -> float | None:
        values = [r[side][key] for r in rounds if r.get(side) and r[side].get(key) is not None]
        return statistics.median(values) if values else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    ours, ours_steady = median("primerl", "rollouts_per_s"), median("primerl", "steady_rollouts_per_s")
    ours_cold, peer_cold = median("primerl", "cold_rollouts_per_s"), median("trl", "cold_rollouts_per_s")
    with_peer = [r for r in rounds if r.get("trl")]
    peer = statistics.median(r["trl"]["rollouts_per_s"] for r in with_peer) if with_peer else None
    peer_steady = statistics.median(r["trl"]["steady_rollouts_per_s"] for r in with_peer
                                    if r["trl"]["steady_rollouts_per_s"]) if with_peer else None
    return {
        "benchmark": f"P1 e2e RL vs TRL GRPOTrainer ({'GPU' if _gpu_name() else 'CPU'})",
        "primerl_rollouts_per_s": ours,
        "trl_rollouts_per_s": peer,
        "ratio": ratio(ours, peer),
        "primerl_steady_rollouts_per_s": ours_steady,
        "trl_steady_rollouts_per_s": peer_steady,
        "steady_ratio": ratio(ours_steady, peer_steady),
        "primerl_cold_rollouts_per_s": ours_cold,
        "trl_cold_rollouts_per_s": peer_cold,
        "cold_ratio": ratio(ours_cold, peer_cold),
        "clocks": {"primerl": "first generation to the trainer's last step (its processes already up)",
                   "trl": "trainer.train() (the model loaded)",
                   "cold": "process start to exit on both sides (primerl: the whole rl command)"},
        "primerl_backward_dtype": rounds[-1]["primerl"].get("backward_dtype"),
        "primerl_lost_rollouts": sum(r["primerl"]["lost_rollouts"] for r in rounds),
        "primerl_rewards": rounds[-1]["primerl"]["rewards"],
        "trl_rewards": with_peer[-1]["trl"]["rewards"] if with_peer else None,
        "rounds": rounds,
        "config": {"model": model, "steps": args.steps, "prompts_per_step": args.prompts_per_step,
                   "rollouts_per_prompt": args.group, "max_new_tokens": args.new_tokens, "lr": args.lr,
                   "precision": "bfloat16" if args.bf16 else "float32", "primerl_max_async_steps": 1,
                   "primerl_weight_transfer": args.weight_transfer, "primerl_max_batch_size": args.max_batch_size,
                   "primerl_engine_compile": args.engine_compile, "primerl_decode_steps": args.decode_steps,
                   "primerl_engine_overlap": args.engine_overlap, "primerl_engine": args.engine,
                   "primerl_backward_dtype_setting": args.backward_dtype or "auto",
                   "primerl_overrides": args.primerl_set,
                   "trl_generation": trl_generation(args)},
    }


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-script", type=Path, help="the peer harness trl_grpo.py (needed but with --smoke)")
    parser.add_argument("--trl-venv", type=Path, default=REPO / "build" / "trl-venv")
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench-p1")
    parser.add_argument("--rounds", type=int, default=2, help="primerl/TRL pairs, alternating")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--bf16", action="store_true", help="bfloat16 on both sides (default float32)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name (tiny checks the plumbing)")
    parser.add_argument("--model-dir", type=Path, help="a model directory to use instead of --model")
    parser.add_argument("--trl-python", type=Path, help="the peer's interpreter (default: --trl-venv, made if absent)")
    parser.add_argument("--trl-pythonpath", help="PYTHONPATH for the peer (default: none)")
    parser.add_argument("--prompts-per-step", type=int, default=PROMPTS)
    parser.add_argument("--group", type=int, default=GROUP, help="rollouts per prompt")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--seq-len", type=int, default=512, help="primerl's packed row length")
    parser.add_argument("--max-batch-size", type=int, default=32, help="primerl's inference.max_batch_size")
    parser.add_argument("--decode-steps", type=int, help="primerl's inference.decode_steps (default: the engine's)")
    parser.add_argument("--engine-overlap", action=argparse.BooleanOptionalAction, default=None,
                        help="primerl's inference.overlap (default: the engine's, on for CUDA)")
    parser.add_argument("--engine-compile", action=argparse.BooleanOptionalAction, default=None,
                        help="primerl's inference.compile (default: the engine's, on for CUDA)")
    parser.add_argument("--weight-transfer", default="filesystem", choices=["filesystem", "broadcast", "shared"])
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"], help="primerl's inference engine")
    parser.add_argument("--threads", help="primerl's CPU threads as ENGINE,TRAINER (default: rl splits the cores)")
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--skip-trl", action="store_true", help="primerl only (e.g. a learning run)")
    parser.add_argument("--backward-dtype", choices=["auto", "float32", "bfloat16"],
                        help="primerl's train.backward_dtype (default: the trainer's, auto)")
    parser.add_argument("--trl-vllm-colocate", action="store_true",
                        help="the peer generates with vLLM colocated on the same GPU (its --vllm-colocate)")
    parser.add_argument("--trl-vllm-memory", type=float, default=0.3,
                        help="with --trl-vllm-colocate: vLLM's share of the GPU memory (the peer's default 0.3)")
    parser.add_argument("--trl-vllm-sleep", action="store_true", help="with --trl-vllm-colocate: vLLM's sleep mode")
    parser.add_argument("--micro-batch-rows", type=int, help="primerl's trainer.train.micro_batch_rows (rows of "
                        "--seq-len tokens per forward and backward; default: the trainer's auto)")
    parser.add_argument("--trl-micro-batch", type=int, help="the peer trains each step's rollouts in micro-batches of "
                        "at most this many rows (gradient accumulation; default: all in one, as the harness does)")
    parser.add_argument("--side-timeout-s", type=float, help="limit of each primerl and peer run (default: none)")
    parser.add_argument("--primerl-set", action="append", default=[], type=primerl_override, metavar="KEY=VALUE",
                        help="one more of rl's settings for primerl's runs (repeatable), e.g. "
                        "trainer.train.compile=true; recorded in the result")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.skip_trl, args.rounds, args.steps = "tiny", True, 1, 2
        args.prompts_per_step, args.group, args.new_tokens, args.seq_len, args.max_batch_size = 1, 2, 4, 128, 4
    elif args.trl_script is None:
        parser.error("--trl-script is needed (the peer harness; its system prompt is both sides')")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    from primerl.models import resolve_model

    model_dir = args.model_dir.resolve() if args.model_dir else resolve_model(args.model)
    python = None if args.skip_trl else args.trl_python or ensure_trl_venv(args.trl_venv)
    work = args.work_dir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    system_prompt = peer_system_prompt(args.trl_script) if args.trl_script else SMOKE_SYSTEM_PROMPT
    prompts, system_file = write_prompts(work, system_prompt)
    config = work / "primerl.toml"
    config.write_text(tomli_w.dumps(primerl_config(model_dir, system_file, args)))

    versions = {"primerl": primerl_versions(),
                "trl": None if python is None else package_versions(str(python), VERSIONS, trl_env(args))}
    rounds = []
    for i in range(args.rounds):
        ours = run_primerl(config, work / f"primerl-{i}", args)
        print(f"round {i}: primerl {json.dumps(ours)}", file=sys.stderr, flush=True)
        peer = None if python is None else run_trl(python, args.trl_script, model_dir, prompts, args)
        print(f"round {i}: trl {json.dumps(peer)}", file=sys.stderr, flush=True)
        rounds.append({"primerl": ours, "trl": peer})
        result = {**summarize(rounds, str(args.model_dir or args.model), args), "versions": versions}
        if args.smoke:
            not_run(result, "trl", "the peer runs in its own virtual environment with TRL (--trl-venv), which a "
                    "smoke run does not build")
        # after every round, so an interrupted benchmark keeps what it measured
        emit(result, args.out, smoke=args.smoke, echo=i == args.rounds - 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
