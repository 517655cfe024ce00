"""`primerl check [recipe.toml]`: the validation checklist — can this machine run this recipe, here and now?

Steps, in order (`--only` / `--skip` pick them by name):

    python       the Python version matches the recipe's pin
    torch        torch imports and sees the GPUs the recipe needs
    flash_attn   flash_attn imports (recipes that train on GPUs)
    disk         the run directory's file system has the free space the recipe asks for
    memory       the host has the memory the recipe asks for
    ports        the TCP ports the run will bind are free
    run_dir      the run directory can be created and written
    model        the model files are present with the pinned hashes
    sft_trainer  `primerl sft` trains one micro-step of configs/debug/fake/sft.toml and saves (recipes with an sft
                 stage, on the recipe's model; without a recipe on the fake config's own model)
    rl_trainer   `primerl trainer` trains one micro-step of configs/debug/fake/rl.toml and saves (on the recipe's model
                 when a recipe is given)
    inference    `primerl inference` serves the recipe's model: /health, /v1/models, one chat completion
    rl_smoke     `primerl rl` runs the recipe's smoke variant (a few steps of the whole stack)

A step ends `passed`, `failed`, or `skipped` with the reason — a step that cannot run on this machine (a GPU step
without a GPU) is skipped, never passed. The heavy steps run the real commands as subprocesses; their output goes to
`<run>/logs/checklist/<step>.log` (`primerl check` and `rl` alike; nothing is left in the temporary directory). The
console gets progress lines and a table; the JSON report (default `<run dir>/checklist.json`) gets every step's
status, detail and duration. Exit code: 0 when nothing failed, 1 when a step failed, 2 on a usage or recipe error.

On a CPU-only machine with two or more cores, `sft_trainer`, `rl_trainer` and `inference` run at the same time (each
is one process of one compute thread with its own files and port; `benchmarks/NOTES.md` has the demo's checklist on
2 cores before and after); with GPUs they run one after the other, so a trainer and a server never
compete for one device's memory. `rl_smoke` always runs after them.

Time limits: the light steps have fixed ones (seconds of work each). The heavy steps have none that a busy machine
can hit: they run as long as the child processes make progress -- new output in their log, or CPU time spent by the
child and everything it started -- and fail only after `--stall-timeout` seconds (default 300) without either, naming
what they were doing. A slow machine slows a child down but it keeps spending CPU; a stuck one does neither.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from primerl.ports import free_port
from primerl.recipes.schema import Recipe, RecipeError, load_recipe, stage_values, validate_stage

if TYPE_CHECKING:
    from primerl.launch.processes import ManagedProcess

Status = Literal["passed", "failed", "skipped"]
PROGRESS_EVERY_S = 15.0
STALL_TIMEOUT_S = 300.0
FAKE_SFT_CONFIG = "configs/debug/fake/sft.toml"
FAKE_RL_CONFIG = "configs/debug/fake/rl.toml"
DEFAULT_RUN_DIR = Path("runs/check")
CHECKLIST_LOGS = Path("logs") / "checklist"  # the heavy steps' logs, inside the run directory
# One optimizer step on a few tokens proves what the trainer steps check: the model loads, steps and saves here.
MICRO_SFT = {"train": {"max_steps": 1}, "data": {"fake_conversations": 2, "rows_per_step": 1, "seq_len": 128}}
MICRO_RL = {"train": {"max_steps": 1}, "data": {"fake_samples": 2, "fake_sample_tokens": 16, "fake_seq_len": 32}}


class Skip(Exception):
    """Raised by a step that cannot run here; the message is the reason."""


class Fail(Exception):
    """Raised by a step whose check did not hold; the message says what was found."""


@dataclass
class StepResult:
    name: str
    status: Status
    detail: str
    seconds: float


@dataclass
class Context:
    """What the steps look at: the recipe (if any), the run directory, where logs go, scratch space for the heavy
    steps' outputs, and probed facts."""

    recipe: Recipe | None
    run_dir: Path
    log_dir: Path
    work_dir: Path
    say: Callable[[str], None]
    stall_timeout_s: float = STALL_TIMEOUT_S
    _torch: dict[str, Any] | None = field(default=None, repr=False)

    def torch_facts(self) -> dict[str, Any]:
        """torch's version and the CUDA devices it sees, probed once in a subprocess (a broken install cannot take
        the checklist down with it)."""
        if self._torch is None:
            probe = (
                "import json, torch; c = torch.cuda.is_available(); n = torch.cuda.device_count() if c else 0; "
                "print(json.dumps({'version': torch.__version__, 'cuda': torch.version.cuda, 'gpus': "
                "[{'name': torch.cuda.get_device_name(i), 'memory_gb': "
                "round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)} for i in range(n)]}))"
            )
            self._torch = json.loads(_python_child(probe, failed="import torch failed: {}"))
        return self._torch

    @property
    def gpu_count(self) -> int:
        return len(self.torch_facts()["gpus"])

    def gpu_recipe(self) -> bool:
        """The recipe trains on GPUs (it asks for some, whether or not it may also run on CPU)."""
        return self.recipe is not None and self.recipe.info.hardware.gpus_per_node > 0

    def concurrent_ok(self) -> bool:
        """Whether the concurrent steps may run together here: a CPU run on a machine without GPUs and with at least
        two cores (on a GPU, a trainer and a server that share a device would compete for its memory)."""
        if self.gpu_recipe() or (os.cpu_count() or 1) < 2:
            return False
        try:
            return self.gpu_count == 0
        except Fail:  # torch does not import: the steps fail one after the other, each with the reason
            return False

    def require_runnable_here(self) -> None:
        """Skip a heavy step for a recipe that needs GPUs this machine does not have."""
        hw = self.recipe.info.hardware if self.recipe else None
        if hw is not None and hw.needs_gpu and self.gpu_count < hw.gpus_per_node:
            raise Skip(f"the recipe needs {hw.gpus_per_node} GPU(s) per node; this machine has {self.gpu_count}")


