"""The `rl` launcher: run inference, orchestrator and trainer on this machine and watch them (`run_rl`).

`rl @ configs/reverse-text/rl.toml [--max_steps 40] [--resume]` (the command line is `primerl.commands.rl`) resolves
the config and calls `run_rl`, which does, in order: prepares the model once, assigns GPUs, writes each process's
resolved config to `<run>/config/<process>.toml`, starts the three processes (the trainer under torchrun when it has
several ranks; on a CPU-only run once the server serves) with one log file each in `<run>/logs/`, then prints one line
per trained step (orchestrator and trainer metrics side by side) under a progress bar.

It stops the run when the trainer and orchestrator have finished (exit 0), when any process dies or the run hangs
(no new metrics record for `stall_timeout_s`): the others are stopped and, while `max_restarts` allows
(`launch.restart`), the whole run resumes from its last checkpoint as `--resume` would, on one line with the cause,
counted in metrics.jsonl; else the tail of the failed process's log is printed, exit 1. On Ctrl-C / SIGTERM: SIGINT to
every process, a grace period, then SIGKILL; exit 130.
"""

from __future__ import annotations

import os
import platform
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pydantic
import tomli_w

from primerl.config.rl import DeviceAssignment, RLConfig
from primerl.launch.console import Console, count, stop_quietly
from primerl.launch.preflight import LaunchError, require_writable, visible_gpus
from primerl.launch.processes import (
    ManagedProcess,
    Terminated,
    child_environment,
    preload,
    primerl_command,
    raise_terminated,
    stop_all,
    torchrun_command,
)
from primerl.launch.restart import (
    Failure,
    Progress,
    RestartPolicy,
    forget_what_is_redone,
    record_restart,
    run_with_restarts,
    trained_steps,
    watch,
)
from primerl.monitor import METRICS_FILE
from primerl.ports import free_port
from primerl.transport import snapshots
from primerl.transport.weight_transfer.modes import transfer_mode

ADMIN_TOKEN_VAR = "PRIMERL_ADMIN_TOKEN"
EXIT_INTERRUPTED = 130
POLL_S = 0.25


# ---------------------------------------------------------------------------------------------------------------------
# Preparation


def check_run_dir(run_dir: Path, resume: bool) -> None:
    """A fresh run needs an empty (or new) run directory; a resumed one needs the old one."""
    used = [name for name in ("rollouts", "weights", "checkpoints", METRICS_FILE) if (run_dir / name).exists()]
    if resume and not used:
        print(f"rl: --resume: nothing to resume in {run_dir}; starting a fresh run", file=sys.stderr)
    if not resume and used:
        raise LaunchError(f"{run_dir} already holds a run ({', '.join(used)}): pass --resume to continue it, or "
                          "choose another output_dir")


