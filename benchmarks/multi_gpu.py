"""Two GPUs end to end: reverse-text RL with the inference server on one GPU and the trainer on the other, new
weights moved through the filesystem and through the NCCL broadcast (`weight_transfer`); reward per step and the
P4 weight-update latency of each.

Per run (one per transfer) it records, step by step: the reward (mean over the step's rollouts); the trainer's
time to publish the version (`weights_broadcast_s`: sent and applied by every receiver; else `weights_export_s`:
the full snapshot written) and every other `weights_*_s` it logs; the orchestrator's `weight_update_s` (the server
loading, or with the broadcast confirming, the version); the step times; which transfer the trainer says it used
(a broadcast that could not form falls back to the filesystem, and says so); then medians, and the time from start
to the first trained step.

Two modes, because the GPU machine may lack what the orchestrator imports:
- `rl` — the real launcher, `python -m primerl.cli rl @ <config>`, devices.inference = [0], devices.trainer = [1].
  Needs verifiers 0.4 and its dependencies (benchmarks/carry_site.py packs them) and the reverse-text environment.
- `driver` — when verifiers is missing (or with --driver): the launcher's own process plan starts the server and the
  trainer on their GPUs, and this process does the orchestrator's part for reverse-text (the environment's phrases
  and reward, group-mean advantages, batches through `primerl.transport.rollouts`), synchronously
  (max_async_steps = 0), loading each new version through `POST /admin/update_weights` and timing it. It needs only
  the server's web stack (fastapi, uvicorn) besides primerl's own dependencies.

The model is random-init (`--arch`, with the tiny model's tokenizer and a vocabulary to match) unless --model names a
real one, so without real weights the reward measures the pipeline, not learning. Prints one JSON object and
writes it to --out.

    python benchmarks/multi_gpu.py --out benchmarks/results/multi_gpu_x2.json         # 2 GPUs
    python benchmarks/multi_gpu.py --cpu --steps 2                                   # dry check on the CPU
    python benchmarks/multi_gpu.py --smoke        # CPU, random tiny Llama, 1 step: rl mode/filesystem, driver/broadcast

--smoke runs each mode once, with a different transfer (the runs are keyed "<mode>_<transfer>"), on the CPU: one step
of 1 x 2 rollouts of 4 tokens on a random tiny Llama (`random_model`, as the GPU run builds its model).

It stops at once, with one line, when fewer than 2 GPUs are visible (use --cpu for the dry check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import importlib.util
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from report import add_smoke_flag, emit

REPO = Path(__file__).resolve().parent.parent
TRANSFERS = ("filesystem", "broadcast")

# The reverse-text task as environments/reverse_text defines it; the driver mode cannot import that package (it
# imports verifiers), so it reads the same word list and builds the same phrases and reward here.
REVERSE_TEXT_WORDS = REPO / "environments" / "reverse_text" / "reverse_text" / "data" / "words.txt"
REVERSE_TEXT_SYSTEM = "Reverse the text you are given, character by character. Reply with the reversed text only."


def reverse_text_phrases(seed: int = 0, count: int = 1000, min_words: int = 2, max_words: int = 5) -> list[str]:
    words = REVERSE_TEXT_WORDS.read_text().split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(min_words, max_words))) for _ in range(count)]


def reversal_similarity(reply: str, text: str) -> float:
    return difflib.SequenceMatcher(None, reply.strip(), text[::-1]).ratio()


# ---------------------------------------------------------------------------------------------------------------------
# The model


def random_model(arch: str, into: Path) -> Path:
    """A random-init model of `arch` (benchmarks/engine.py's shapes) with the tiny model's tokenizer; the vocabulary
    and special tokens follow the tokenizer, so every sampled token decodes."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from primerl.models import resolve_model

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine import ARCHITECTURES

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny"))
    spec = dict(ARCHITECTURES[arch])
    spec.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)
    return into


# ---------------------------------------------------------------------------------------------------------------------
# The run config (both modes)


def overrides(args: argparse.Namespace, model: Path, run_dir: Path, transfer: str, mode: str) -> list[str]:
    """`rl` command-line overrides for one run."""
    devices = ["--devices.inference=[]", "--devices.trainer=[]"] if args.cpu else [
        "--devices.inference=[0]", "--devices.trainer=[1]"]
    out = [
        f"--model.name={model}", f"--output_dir={run_dir}", f"--max_steps={args.steps}", f"--seq_len={args.seq_len}",
        f"--max_async_steps={0 if mode == 'driver' else args.max_async_steps}", *devices,
        "--orchestrator.env.id=reverse-text",
        f"--orchestrator.batch.tasks_per_step={args.tasks}", f"--orchestrator.batch.group_size={args.group_size}",
        f"--orchestrator.sampling.max_tokens={args.max_tokens}", "--orchestrator.sampling.temperature=1.0",
        f"--trainer.optim.lr={args.lr}", "--trainer.ckpt.save_at_end=false",
        f"--inference.max_batch_size={max(args.tasks * args.group_size, 8)}",
        f"--inference.max_model_len={args.seq_len}",  # prompts are short: a small KV cache starts faster
    ]
    if transfer != "filesystem":  # the default transfer needs no key, so this half runs on code without the other
        out.append(f"--weight_transfer={transfer}")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Mode rl: the real launcher