@dataclass(frozen=True)
class Step:
    name: str
    summary: str
    timeout_s: float | None  # None: no fixed limit; the step fails when its child stops making progress
    run: Callable[[Context], str]  # returns the detail of a pass; raises Skip or Fail
    writes_logs: bool = False  # the step starts children whose logs go to the log directory
    # May run at the same time as the neighbouring steps marked so, where `Context.concurrent_ok` (each starts one
    # process of one thread on the CPU, with its own files and port).
    concurrent: bool = False

    def limit(self, stall_timeout_s: float) -> str:
        if self.timeout_s is None:
            return f"fails after {stall_timeout_s:.0f} s without progress"
        return f"timeout {self.timeout_s:.0f} s"


# ---------------------------------------------------------------------------------------------------------------------
# Steps


def check_python(ctx: Context) -> str:
    from primerl.recipes.pins import python_matches, python_version

    found = python_version()
    if ctx.recipe is None:
        return f"Python {found} (no recipe, no pin to match)"
    pinned = ctx.recipe.pins.python
    if not python_matches(pinned, found):
        raise Fail(f"Python {found}, the recipe pins {pinned}")
    return f"Python {found} matches the pin {pinned}"


def check_torch(ctx: Context) -> str:
    facts = ctx.torch_facts()
    gpus = facts["gpus"]
    seen = f"torch {facts['version']}, {len(gpus)} GPU(s)" + (f": {gpus[0]['name']}" if gpus else "")
    hw = ctx.recipe.info.hardware if ctx.recipe else None
    if hw is None or hw.gpus_per_node == 0:
        return seen
    enough = [g for g in gpus if g["memory_gb"] >= hw.gpu_memory_gb]
    if len(enough) >= hw.gpus_per_node:
        return f"{seen}; the recipe needs {hw.gpus_per_node} with {hw.gpu_memory_gb:g} GiB"
    if hw.cpu_allowed and not gpus:
        return f"{seen}; the recipe will run on CPU (it asks for {hw.gpus_per_node} GPU(s) but allows CPU)"
    raise Fail(f"{seen}; the recipe needs {hw.gpus_per_node} GPU(s) with >= {hw.gpu_memory_gb:g} GiB each")


