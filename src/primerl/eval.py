"""`primerl eval`: run an environment against a model and report avg@k and pass@k.

    eval --model.name smollm2-135m-instruct --env.id reverse-text --num_examples 32 --rollouts_per_example 4

Without `--base_url` it starts `primerl inference` for the model (log in `<output_dir>/logs/inference.log`) and stops it
at the end; with `--base_url` it evaluates any OpenAI-compatible server. Each task gets k rollouts through verifiers'
own machinery (the same environments and harnesses as training). Results go to `<output_dir>/results.json`:
    {"env", "model", "k", "num_examples", "avg@k", "pass@k", "pass@1", "reward_std", "errors", "seconds",
     "rollouts_per_s", "turns_mean", "turns_max", "completion_len_mean", "completion_len_max", "truncated_frac",
     "metric/<name>", ..., "examples": [{"task_id", "rewards", "errors", "rollouts": [{"reward", "turns", "metrics",
     "completion_len", "truncated", "stop_condition", "error"}, ...]}, ...]}
`task_id` is the task's stable id (its durable id, else its content key); `errors` holds each rollout's error in one
line (null when it succeeded); `rollouts` each rollout's model turns, the taskset's own metrics, its completion length
and whether it was truncated, and the top-level `turns_*`, `completion_len_*`, `truncated_frac` and `metric/<name>`
average them over every rollout. When every rollout failed, results.json is still written and eval exits 1 with the
first error on one line.
avg@k is the mean reward over all rollouts; pass@k the fraction of tasks with at least one rollout whose reward reaches
`pass_threshold`; pass@1 the mean per-rollout pass rate (the unbiased pass@1 estimate from k samples).
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from primerl.config import config_from_argv
from primerl.config.eval import EvalConfig
from primerl.config.inference import InferenceConfig
from primerl.monitor import MetricsLogger
from primerl.storage import atomic_write

log = logging.getLogger("primerl.eval")

RESULTS_FILE = "results.json"


def summarize(rewards: Sequence[Sequence[float]], k: int, pass_threshold: float) -> dict[str, float]:
    """avg@k, pass@k and pass@1 from the rewards of each task's k rollouts."""
    if not rewards:
        raise ValueError("no tasks were evaluated")
    flat = [r for task in rewards for r in task]
    passed = [[r >= pass_threshold for r in task] for task in rewards]
    return {
        f"avg@{k}": statistics.fmean(flat),
        f"pass@{k}": statistics.fmean(float(any(p)) for p in passed),
        "pass@1": statistics.fmean(statistics.fmean(map(float, p)) for p in passed if p),
        "reward_std": statistics.pstdev(flat),
    }


def select_tasks(taskset: Any, count: int, seed: int) -> list[Any]:
    """`count` distinct tasks in the seeded order the orchestrator uses (all of them when the taskset is smaller)."""
    from primerl.orchestrator.sampler import TaskStream

    stream = TaskStream(taskset, seed)
    return [stream.next()[1] for _ in range(min(count, len(stream) or count))]


async def wait_until_serving(base_url: str, timeout_s: float) -> None:
    """Wait for `GET /v1/models` to answer 200 (any OpenAI-compatible server, not only primerl's)."""
    from primerl.orchestrator.client import poll_until_ok

    async with httpx.AsyncClient(base_url=base_url, timeout=10.0) as http:
        await poll_until_ok(http, "/v1/models", timeout_s, f"no server answered at {base_url}")


# A rollout that produced no sample at all (none of its traces trainable): reward 0, as before.
_EMPTY_ROLLOUT = {"reward": 0.0, "turns": 0, "metrics": {}, "completion_len": 0, "truncated": False,
                  "stop_condition": None, "error": None}


