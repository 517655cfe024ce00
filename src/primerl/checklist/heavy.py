"""The heavy steps of the checklist: they run the real primerl commands as child processes, on the recipe's model.

sft_trainer and rl_trainer train one micro-step on fake data and save; inference serves the recipe's model and answers
a chat request; rl_smoke runs the recipe's smoke variant of the whole stack. Each child's output goes to
`<log dir>/<step>.log`, its files to the scratch directory. They have no fixed time limit: a step fails only when its
child makes no progress (no new output, no CPU time spent by it or anything it started) for `ctx.stall_timeout_s`
(`primerl.launch.progress.ProgressWatch`), naming what it was doing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from primerl.checklist.context import Context, Fail, Skip
from primerl.launch.processes import ManagedProcess, child_environment, primerl_command, stop_all
from primerl.launch.progress import ProgressWatch, last_line, root_cause
from primerl.ports import free_port
from primerl.recipes.stages import validate_stage

FAKE_SFT_CONFIG = "configs/debug/fake/sft.toml"
FAKE_RL_CONFIG = "configs/debug/fake/rl.toml"
# One optimizer step on a few tokens proves what the trainer steps check: the model loads, steps and saves here.
MICRO_SFT = {"train": {"max_steps": 1}, "data": {"fake_conversations": 2, "rows_per_step": 1, "seq_len": 128}}
MICRO_RL = {"train": {"max_steps": 1}, "data": {"fake_samples": 2, "fake_sample_tokens": 16, "fake_seq_len": 32}}


def check_sft_trainer(ctx: Context) -> str:
    ctx.require_runnable_here()
    if ctx.recipe is not None and "sft" not in ctx.recipe.stages:
        raise Skip("the recipe has no sft stage")
    return _run_fake_trainer(ctx, "sft_trainer", "sft", FAKE_SFT_CONFIG, MICRO_SFT)


def check_rl_trainer(ctx: Context) -> str:
    micro = MICRO_RL
    if ctx.recipe is not None and "rl" in ctx.recipe.stages:
        # the CPU threads the run gives its trainer (it splits the cores with the engine): trained as it will be
        threads = _rl_process_configs(ctx, "rl_trainer")[2].train.threads
        if threads is not None:
            micro = {**micro, "train": {**micro["train"], "threads": threads}}
    return _run_fake_trainer(ctx, "rl_trainer", "trainer", FAKE_RL_CONFIG, micro)


def _run_fake_trainer(ctx: Context, name: str, command: str, fake_config: str, micro: dict[str, Any]) -> str:
    """Train one micro-step on fake data and save (checkpoint and weights). With a recipe it trains the recipe's model
    (the one the run will train, at its pinned revision), so the step checks that model with this trainer on this
    machine; without one it trains the fake config's own model (the embedded default)."""
    import tomli_w

    config = _project_file(fake_config)
    work = ctx.work_dir / name
    model = _recipe_model(ctx)
    if model is not None:
        ctx.require_runnable_here()
    override = ctx.log_dir / f"{name}.micro.toml"
    override.write_text(tomli_w.dumps({**micro, **({"model": model} if model is not None else {})}))
    _run_command(ctx, name, [command, "@", str(config), "@", str(override), "--run_dir", str(work)])
    on = f" on {model['name']}" if model is not None else ""
    peak = f", peak resident {ctx.peaks[name] / 2**20:.0f} MB" if name in ctx.peaks else ""
    return f"primerl {command} @ {fake_config}: one micro-step{on}, saved{peak}{_against_estimate(ctx, name, model)}"


def _against_estimate(ctx: Context, name: str, model: dict[str, Any] | None) -> str:
    """The measured micro-step beside `primerl.checklist.memory`'s estimate for the same sizes (RL trainer only)."""
    from primerl.checklist.memory import ModelShape, trainer_need
    from primerl.models import resolve_model

    if name != "rl_trainer" or name not in ctx.peaks:
        return ""
    shape = ModelShape.read(resolve_model(model["name"] if model else "tiny", (model or {}).get("revision"),
                                          progress=False))
    need = trainer_need(shape, MICRO_RL["data"]["fake_seq_len"], 1, False, False, 4096)
    return f" (estimated {need.host_bytes / 2**20:.0f} MB for these sizes)"


def _recipe_model(ctx: Context) -> dict[str, Any] | None:
    """The model table of the recipe's first stage (name, pinned revision, dtype), or None without a recipe."""
    if ctx.recipe is None or not ctx.recipe.stages:
        return None
    for stage in ctx.recipe.stages:
        model = getattr(validate_stage(ctx.recipe, stage), "model", None)
        if model is not None:
            return model.model_dump(mode="json", exclude_none=True)
    return None