def check_flash_attn(ctx: Context) -> str:
    if ctx.recipe is not None and not ctx.gpu_recipe():
        raise Skip("CPU recipe: flash-attn is not used")
    if ctx.gpu_count == 0:
        raise Skip("no CUDA GPU on this machine")
    version = _python_child("import flash_attn; print(flash_attn.__version__)", failed="import flash_attn failed: {}")
    return f"flash_attn {version}"


def check_disk(ctx: Context) -> str:
    need = ctx.recipe.info.hardware.min_disk_gb if ctx.recipe else 1.0
    folder = ctx.run_dir.resolve()
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free / 2**30
    if free < need:
        raise Fail(f"{free:.1f} GiB free under {folder}, the recipe needs {need:g} GiB")
    return f"{free:.1f} GiB free under {folder} (needs {need:g})"


def check_memory(ctx: Context) -> str:
    from primerl.recipes.manifest import memory_gb

    need = ctx.recipe.info.hardware.min_memory_gb if ctx.recipe else 0.0
    total = memory_gb()
    if total is None:
        raise Skip("cannot read the host's memory size")
    if total < need:
        raise Fail(f"{total:g} GiB of memory, the recipe needs {need:g} GiB")
    return f"{total:g} GiB of memory (needs {need:g})"


def check_ports(ctx: Context) -> str:
    ports = sorted(set(_ports_of(_stage_tree(ctx)))) if ctx.recipe else []
    if not ports:
        return "the run binds no fixed port (servers pick a free one)"
    busy = [p for p in ports if not _port_free(p)]
    if busy:
        raise Fail(f"port(s) {busy} are in use")
    return f"port(s) {ports} are free"


def check_run_dir(ctx: Context) -> str:
    try:
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        probe = ctx.run_dir / f".checklist-probe-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise Fail(f"{ctx.run_dir} is not writable: {e.strerror or e}") from None
    return f"{ctx.run_dir} is writable"


def check_model(ctx: Context) -> str:
    from primerl.recipes.pins import PinReport, verify_model

    if ctx.recipe is None:
        raise Skip("no recipe given: no pinned model")
    report = PinReport()
    verify_model(ctx.recipe, report, ctx.say)
    if report.drifted:
        raise Fail("; ".join(c.line() for c in report.drifted))
    files = [c for c in report.checks if c.name.startswith("model file")]
    unpinned = [c for c in report.checks if c.status == "unpinned"]
    note = f"; {len(unpinned)} pin(s) unpinned (present, not verified)" if unpinned else ""
    return f"{ctx.recipe.pins.model.source}: {len(files) - len(unpinned)} file(s) match their pins{note}"


ENV_PROBE = (
    "import sys\n"
    "from primerl.config.orchestrator import EnvSection\n"
    "from primerl.orchestrator.rollouts import EnvConfigError, probe_env\n"
    "try:\n"
    "    print(probe_env(EnvSection.model_validate_json(sys.argv[1])))\n"
    "except EnvConfigError as e:\n"
    "    sys.exit(str(e))\n"
)


def check_environment(ctx: Context) -> str:
    """The rl stage's environment loads with the recipe's `env.args` and yields a task: seconds, in a child process
    (verifiers stays out of the checklist's own), instead of a failed smoke run a minute later."""
    if ctx.recipe is None:
        raise Skip("no recipe given: no environment to load")
    if "rl" not in ctx.recipe.stages:
        raise Skip("the recipe has no rl stage")
    section = validate_stage(ctx.recipe, "rl").orchestrator.env
    return _python_child(ENV_PROBE, section.model_dump_json(), failed="[rl.orchestrator.env] {}")


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
    return f"primerl {command} @ {fake_config}: one micro-step{on}, saved"


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

    from primerl.launch.processes import ManagedProcess, child_environment, primerl_command, stop_all

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
                    raise Fail(f"the server exited with code {server.poll()}: {_last_line(server.tail())}")
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