def run_launcher(args: argparse.Namespace, model: Path, run_dir: Path, transfer: str) -> dict[str, Any]:
    from primerl.launch.processes import child_environment

    cmd = [sys.executable, "-m", "primerl.cli", "rl", *overrides(args, model, run_dir, transfer, "rl")]
    log_path = run_dir.parent / f"rl_{transfer}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    with open(log_path, "wb") as log:
        rl = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_environment(), cwd=REPO)
        try:
            code = rl.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            rl.send_signal(signal.SIGINT)  # rl stops its processes in order
            try:
                rl.wait(timeout=30)
            except subprocess.TimeoutExpired:
                rl.kill()
                rl.wait()
            code = "timeout"
    result = collect(run_dir, started)
    result.update(exit=code, log_tail=_tail(log_path) if code != 0 else None)
    return result


# ---------------------------------------------------------------------------------------------------------------------
# Mode driver: server + trainer from the launcher's plan, the orchestrator's part done here


def run_driver(args: argparse.Namespace, model: Path, run_dir: Path, transfer: str) -> dict[str, Any]:
    from primerl.config import load
    from primerl.config.rl import RLConfig
    from primerl.launch.local import build_processes, visible_gpus
    from primerl.launch.processes import stop_all

    cfg, _ = load(RLConfig, overrides(args, model, run_dir, transfer, "driver"))
    gpus = visible_gpus()
    devices = cfg.assign_devices(len(gpus))
    processes = {p.name: p for p in build_processes(cfg, run_dir, devices, gpus)}
    server, trainer = processes["inference"], processes["trainer"]
    started = time.time()
    error = None
    try:
        for p in (server, trainer):
            p.start()
        asyncio.run(drive(args, cfg, run_dir, devices.trainer_ranks, server, [server, trainer]))
    except Exception as e:  # noqa: BLE001 - recorded in the result; the other transfer still runs
        error = f"{type(e).__name__}: {e}"
    finally:
        stop_all([server, trainer], grace_s=20)
    result = collect(run_dir, started)
    result.update(exit=0 if error is None else error,
                  log_tail={p.name: p.tail(20) for p in (server, trainer)} if error else None)
    return result


async def drive(args, cfg, run_dir: Path, num_ranks: int, server, watched) -> None:
    import httpx
    from transformers import AutoTokenizer

    from primerl.monitor import MetricsLogger
    from primerl.orchestrator.advantages import group_mean_baseline
    from primerl.transport import rollouts as batches
    from primerl.transport import snapshots

    inference_cfg = _process_config(run_dir, "inference")
    base_url = f"http://127.0.0.1:{inference_cfg['port']}"
    token = server.env["PRIMERL_ADMIN_TOKEN"]
    served = cfg.inference.served_model_name or cfg.model.name
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name)
    phrases = reverse_text_phrases()
    random.Random(cfg.seed).shuffle(phrases)
    metrics = MetricsLogger(run_dir, "orchestrator")
    timeout = httpx.Timeout(args.timeout_s)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as http:
        await _wait_healthy(http, watched, args.timeout_s)
        for step in range(args.steps):
            step_start = time.perf_counter()
            tasks = [phrases[(step * args.tasks + i) % len(phrases)] for i in range(args.tasks)]
            groups = await asyncio.gather(*(_group(http, tokenizer, served, phrase, args) for phrase in tasks))
            samples, rewards = [], []
            for group in groups:
                group_rewards = [reward for _, _, _, reward in group]
                for (prompt, completion, logprobs, _), advantage in zip(group, group_mean_baseline(group_rewards)):
                    samples.append(batches.Sample(prompt + completion, [0] * len(prompt) + [1] * len(completion),
                                                  [0.0] * len(prompt) + logprobs, advantage))
                rewards += group_rewards
            batches.write_batch(run_dir, step, samples, cfg.seq_len, num_ranks, tokenizer.pad_token_id, 1.0)
            path = await asyncio.to_thread(_wait_for_weights, run_dir, step + 1, watched, args.timeout_s)
            stable_at = json.loads((path / snapshots.STABLE).read_text())["written_at"]
            update_start = time.perf_counter()
            response = await http.post("/admin/update_weights", json={"path": str(path), "step": step + 1},
                                       headers={"Authorization": f"Bearer {token}"})
            response.raise_for_status()
            metrics.log(step, {"reward_mean": statistics.fmean(rewards), "weight_update_s":
                               time.perf_counter() - update_start, "stable_to_serving_s": time.time() - stable_at,
                               "step_s": time.perf_counter() - step_start, "num_samples": len(samples)})