def check_inference(ctx: Context) -> str:
    import httpx

    ctx.require_runnable_here()
    config_file = ctx.log_dir / "inference.toml"
    config_file.write_text(_inference_config(ctx))
    port = free_port()
    server = ManagedProcess("inference", primerl_command("inference", "@", str(config_file), "--port", str(port)),
                            ctx.log_dir / "inference.log", env=child_environment())
    base = f"http://127.0.0.1:{port}"
    server.start()
    watch = ProgressWatch(server, ctx.stall_timeout_s)
    try:
        with httpx.Client(base_url=base, timeout=ctx.stall_timeout_s) as client:  # a busy server answers late
            while True:
                if server.poll() is not None:
                    raise Fail(f"the server exited with code {server.poll()}: {root_cause(server.tail(200))[:300]} "
                               f"(log: {server.log_path})")
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                _follow(ctx, watch, f"starting the server, waiting for {base}/health")
                time.sleep(0.5)
            models = client.get("/v1/models").json()["data"]
            name = models[0]["id"]
            reply = client.post("/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                "temperature": 0,
            })
            if reply.status_code != 200:
                raise Fail(f"chat completion answered {reply.status_code}: {reply.text[:200]}")
            text = reply.json()["choices"][0]["message"]["content"]
    finally:
        stop_all([server], grace_s=10)
    return f"served {name}; /health, /v1/models and one chat request ({len(text or '')} chars) answered"


def check_rl_smoke(ctx: Context) -> str:
    from primerl.config import to_toml

    if ctx.recipe is None:
        raise Skip("no recipe given: no smoke variant to run")
    if "rl" not in ctx.recipe.stages:
        raise Skip("the recipe has no rl stage")
    ctx.require_runnable_here()
    run_dir = (ctx.work_dir / "rl_smoke").resolve()
    cfg = validate_stage(ctx.recipe, "rl", run_dir=run_dir, smoke=True)
    if cfg.trainer.train.warm_up_tokens is None:  # a run of one step gains nothing from warming up before it
        train = cfg.trainer.train.model_copy(update={"warm_up_tokens": 0})
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"train": train})})
    config_file = ctx.log_dir / "rl_smoke.toml"
    config_file.write_text(to_toml(cfg))
    _run_command(ctx, "rl_smoke", ["rl", "@", str(config_file)])
    return f"primerl rl ran the smoke variant ({cfg.max_steps} step(s))"


def _project_file(relative: str) -> Path:
    """A file of the primerl project (configs/...): under the working directory, else next to primerl's sources."""
    import primerl

    for root in (Path.cwd(), *Path(primerl.__file__).resolve().parents):
        if (root / relative).is_file():
            return root / relative
    raise Fail(f"{relative} not found (run from the primerl checkout or image)")


def _run_command(ctx: Context, name: str, args: Sequence[str]) -> None:
    """Run `primerl <args>` with its output in `<log dir>/<name>.log`, printing progress; Fail on error, or when it
    makes no progress for `ctx.stall_timeout_s`."""
    proc = ManagedProcess(name, primerl_command(*args), ctx.log_dir / f"{name}.log", env=child_environment())
    from primerl.checklist.memory import peak_rss_bytes

    proc.start()
    watch = ProgressWatch(proc, ctx.stall_timeout_s)
    try:
        while proc.poll() is None:
            if (peak := peak_rss_bytes(proc.pid)) is not None:  # the high-water mark: its last reading is the peak
                ctx.peaks[name] = max(peak, ctx.peaks.get(name, 0.0))
            _follow(ctx, watch, f"running primerl {args[0]}")
            time.sleep(0.5)
    finally:
        stop_all([proc], grace_s=10)
    if proc.poll() != 0:
        raise Fail(f"exit code {proc.poll()}: {root_cause(proc.tail(200))[:300]} (log: {proc.log_path})")


def _follow(ctx: Context, watch: ProgressWatch, doing: str) -> None:
    """One look at a running child: a progress line every `ProgressWatch.HEARTBEAT_EVERY_S`, Fail when it stalled."""
    if ctx.stopping.is_set():
        raise Fail(f"stopped while {doing}")
    watch.sample()
    if watch.stalled():
        raise Fail(f"no progress for {watch.stall_timeout_s:.0f} s while {doing}: no new output and no CPU time "
                   f"spent; last output: {last_line(watch.proc.tail(5))[:200]} (log: {watch.proc.log_path})")
    if watch.heartbeat_due():
        ctx.say(f"{watch.proc.name}: {watch.report()}")


def _inference_config(ctx: Context) -> str:
    """`primerl inference` config: the recipe's (smoke) RL inference settings and model, else the tiny model."""
    from primerl.config import to_toml
    from primerl.config.inference import InferenceConfig

    if ctx.recipe is None or "rl" not in ctx.recipe.stages:
        return to_toml(InferenceConfig(model={"name": "tiny"}, max_model_len=512))
    inference = _rl_process_configs(ctx, "inference")[0]
    return to_toml(inference.model_copy(update={"admin_token": None, "admin_token_file": None}))


def _rl_process_configs(ctx: Context, name: str) -> tuple[Any, Any, Any]:
    """The inference, orchestrator and trainer configs of the recipe's (smoke) RL stage, as `rl` would start them on
    this machine (one GPU for both, or the CPU)."""
    from primerl.config.rl import DeviceAssignment

    cfg = validate_stage(ctx.recipe, "rl", run_dir=ctx.work_dir.resolve() / name, smoke=True)
    gpus = [0] if ctx.gpu_count else []
    return cfg.process_configs(DeviceAssignment(gpus, gpus), base_url="http://127.0.0.1:0")