STEPS: tuple[Step, ...] = (
    Step("python", "Python version matches the pin", 10, check_python),
    Step("torch", "torch imports and sees the GPUs the recipe needs", 330, check_torch),
    Step("flash_attn", "flash_attn imports (GPU recipes)", 330, check_flash_attn),
    Step("disk", "free disk space for the run directory", 10, check_disk),
    Step("memory", "host memory", 10, check_memory),
    Step("ports", "the ports the run binds are free", 10, check_ports),
    Step("run_dir", "the run directory is writable", 30, check_run_dir),
    Step("model", "model files present with the pinned hashes", 1800, check_model),
    Step("environment", "the rl stage's environment loads with the recipe's env.args", 330, check_environment),
    Step("sft_trainer", f"primerl sft trains one micro-step of {FAKE_SFT_CONFIG} and saves",
         None, check_sft_trainer, writes_logs=True, concurrent=True),
    Step("rl_trainer", f"primerl trainer trains one micro-step of {FAKE_RL_CONFIG} and saves",
         None, check_rl_trainer, writes_logs=True, concurrent=True),
    Step("inference", "the inference server answers /health, /v1/models and a chat request",
         None, check_inference, writes_logs=True, concurrent=True),
    Step("rl_smoke", "the full RL stack runs the recipe's smoke variant",
         None, check_rl_smoke, writes_logs=True),
)
STEP_NAMES = tuple(s.name for s in STEPS)