async def _group(http, tokenizer, served: str, phrase: str, args) -> list[tuple[list[int], list[int], list[float],
                                                                                 float]]:
    messages = [{"role": "system", "content": REVERSE_TEXT_SYSTEM}, {"role": "user", "content": phrase}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = {"model": served, "token_ids": prompt, "sampling_params": {
        "n": args.group_size, "temperature": 1.0, "max_tokens": args.max_tokens, "logprobs": 1,
        "stop_token_ids": [tokenizer.eos_token_id]}}
    response = await http.post("/inference/v1/generate", json=body)
    response.raise_for_status()
    out = []
    for choice in response.json()["choices"]:
        completion = choice["token_ids"]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        reply = tokenizer.decode(completion, skip_special_tokens=True)
        out.append((prompt, completion, logprobs, reversal_similarity(reply, phrase)))
    return out


async def _wait_healthy(http, watched, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _check_alive(watched)
        with contextlib.suppress(httpx.TransportError):  # not listening yet
            if (await http.get("/health")).status_code == 200:
                return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"the server was not healthy after {timeout_s:.0f}s")


def _wait_for_weights(run_dir: Path, step: int, watched, timeout_s: float) -> Path:
    from primerl.transport import snapshots

    deadline = time.monotonic() + timeout_s
    path = snapshots.weights_dir(run_dir, step)
    while not snapshots.is_stable(path):
        _check_alive(watched)
        if time.monotonic() > deadline:
            raise TimeoutError(f"weights step {step} not STABLE after {timeout_s:.0f}s")
        time.sleep(0.05)
    return path


def _check_alive(processes) -> None:
    for p in processes:
        if p.poll() is not None:
            raise RuntimeError(f"{p.name} exited with code {p.poll()}")


def _process_config(run_dir: Path, name: str) -> dict[str, Any]:
    from primerl.config import read_toml

    return read_toml(run_dir / "config" / f"{name}.toml")


# ---------------------------------------------------------------------------------------------------------------------
# Results


def collect(run_dir: Path, started: float) -> dict[str, Any]:
    """Per-step reward and weight times of a finished (or stopped) run, from its metrics.jsonl."""
    from primerl.monitor import read_metrics

    orchestrator = {r["step"]: r for r in read_metrics(run_dir, "orchestrator")}
    trainer = {r["step"]: r for r in read_metrics(run_dir, "trainer")}
    trainer_weight_keys = sorted({k for r in trainer.values() for k in r if k.startswith("weights_") and
                                  k.endswith("_s")})
    steps = []
    for step in sorted(orchestrator):
        o, t = orchestrator[step], trainer.get(step, {})  # both records of training step k (rollouts/step_<k-1>)
        publish_s = t.get("weights_broadcast_s", t.get("weights_export_s"))
        to_serving = o.get("stable_to_serving_s")
        steps.append({"step": step, "reward_mean": o.get("reward_mean"), "weight_update_s": o.get("weight_update_s"),
                      "stable_to_serving_s": to_serving, "publish_s": publish_s,
                      "trainer_to_serving_s": publish_s + to_serving if None not in (publish_s, to_serving) else None,
                      "step_s": o.get("step_s"), **{k: t.get(k) for k in trainer_weight_keys},
                      "trainer_step_s": t.get("step_s")})
    first_trained = min((r["time"] for r in trainer.values()), default=None)
    return {
        "steps_done": len(trainer),
        # what the trainer says it used, e.g. "filesystem (fallback: ...)" when the broadcast group did not form
        "weight_transfer_used": sorted({r["weight_transfer"] for r in trainer.values() if "weight_transfer" in r}),
        "time_to_first_step_s": first_trained - started if first_trained else None,
        "wall_s": time.time() - started,
        "medians": {key: _median([s.get(key) for s in steps]) for key in
                    ("reward_mean", "trainer_to_serving_s", "publish_s", "weight_update_s", "stable_to_serving_s",
                     "step_s", "trainer_step_s", *trainer_weight_keys)},
        "steps": steps,
    }


def _median(values: list[Any]) -> float | None:
    present = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(present) if present else None


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# ---------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="dry check on the CPU (tiny model unless --model/--arch)")
    parser.add_argument("--driver", action="store_true", help="driver mode even when verifiers is importable")
    parser.add_argument("--transfers", default=",".join(TRANSFERS), help="weight transfers to run, in order")
    parser.add_argument("--model", type=Path, help="a real model directory instead of a random-init one")
    parser.add_argument("--arch", default=None, help="random-init shape (benchmarks/engine.py; default smollm2-135m, "
                        "--cpu: the tiny registry model)")
    parser.add_argument("--steps", type=int, default=20, help="trainer steps per run")
    parser.add_argument("--tasks", type=int, default=8, help="phrases per step")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per phrase")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens per rollout at most")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per packed row")
    parser.add_argument("--max-async-steps", type=int, default=1, help="rl mode (the driver is synchronous)")
    parser.add_argument("--lr", type=float, default=1e-5, help="trainer learning rate")
    parser.add_argument("--timeout-s", type=float, default=240, help="limit for each run")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.cpu, args.arch, args.steps, args.tasks, args.group_size, args.max_tokens = True, "tiny", 1, 1, 2, 4
        args.seq_len = 256
    transfers = [t for t in args.transfers.split(",") if t]
    unknown = sorted(set(transfers) - set(TRANSFERS))
    if unknown:
        parser.error(f"unknown transfer(s) {unknown}; known: {', '.join(TRANSFERS)}")

    import torch
    import transformers

    from primerl.launch.local import visible_gpus

    gpus = visible_gpus()
    if not args.cpu and (torch.cuda.device_count() < 2 or len(gpus) < 2):
        print(f"multi_gpu: needs 2 GPUs (inference + trainer), {torch.cuda.device_count()} visible; --cpu runs the "
              "dry check", file=sys.stderr)
        return 2
    verifiers_ok = importlib.util.find_spec("verifiers") is not None and importlib.util.find_spec(
        "reverse_text") is not None
    mode = "driver" if args.driver or not verifiers_ok else "rl"
    plan = [("rl", "filesystem"), ("driver", "broadcast")] if args.smoke else [(mode, t) for t in transfers]

    runs = {}
    with tempfile.TemporaryDirectory(prefix="multi-gpu-") as tmp:
        tmp = Path(tmp)
        if args.model:
            model, label = args.model.resolve(), str(args.model)
        elif args.cpu and args.arch is None:
            from primerl.models import resolve_model

            model, label = resolve_model("tiny"), "tiny (random init)"
        else:
            arch = args.arch or "smollm2-135m"
            model, label = random_model(arch, tmp / "model"), f"{arch} architecture, random init, tiny tokenizer"
        for run_mode, transfer in plan:
            run = run_launcher if run_mode == "rl" else run_driver
            key = f"{run_mode}_{transfer}" if args.smoke else transfer
            print(f"multi_gpu: {run_mode} mode, transfer {transfer}", file=sys.stderr, flush=True)
            runs[key] = run(args, model, tmp / key / "run", transfer)

    result = {
        "what": "reverse-text RL, inference on one GPU and trainer on the other; per weight transfer and step: "
                "reward_mean; publish_s (trainer: weights_broadcast_s, the send until every receiver applied it, "
                "else weights_export_s, the full snapshot written); weight_update_s (POST /admin/update_weights: "
                "the server loads, or with the broadcast confirms, the version); driver mode also "
                "stable_to_serving_s (STABLE written -> serving) and trainer_to_serving_s = publish_s + that (P4); "
                "in rl mode P4 = publish_s + weight_update_s + up to orchestrator.weights_poll_s (0.2 s)",
        "mode": "both (--smoke)" if args.smoke else mode,
        "mode_reason": "--smoke" if args.smoke else "--driver" if args.driver else (
            "verifiers and reverse_text importable" if verifiers_ok else "verifiers or reverse_text not importable"),
        "model": label,
        "layout": "CPU (dry check)" if args.cpu else f"inference GPU {gpus[0]}, trainer GPU {gpus[1]}",
        "steps": args.steps,
        "rollouts_per_step": f"{args.tasks} x {args.group_size}",
        "max_tokens": args.max_tokens,
        "max_async_steps": 0 if mode == "driver" else args.max_async_steps,
        "p4": {t: {k: v for k, v in r["medians"].items() if k != "reward_mean"} for t, r in runs.items()},
        "runs": runs,
        "device": torch.cuda.get_device_name(0) if not args.cpu else "cpu",
        "transformers": transformers.__version__,
    }
    emit(result, args.out, smoke=args.smoke)
    return 0 if all(r["exit"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