def _none_overrides(model: type[pydantic.BaseModel], values: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys set to None whose default is not None: TOML has no null, so they cannot be passed in a file."""
    out = []
    for name, info in model.model_fields.items():
        value = values.get(name)
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel) and isinstance(value, dict):
            out += _none_overrides(annotation, value, f"{prefix}{name}.")
        elif value is None and name in values and info.get_default(call_default_factory=True) is not None:
            out.append(prefix + name)
    return out


def process_config_toml(name: str, cfg: pydantic.BaseModel, exclude: set[str] = frozenset()) -> str:
    """The resolved config of process `name` as TOML text (secrets excluded: they travel in the environment)."""
    values = cfg.model_dump(mode="json", exclude=exclude)
    lost = _none_overrides(type(cfg), values)
    if lost:
        raise LaunchError(f"{name}: {', '.join(lost)} = None cannot be written to a TOML config; set a value")
    return tomli_w.dumps(_drop_none(values))


def write_process_config(path: Path, cfg: pydantic.BaseModel, exclude: set[str] = frozenset()) -> None:
    """`process_config_toml` written to `path` (named after its stem)."""
    text = process_config_toml(path.stem, cfg, exclude)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    return value


# ---------------------------------------------------------------------------------------------------------------------
# The run


def describe_devices(devices: DeviceAssignment, gpus: Sequence[str], engine: str = "hf") -> str:
    """Which GPUs each process got, named as in the CUDA_VISIBLE_DEVICES it is given (one console line)."""

    def where(ids: list[int]) -> str:
        return "CPU" if not ids else ("GPU " if len(ids) == 1 else "GPUs ") + ",".join(gpus[i] for i in ids)

    inference = where(devices.inference)
    if engine == "vllm" and len(devices.inference) > 1:
        inference += f" (vLLM tensor parallel {len(devices.inference)})"
    trainer = where(devices.trainer) + (" (shared with inference)" if devices.colocated else "")
    ranks = devices.trainer_ranks
    trainer += f", {ranks} ranks under torchrun" if ranks > 1 else ", 1 rank"
    parts = [f"inference {inference}", f"trainer {trainer}", "orchestrator CPU"]
    unused = [i for i in range(len(gpus)) if i not in devices.inference and i not in devices.trainer]
    if unused:
        parts.append(f"unused {where(unused)}")
    return "devices: " + " | ".join(parts)


def trainer_command(config_path: Path, num_ranks: int) -> list[str]:
    """`primerl trainer @ config`, under torchrun (one process per rank on this host) when there are several ranks."""
    args = ["trainer", "@", str(config_path)]
    if num_ranks == 1:
        return primerl_command(*args)
    return torchrun_command(num_ranks, ["-m", "primerl.cli", *args])


def build_processes(cfg: RLConfig, run_dir: Path, devices: DeviceAssignment, gpus: list[str]) -> list[ManagedProcess]:
    """Write the three process configs and return their (not yet started) processes: each with its command line, log
    file and environment (its GPUs in CUDA_VISIBLE_DEVICES, NVLink multicast off, the admin token where needed)."""
    host = cfg.inference.host
    port = cfg.inference.port or free_port(host)
    url_host = _url_host(host)
    cfg = cfg.with_devices(devices)
    teacher = cfg.teacher_config(devices)
    if teacher is not None:
        teacher.port = teacher.port or free_port(teacher.host)
    teacher_url = f"http://{_url_host(teacher.host)}:{teacher.port}" if teacher is not None else None
    inference, orchestrator, trainer = cfg.process_configs(devices, base_url=f"http://{url_host}:{port}",
                                                           teacher_url=teacher_url)
    inference.port = port
    config_dir = run_dir / "config"
    write_process_config(config_dir / "inference.toml", inference, exclude={"admin_token", "admin_token_file"})
    write_process_config(config_dir / "orchestrator.toml", orchestrator, exclude={"admin_token"})
    write_process_config(config_dir / "trainer.toml", trainer)
    write_process_config(config_dir / "rl.toml", cfg)

    token = os.environ.get(ADMIN_TOKEN_VAR) or secrets.token_urlsafe(32)
    logs = run_dir / "logs"

    def env(gpu_ids: list[int], with_token: bool) -> dict[str, str]:
        extra = {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i] for i in gpu_ids)}
        if with_token:
            extra[ADMIN_TOKEN_VAR] = token
        return child_environment(extra)

    fork = forks_server_and_trainer(cfg, devices, inference, trainer)
    processes = [
        ManagedProcess("inference", primerl_command("inference", "@", str(config_dir / "inference.toml")),
                       logs / "inference.log", env(devices.inference, with_token=True), fork=fork),
        ManagedProcess("orchestrator", primerl_command("orchestrator", "@", str(config_dir / "orchestrator.toml")),
                       logs / "orchestrator.log", env([], with_token=True)),
        ManagedProcess("trainer", trainer_command(config_dir / "trainer.toml", devices.trainer_ranks),
                       logs / "trainer.log", env(devices.trainer, with_token=False), fork=fork),
    ]
    if teacher is not None:  # the teacher of distillation: a second server, on the policy server's devices
        write_process_config(config_dir / "teacher.toml", teacher, exclude={"admin_token", "admin_token_file"})
        processes.append(ManagedProcess("teacher", primerl_command("inference", "@", str(config_dir / "teacher.toml")),
                                        logs / "teacher.log", env(devices.inference, with_token=False), fork=fork))
    return processes


def _url_host(host: str) -> str:
    """`host` as it goes into a URL: IPv6 in brackets, a wildcard bind address as loopback."""
    return f"[{host}]" if ":" in host else ("127.0.0.1" if host in ("0.0.0.0", "") else host)


# What the server (embedded engine) and the trainer import before their first line of work: torch, transformers'
# model classes, the web stack. The orchestrator imports neither torch nor transformers' models (it starts as a new
# interpreter, at once, while the launcher preloads).
PRELOAD_MODULES = (
    "torch",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "primerl.inference.server",
    "primerl.inference.engines.hf",
    "primerl.inference.engines.llama",
    "primerl.trainer.rl",
    "primerl.trainer.model",
)


def forks_server_and_trainer(cfg: RLConfig, devices: DeviceAssignment, inference: Any, trainer: Any) -> bool:
    """Whether the launcher starts the server and the trainer as forks of itself after `preload` (`rl.preload`): on a
    CPU-only run of the embedded engine and one trainer rank, with both thread counts set (OpenMP's own settings are
    the launcher's once torch is loaded; torch's thread count is set by each process), on Linux. With GPUs the children
    start fresh (no CUDA state may cross a fork), and torchrun starts its ranks itself."""
    return (cfg.preload and sys.platform.startswith("linux") and not devices.inference and not devices.trainer
            and devices.trainer_ranks == 1 and inference.engine == "hf" and inference.threads is not None
            and trainer.train.threads is not None)


def start_processes(processes: Sequence[ManagedProcess], stream, preloaded: bool = False) -> bool:
    """Start `processes`: those started fresh first (the orchestrator starts at once), then, after the launcher
    preloaded what they import, the forked ones. They start fresh instead where this process had torch loaded before
    the preload (it may have run OpenMP work, converting a model on first use: GNU OpenMP's threads do not survive a
    fork, and a child's first parallel region would wait for them) unless `preloaded` says the launcher's own earlier
    preload loaded it (a restart), or where the preload fails (they then report the error themselves). Returns whether
    the forks were started after a preload of this launcher."""
    if "torch" in sys.modules and not preloaded:
        for p in processes:
            p.fork = False
    for p in processes:
        if not p.fork:
            p.start()
    forked = [p for p in processes if p.fork]
    if not forked:
        return preloaded
    try:
        preload(PRELOAD_MODULES)
    except Exception as error:  # noqa: BLE001 -- the processes import the same modules and say what is wrong
        print(f"rl: preloading failed ({type(error).__name__}: {error}); the server and the trainer start as new "
              "interpreters", file=stream, flush=True)
        for p in forked:
            p.fork = False
    for p in forked:
        p.start()
    return all(p.fork for p in forked)


def run_rl(cfg: RLConfig, resume: bool | None = None, stream=sys.stdout) -> int:
    """Run `cfg` to the end; return the exit code (0 done, 1 a process failed, 2 bad setup, 130 interrupted).

    `resume` overrides `cfg.resume`. With `cfg.max_restarts`, a failed or hung run is restarted from its last
    checkpoint (`RestartPolicy`). Callable from Python (recipes) as well as from `rl`'s command line.
    """
    if resume is not None and resume != cfg.resume:
        cfg = cfg.model_copy(update={"resume": resume})
    run_dir = cfg.output_dir.resolve()
    cfg = cfg.model_copy(update={"output_dir": run_dir})
    started = time.time()
    if cfg.resume and (done := trained_steps(run_dir)) >= cfg.max_steps:
        print(f"rl: nothing to do: {run_dir} already trained {done}/{cfg.max_steps} step(s) (a larger max_steps trains "
              "on from the last checkpoint); the run directory is left as it is", file=sys.stderr)
        return 0
    existed = run_dir.exists()
    try:
        check_run_dir(run_dir, cfg.resume)
        require_writable(run_dir)
        gpus = visible_gpus()
        try:
            devices = cfg.assign_devices(len(gpus))
        except ValueError as e:
            raise LaunchError(str(e)) from None
        _prepare_model(cfg)
        processes = build_processes(cfg, run_dir, devices, gpus)
    except LaunchError as e:
        if not existed:
            _remove_if_empty(run_dir)
        print(f"rl: {e}", file=sys.stderr)
        return 2
    print(f"rl: run {run_dir} | model {cfg.model.name} | {count(cfg.max_steps, 'step')} | max_async_steps "
          f"{cfg.max_async_steps} | logs in {run_dir / 'logs'}", file=stream, flush=True)
    print(f"rl: {describe_devices(devices, gpus, cfg.inference.engine)}", file=stream, flush=True)
    if warning := cfg.orchestrator.sampling.biased_ratio_warning():
        print(f"rl: warning: {warning}", file=stream, flush=True)
    if cfg.max_restarts and cfg.trainer.ckpt.interval is None:
        print(f"rl: auto-restart: up to {cfg.max_restarts}; with no periodic checkpoint (trainer.ckpt.interval) a "
              "restart begins again at step 0", file=stream, flush=True)
    policy = RestartPolicy(cfg.max_restarts)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous_term = signal.signal(signal.SIGTERM, raise_terminated) if in_main_thread else None
    console: Console | None = None
    preloaded = False

    def attempt() -> int | Failure:
        nonlocal console, preloaded
        if cfg.resume:
            forget_what_is_redone(run_dir, stream)
        first_step = trained_steps(run_dir) if cfg.resume else 0  # after forget_what_is_redone
        console = Console(run_dir, cfg.max_steps, first_step, stream)
        preloaded = start_processes(processes, stream, preloaded)
        return _supervise(processes, console, cfg, stream, started)

    def failed_process(failure: Failure) -> ManagedProcess | None:
        return next((p for p in processes if p.name == failure.process), None)

    def give_up(failure: Failure, reason: str) -> int:
        failed = failed_process(failure)
        tail = (f"; last lines of {failed.log_path}:\n{failed.tail()}" if failed is not None
                else f"; logs in {run_dir / 'logs'}")
        print(f"rl: {reason}{tail}", file=sys.stderr, flush=True)
        return 1

    def restart(failure: Failure) -> None:
        nonlocal cfg, processes
        if console is not None:
            console.close()
        failed = failed_process(failure)
        last_lines = f"last lines of {failed.log_path}:\n{failed.tail()}" if failed is not None else None
        record_restart(run_dir, policy, failure, last_lines, platform.node())  # every process runs here
        cfg = cfg.model_copy(update={"resume": True})
        processes = build_processes(cfg, run_dir, devices, gpus)

    try:
        return run_with_restarts(policy, attempt, give_up, restart)
    except LaunchError as e:  # a restart's configs could not be written
        print(f"rl: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Terminated):
        stop_quietly("rl")  # a second Ctrl-C or SIGTERM while stopping: one line, no traceback
        print("\nrl: interrupted; stopping the processes", file=sys.stderr, flush=True)
        stop_all(processes, cfg.shutdown_grace_s)
        return EXIT_INTERRUPTED
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous_term)
        stop_all(processes, cfg.shutdown_grace_s)
        if transfer_mode(cfg.weight_transfer).shared_memory and (left := snapshots.release_shared_buffer(run_dir)):
            print(f"rl: removed the trainer's shared weight buffer {left}, which it could not remove itself",
                  file=sys.stderr, flush=True)
        if console is not None:
            console.close()


def _remove_if_empty(run_dir: Path) -> None:
    """A run directory this launch created and a setup error left without a file goes again (its empty
    subdirectories with it): a later fresh run with the same output_dir must not find a leftover."""
    if run_dir.is_dir() and all(path.is_dir() for path in run_dir.rglob("*")):
        shutil.rmtree(run_dir, ignore_errors=True)


def _supervise(processes: list[ManagedProcess], console: Console, cfg: RLConfig, stream,
               started: float) -> int | Failure:
    """Watch the processes until the run ends: its exit code when it finished (0), or the `Failure` of a process that
    died or of a run that made no progress for `cfg.stall_timeout_s` (every process then stopped)."""
    finishers = {"orchestrator", "trainer"}  # the servers (inference, teacher) serve until the launcher stops them

    def steps_done() -> int:
        console.poll()
        return console.steps_done

    failure = watch(processes, name=lambda p: p.name, finishes=lambda p: p.name in finishers,
                    stop=lambda ps: stop_all(ps, cfg.shutdown_grace_s), steps_done=steps_done,
                    progress=Progress(console.path), stall_timeout_s=cfg.stall_timeout_s, tick=console.poll,
                    poll_s=POLL_S)
    if failure is not None:
        return failure
    trained = console.steps_done - console.first_step
    resumed = f" (resumed at step {console.first_step})" if console.first_step else ""
    print(f"rl: done, trained {trained} step(s) to step {console.steps_done}/{cfg.max_steps}{resumed} in "
          f"{time.time() - started:.0f}s; metrics in {cfg.output_dir / METRICS_FILE}", file=stream, flush=True)
    _drop_old_snapshots(cfg, stream)
    return 0


def _drop_old_snapshots(cfg: RLConfig, stream) -> None:
    """After a finished run only the last weight snapshot is of use (the trained model; a resume restores from the
    trainer checkpoint and writes its snapshot again if it is gone): all but the newest `keep_weights_after_run` go.
    Every process has stopped, so nothing reads them any more."""
    if cfg.keep_weights_after_run == 0:
        return
    if removed := snapshots.prune(cfg.output_dir, cfg.keep_weights_after_run):
        print(f"rl: removed the older weight snapshots {removed}; the trained model is "
              f"{snapshots.weights_dir(cfg.output_dir, snapshots.stable_steps(cfg.output_dir)[-1])}",
              file=stream, flush=True)


def _prepare_model(cfg: RLConfig) -> None:
    """Build or convert a registry model (and the teacher's) once here, so the processes that start next all find it
    cached; a model that cannot be found is one line before anything starts."""
    from primerl.models import ModelError, resolve_model

    for what, model in (("", cfg.model), ("teacher: ", cfg.teacher.model if cfg.teacher is not None else None)):
        try:
            if model is not None:
                resolve_model(model.name, model.revision)
        except ModelError as e:
            raise LaunchError(f"{what}{e}") from None