# ---------------------------------------------------------------------------------------------------------------------
# Helpers of the steps


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def _python_child(code: str, *args: str, failed: str) -> str:
    """Run `code` in a child Python (what it imports cannot break the checklist's own process) and return the last
    line it printed; a non-zero exit fails the step with `failed`, its "{}" filled with the last line of the child's
    stderr."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300,
                          check=False)
    if proc.returncode != 0:
        raise Fail(failed.format(_last_line(proc.stderr)))
    return _last_line(proc.stdout)


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
    from primerl.launch.processes import ManagedProcess, child_environment, primerl_command, stop_all

    proc = ManagedProcess(name, primerl_command(*args), ctx.log_dir / f"{name}.log", env=child_environment())
    proc.start()
    watch = ProgressWatch(proc, ctx.stall_timeout_s)
    try:
        while proc.poll() is None:
            _follow(ctx, watch, f"running primerl {args[0]}")
            time.sleep(0.5)
    finally:
        stop_all([proc], grace_s=10)
    if proc.poll() != 0:
        raise Fail(f"exit code {proc.poll()}: {_last_line(proc.tail())[:300]} (log: {proc.log_path})")


def _follow(ctx: Context, watch: ProgressWatch, doing: str) -> None:
    """One look at a running child: a progress line every PROGRESS_EVERY_S, Fail when it stalled."""
    watch.sample()
    if watch.stalled():
        raise Fail(f"no progress for {watch.stall_timeout_s:.0f} s while {doing}: no new output and no CPU time "
                   f"spent; last output: {_last_line(watch.proc.tail(5))[:200]} (log: {watch.proc.log_path})")
    if watch.heartbeat_due():
        ctx.say(f"{watch.proc.name}: {watch.report()}")


class ProgressWatch:
    """Is a child process still making progress? Progress is new output in its log, or CPU time spent by the child
    and every process it started (the three processes under `rl`, for one). On a busy machine a child runs slowly but
    keeps spending CPU; a stuck child (a deadlock, a wait on something that never comes) spends almost none, and the
    few milliseconds of an idle poll loop stay far below `MIN_CPU_S` per `SAMPLE_EVERY_S`."""

    SAMPLE_EVERY_S = 5.0
    MIN_CPU_S = 0.1

    def __init__(self, proc: ManagedProcess, stall_timeout_s: float):
        self.proc = proc
        self.stall_timeout_s = stall_timeout_s
        now = time.monotonic()
        self.started = self.last_output = self.last_working = self.last_sample = self.last_heartbeat = now
        self.log_size = self._log_size()
        self.cpu_s = tree_cpu_seconds(proc.pid) or 0.0
        self.heartbeat_output = self.log_size  # the log's size at the last heartbeat

    def _log_size(self) -> int:
        try:
            return self.proc.log_path.stat().st_size
        except OSError:
            return 0

    def sample(self) -> None:
        now = time.monotonic()
        if now - self.last_sample < self.SAMPLE_EVERY_S:
            return
        self.last_sample = now
        size, cpu_s = self._log_size(), tree_cpu_seconds(self.proc.pid)
        if size != self.log_size:
            self.log_size, self.last_output = size, now
        if cpu_s is not None and cpu_s - self.cpu_s >= self.MIN_CPU_S:
            self.last_working = now
        self.cpu_s = max(self.cpu_s, cpu_s or 0.0)

    def stalled(self) -> bool:
        return time.monotonic() - max(self.last_output, self.last_working) > self.stall_timeout_s

    def heartbeat_due(self) -> bool:
        now = time.monotonic()
        if now - self.last_heartbeat < PROGRESS_EVERY_S:
            return False
        self.last_heartbeat = now
        return True

    def report(self) -> str:
        """What changed since the last report: `42 s, 37 CPU-s; <newest log line>` when there is new output, else
        `...; no new output for 30 s` (and `, idle for 20 s` when the processes spend no CPU either)."""
        now = time.monotonic()
        head = f"{now - self.started:.0f} s, {self.cpu_s:.0f} CPU-s"
        if self.log_size != self.heartbeat_output:
            self.heartbeat_output = self.log_size
            return f"{head}; {_last_line(self.proc.tail(5))[:100]}"
        idle = now - self.last_working
        return f"{head}; no new output for {now - self.last_output:.0f} s" + (
            f", idle for {idle:.0f} s" if idle > self.SAMPLE_EVERY_S else "")


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) spent by process `pid`, its descendants, and the children they have reaped, read
    from /proc; None where there is no /proc (then only the log shows progress)."""
    stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu seconds)
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return None
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rpartition(b")")[2].split()
        except OSError:  # gone meanwhile
            continue
        stats[int(entry)] = (int(fields[1]), sum(int(v) for v in fields[11:15]) / tick)
    if pid not in stats:
        return None
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += stats[current][1]
        todo += children.get(current, [])
    return total


def _stage_tree(ctx: Context) -> dict[str, Any]:
    assert ctx.recipe is not None
    return {name: stage_values(ctx.recipe, name, run_dir=ctx.run_dir) for name in ctx.recipe.stages}