async def evaluate(cfg: EvalConfig, base_url: str, env: Any, progress: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run `cfg`'s rollouts of `env` (a loaded `vf.Env`) against the server at `base_url`; `progress["total"]` and
    `progress["done"]` count the rollouts once the server serves."""
    progress = progress if progress is not None else {}
    import verifiers.v1 as vf

    from primerl.orchestrator import verifiers_bridge

    tasks = select_tasks(env.taskset, cfg.num_examples, cfg.seed)
    if cfg.client == "token":
        from primerl.models import resolve_model

        client = verifiers_bridge.train_client(base_url, renderer_model=resolve_model(cfg.model.name, cfg.model.revision))
    else:
        client = verifiers_bridge.chat_client(base_url)
    sampling = vf.SamplingConfig(
        temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, max_tokens=cfg.sampling.max_tokens
    )
    ctx = vf.ModelContext(model=cfg.served_model_name or cfg.model.name, client=client, sampling=sampling)
    await wait_until_serving(base_url, cfg.startup_timeout_s)
    slots = asyncio.Semaphore(cfg.max_concurrent)
    progress.update(done=0, total=len(tasks) * cfg.rollouts_per_example)

    async def rollout(task: Any) -> list[Any]:
        async with slots:
            episode = await env.run_episode(task, ctx)
        progress["done"] += 1
        return verifiers_bridge.samples_from_episode(episode, (0, 0))

    started = time.monotonic()
    async with env.serving():
        per_task = await asyncio.gather(
            *(asyncio.gather(*(rollout(task) for _ in range(cfg.rollouts_per_example))) for task in tasks)
        )
    seconds = time.monotonic() - started
    examples = []
    for task, rollouts in zip(tasks, per_task):
        records = [(verifiers_bridge.rollout_records(samples) or [_EMPTY_ROLLOUT])[0] for samples in rollouts]
        examples.append({"task_id": verifiers_bridge.task_id(task), "rewards": [r["reward"] for r in records],
                         "errors": [r["error"] for r in records], "rollouts": records})
    k = cfg.rollouts_per_example
    return {
        "env": cfg.env.id,
        "model": cfg.model.name,
        "k": k,
        "num_examples": len(examples),
        **summarize([e["rewards"] for e in examples], k, cfg.pass_threshold),
        "pass_threshold": cfg.pass_threshold,
        "errors": sum(error is not None for e in examples for error in e["errors"]),
        "seconds": round(seconds, 3),
        "rollouts_per_s": len(examples) * k / seconds if seconds > 0 else None,
        **{key: value for key, value in verifiers_bridge.rollout_means([r for e in examples for r in e["rollouts"]]).items()
           if key != "rollouts"},  # turns, completion length, truncation, metric/<name>: per rollout
        "examples": examples,
    }


def start_server(cfg: EvalConfig):
    """Start `primerl inference` for `cfg.model`; return (process, base_url)."""
    from primerl.launch.local import free_port, write_process_config
    from primerl.launch.processes import ManagedProcess, child_environment, primerl_command
    from primerl.models import resolve_model

    resolve_model(cfg.model.name, cfg.model.revision)  # build or convert once, before the server needs it
    port = cfg.inference.port or free_port(cfg.inference.host)
    server_cfg = InferenceConfig(**{**cfg.inference.model_dump(), "model": cfg.model.model_dump(), "seed": cfg.seed,
                                    "port": port})
    config_path = cfg.output_dir / "config" / "inference.toml"
    write_process_config(config_path, server_cfg, exclude={"admin_token", "admin_token_file"})
    server = ManagedProcess("inference", primerl_command("inference", "@", str(config_path)),
                            cfg.output_dir / "logs" / "inference.log", child_environment())
    server.start()
    host = "127.0.0.1" if cfg.inference.host in ("0.0.0.0", "") else cfg.inference.host
    return server, f"http://{host}:{port}"


def run_eval(cfg: EvalConfig) -> int:
    """Evaluate and write `<output_dir>/results.json`; return the exit code."""
    from primerl.launch.processes import stop_all
    from primerl.orchestrator.verifiers_bridge import EnvConfigError, env_from_config

    print(f"primerl eval: loading the environment {cfg.env.id}", file=sys.stderr, flush=True)
    try:
        env = env_from_config(cfg.env)  # before a server starts: a refused environment costs nothing
    except EnvConfigError as e:
        print(f"primerl eval: config error: {e}", file=sys.stderr)
        return 2
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.base_url:
        print(f"primerl eval: starting an inference server for {cfg.model.name} (the first answer takes a while: the "
              "model loads)", file=sys.stderr, flush=True)
    server, base_url = (None, cfg.base_url) if cfg.base_url else start_server(cfg)
    try:
        results = asyncio.run(_evaluate_watching(cfg, base_url, server, env))
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - reported in one line (with the server's log when it is ours)
        print(f"primerl eval: {type(e).__name__}: {e}", file=sys.stderr)
        if server is not None:
            print(f"last lines of {server.log_path}:\n{server.tail()}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            stop_all([server], grace_s=15)
    path = cfg.output_dir / RESULTS_FILE
    atomic_write(path, json.dumps(results, indent=1))
    if cfg.wandb.project:
        logger = MetricsLogger(cfg.output_dir, "eval", wandb=cfg.wandb, config={"eval": cfg.model_dump(mode="json")})
        logger.log(0, {key: value for key, value in results.items() if isinstance(value, int | float)})
        logger.close()
    k = results["k"]
    print(f"eval {results['env']} | {results['model']} | {results['num_examples']} tasks x {k} | "
          f"avg@{k} {results[f'avg@{k}']:.4f} | pass@{k} {results[f'pass@{k}']:.4f} | pass@1 {results['pass@1']:.4f} | "
          f"errors {results['errors']} | {results['seconds']:.1f}s -> {path}")
    rollouts = results["num_examples"] * k
    if results["errors"] == rollouts:
        first = next(error for e in results["examples"] for error in e["errors"])
        print(f"primerl eval: every rollout failed ({rollouts} of {rollouts}); first error: {first}", file=sys.stderr)
        return 1
    return 0


PROGRESS_EVERY_S = 5.0


async def _evaluate_watching(cfg: EvalConfig, base_url: str, server, env: Any) -> dict[str, Any]:
    """`evaluate`, aborted early if the server eval started dies, with a line every `PROGRESS_EVERY_S` seconds saying
    what it waits for (the server to serve, then the rollouts)."""
    progress: dict[str, Any] = {"done": 0, "total": None}
    work = asyncio.create_task(evaluate(cfg, base_url, env, progress))
    started = last = time.monotonic()
    while not work.done():
        await asyncio.wait({work}, timeout=0.5)
        if not work.done() and time.monotonic() - last >= PROGRESS_EVERY_S:
            last = time.monotonic()
            if progress["total"] is None:
                where = f"; its log: {server.log_path}" if server is not None else ""
                doing = f"waiting for the inference server at {base_url} to serve{where}"
            else:
                doing = f"{progress['done']}/{progress['total']} rollouts done"
            print(f"primerl eval: {doing} ({last - started:.0f} s)", file=sys.stderr, flush=True)
        if server is not None and server.poll() is not None and not work.done():
            work.cancel()
            raise RuntimeError(f"the inference server exited with code {server.poll()}")
    return work.result()


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_argv(EvalConfig, argv, prog="primerl eval")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_eval(cfg)


if __name__ == "__main__":
    raise SystemExit(main())