def _ports_of(node: Any) -> Iterator[int]:
    """Every non-zero integer `port` in a config tree."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "port" and isinstance(value, int) and value > 0:
                yield value
            else:
                yield from _ports_of(value)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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


# ---------------------------------------------------------------------------------------------------------------------
# Running the checklist


@dataclass
class ChecklistReport:
    recipe: str | None
    run_dir: str
    steps: list[StepResult]
    log_dir: str | None = None  # where the heavy steps' logs are
    seconds: float | None = None  # wall time of all the steps (less than their sum where some ran together)

    @property
    def failed(self) -> list[StepResult]:
        return [s for s in self.steps if s.status == "failed"]

    def statuses(self) -> dict[str, Status]:
        return {s.name: s.status for s in self.steps}

    def as_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "run_dir": self.run_dir, "ok": not self.failed, "log_dir": self.log_dir,
                "seconds": self.seconds, "steps": [asdict(s) for s in self.steps]}

    def table(self) -> str:
        width = max(len(s.name) for s in self.steps) if self.steps else 4
        rows = [f"{'step'.ljust(width)}  status   seconds  detail"]
        rows += [f"{s.name.ljust(width)}  {s.status.ljust(7)}  {s.seconds:7.1f}  {s.detail}" for s in self.steps]
        if self.seconds is not None:
            rows.append(f"{'all'.ljust(width)}           {self.seconds:7.1f}  wall time of the checklist")
        return "\n".join(rows)


def select_steps(only: Sequence[str] = (), skip: Sequence[str] = ()) -> list[Step]:
    unknown = [n for n in (*only, *skip) if n not in STEP_NAMES]
    if unknown:
        raise ValueError(f"unknown step(s) {unknown}; steps: {', '.join(STEP_NAMES)}")
    return [s for s in STEPS if (not only or s.name in only) and s.name not in skip]


def run_checklist(recipe: Recipe | None, run_dir: Path, steps: Sequence[Step], log_dir: Path | None = None,
                  out=sys.stdout, stall_timeout_s: float = STALL_TIMEOUT_S) -> ChecklistReport:
    """Run `steps` in order; never raises for a failing step. The heavy steps' logs go to `log_dir` and are kept;
    without one, to a temporary directory that is removed when every step passed or was skipped and kept, named, when
    one failed. Their outputs go to a scratch directory removed at the end."""
    if not any(step.writes_logs for step in steps):  # only light steps: no log directory is made
        report = _run_steps(recipe, run_dir, steps, Path(tempfile.gettempdir()), out, stall_timeout_s)
        report.log_dir = None
        return report
    try:
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable run directory: the run_dir step says why; the logs go to scratch meanwhile
        log_dir = None
    if log_dir is None:
        scratch_logs = Path(tempfile.mkdtemp(prefix="primerl-checklist-logs-"))
        report = run_checklist(recipe, run_dir, steps, scratch_logs, out, stall_timeout_s)
        if report.failed:
            print(f"checklist logs: {scratch_logs}", file=out, flush=True)
        else:
            shutil.rmtree(scratch_logs, ignore_errors=True)
            report.log_dir = None
        return report
    return _run_steps(recipe, run_dir, steps, log_dir, out, stall_timeout_s)


def _run_steps(recipe: Recipe | None, run_dir: Path, steps: Sequence[Step], log_dir: Path, out,
               stall_timeout_s: float) -> ChecklistReport:
    def say(message: str) -> None:
        print(f"        {message}", file=out, flush=True)

    results = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="primerl-checklist-") as work_dir:
        ctx = Context(recipe=recipe, run_dir=run_dir, log_dir=log_dir, work_dir=Path(work_dir), say=say,
                      stall_timeout_s=stall_timeout_s)
        for group in _groups(steps, ctx):
            first = len(results) + 1
            if len(group) == 1:
                print(f"[{first}/{len(steps)}] {group[0].name}: {group[0].summary} ...", file=out, flush=True)
                result = _run_step(group[0], ctx)
                print(f"        {result.status}: {result.detail} ({result.seconds:.1f} s)", file=out, flush=True)
                results.append(result)
                continue
            for i, step in enumerate(group, first):
                print(f"[{i}/{len(steps)}] {step.name}: {step.summary} ... (together with "
                      f"{', '.join(other.name for other in group if other is not step)})", file=out, flush=True)
            with ThreadPoolExecutor(len(group), thread_name_prefix="checklist") as pool:
                running = {pool.submit(_run_step, step, ctx): step for step in group}
                done: dict[str, StepResult] = {}
                for future in as_completed(running):
                    result = future.result()
                    print(f"        {result.name} {result.status}: {result.detail} ({result.seconds:.1f} s)",
                          file=out, flush=True)
                    done[result.name] = result
            results.extend(done[step.name] for step in group)
    return ChecklistReport(str(recipe.path) if recipe else None, str(run_dir), results, str(log_dir),
                           round(time.monotonic() - started, 1))


def _groups(steps: Sequence[Step], ctx: Context) -> Iterator[list[Step]]:
    """`steps` in order, neighbouring concurrent steps together where the machine allows it, each other step alone."""
    together = None  # decided at the first concurrent step, after the torch step has probed the machine
    group: list[Step] = []
    for step in steps:
        if step.concurrent and (together if together is not None else (together := ctx.concurrent_ok())):
            group.append(step)
            continue
        if group:
            yield group
            group = []
        yield [step]
    if group:
        yield group


def _run_step(step: Step, ctx: Context) -> StepResult:
    """Run one step in a worker thread so a fixed timeout holds even for in-process work (steps without one watch
    their child's progress themselves)."""
    outcome: list[tuple[Status, str]] = []

    def work() -> None:
        try:
            outcome.append(("passed", step.run(ctx)))
        except Skip as e:
            outcome.append(("skipped", str(e)))
        except Fail as e:
            outcome.append(("failed", str(e)))
        except Exception as e:  # noqa: BLE001 -- a step that crashes is a failed step, reported with its error
            outcome.append(("failed", f"{type(e).__name__}: {e}"))

    started = time.monotonic()
    worker = threading.Thread(target=work, name=f"check-{step.name}", daemon=True)
    worker.start()
    worker.join(step.timeout_s)
    seconds = round(time.monotonic() - started, 1)
    if not outcome:
        return StepResult(step.name, "failed", f"timed out after {step.timeout_s:.0f} s", seconds)
    status, detail = outcome[0]
    return StepResult(step.name, status, detail, seconds)


def write_report(report: ChecklistReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    tmp.replace(path)


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="primerl check",
        description="Run the validation checklist: can this machine run the recipe? Steps: " + ", ".join(STEP_NAMES),
    )
    parser.add_argument("recipe", nargs="?", help="recipe file (pins, hardware and smoke variant to check against)")
    parser.add_argument("--only", type=_names, default=[], help="comma-separated steps to run (default: all)")
    parser.add_argument("--skip", type=_names, default=[], help="comma-separated steps to leave out")
    parser.add_argument("--run-dir", type=Path, help=f"run directory to check (default: runs/<recipe> or {DEFAULT_RUN_DIR})")
    parser.add_argument("--report", type=Path, help="JSON report path (default: <run dir>/checklist.json)")
    parser.add_argument("--stall-timeout", type=float, default=STALL_TIMEOUT_S, metavar="S",
                        help="fail a heavy step after S seconds without progress: no new output and no CPU time spent "
                        f"by its processes (default {STALL_TIMEOUT_S:.0f})")
    parser.add_argument("--list", action="store_true", help="list the steps and exit")
    args = parser.parse_args(argv)
    if args.list:
        for step in STEPS:
            print(f"{step.name:12s} {step.summary} ({step.limit(args.stall_timeout)})")
        return 0
    try:
        steps = select_steps(args.only, args.skip)
        recipe = load_recipe(args.recipe) if args.recipe else None
        if recipe is not None:
            recipe.require_supported()
    except (ValueError, RecipeError) as e:
        print(f"primerl check: error: {e}", file=sys.stderr)
        return 2
    run_dir = args.run_dir or (Path("runs") / recipe.name if recipe else DEFAULT_RUN_DIR)
    if args.stall_timeout <= 0:
        print("primerl check: error: --stall-timeout must be positive", file=sys.stderr)
        return 2
    report = run_checklist(recipe, run_dir, steps, log_dir=run_dir / CHECKLIST_LOGS,
                           stall_timeout_s=args.stall_timeout)
    print("\n" + report.table())
    report_path = args.report or run_dir / "checklist.json"
    try:
        write_report(report, report_path)
        print(f"report: {report_path}")
    except OSError as e:
        print(f"primerl check: cannot write the report {report_path}: {e}", file=sys.stderr)
        return 1
    if report.failed:
        print(f"primerl check: failed: {', '.join(s.name for s in report.failed)} (logs: {report.log_dir})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
