"""The plan every remote launcher carries out: which process of an RL run goes on which host with which command,
and the files the run directory gets before anything starts. A target (`ssh.py`, `slurm.py`) only decides how a
command reaches a host; a new target is one more module over this one.

A plan is pure: building it contacts no host and writes nothing. Hosts are names; `address_of(host)` gives the
address other hosts reach it at (an SSH host's `address`, or a shell variable a Slurm job sets from its node list).

Processes, for `[deploy.roles]` inference = [a, b], orchestrator = a, trainer = [c, d]:

    inference.0@a   primerl inference @ config/inference.toml --host <a> --port 8000
    inference.1@b   primerl inference @ config/inference.toml --host <b> --port 8000
    orchestrator@a  primerl orchestrator @ config/orchestrator.toml          (client.base_urls: both servers)
    trainer.0@c     torchrun --nnodes 2 --node-rank 0 --master-addr <c> ... -m primerl.cli trainer @ config/trainer.toml
    trainer.1@d     the same with --node-rank 1

Each runs under `primerl.launch.remote`, which logs to `<run>/logs/<label>.log`, streams the output back, and stops
the process (its whole process group) when the launcher says so or the connection to the launcher drops.
"""

from __future__ import annotations

import json
import secrets
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pydantic

from primerl.config.base import Section
from primerl.config.deploy import DeployConfig
from primerl.config.loader import ConfigError, Layers, read_toml, validate
from primerl.launch.console import count
from primerl.launch.images import PROJECT_ROOT
from primerl.multicast import multicast_off
from primerl.recipes.schema import Recipe, RecipeError
from primerl.recipes.stages import validate_stage
from primerl.transport.weight_transfer.modes import Unsupported, transfer_mode

ADMIN_TOKEN_FILE = "config/admin_token"
IMAGE_PROJECT_DIR = "/opt/primerl"  # the project inside primerl's images (docker/*.Dockerfile WORKDIR)


class PlanError(Exception):
    """A deployment that cannot work as written; the message is one line naming the key or host."""


class _DeployFile(Section):
    deploy: DeployConfig


def load_deploy(recipe: Recipe, deploy_files: Sequence[Path] = (), run_dir: str | None = None,
                target: str | None = None, accept_new_host_keys: bool | None = None) -> DeployConfig:
    """The recipe's `[deploy]` table, deep-merged with each file's `[deploy]` table (left to right), then `run_dir`,
    `target` and `accept_new_host_keys` from the command line; validated. PlanError names the bad key and the file it
    came from."""
    layers = Layers()
    if recipe.deploy:
        layers.merge({"deploy": recipe.deploy}, str(recipe.path))
    try:
        for path in deploy_files:
            data = read_toml(path)
            unknown = sorted(set(data) - {"deploy"})
            if unknown:
                raise PlanError(f"{path}: unknown table(s) {unknown}: a deploy file holds one [deploy] table")
            layers.merge(data, str(path))
        command_line = {k: v for k, v in (("run_dir", run_dir), ("target", target),
                                          ("accept_new_host_keys", accept_new_host_keys)) if v is not None}
        layers.merge({"deploy": command_line}, "the command line")
        if "deploy" not in layers.values or set(layers.values["deploy"]) <= set(command_line):
            raise PlanError(f"{recipe.path}: no [deploy] table: add one to the recipe or pass --deploy FILE")
        return validate(_DeployFile, layers).deploy
    except ConfigError as e:
        raise PlanError(str(e)) from None


@dataclass(frozen=True)
class RoleProcess:
    """One process of the run on one host. `args` follow the Python interpreter (`-m primerl.cli ...`)."""

    role: str  # inference | orchestrator | trainer
    host: str
    index: int  # server number, or trainer node rank
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    needs_token: bool = False

    @property
    def label(self) -> str:
        return f"orchestrator@{self.host}" if self.role == "orchestrator" else f"{self.role}.{self.index}@{self.host}"

    @property
    def finishes(self) -> bool:
        """Orchestrator and trainer end by themselves when the run is done; inference serves until stopped."""
        return self.role != "inference"


@dataclass(frozen=True)
class Software:
    """How a host runs primerl's Python: the project's uv environment, or the pinned image by id."""

    kind: str  # uv | image
    project_dir: str  # on the hosts (inside the image for kind = image)
    image: str | None
    run_dir: str
    gpus: bool

    @property
    def python(self) -> str:
        return f"{self.project_dir}/.venv/bin/python" if self.kind == "uv" else "python"

    def argv(self, args: Sequence[str], env: Mapping[str, str]) -> list[str]:
        """The program and arguments that run `python <args>` on a host with `env` added, from `project_dir`."""
        if self.kind == "uv":
            return ["env", *(f"{k}={v}" for k, v in env.items()), self.python, *args]
        docker = ["docker", "run", "--rm", "-i", "--init", "--network", "host", "--user", "$UID_GID",
                  "-v", f"{self.run_dir}:{self.run_dir}", "-w", self.project_dir,
                  "-e", "HOME=/tmp", "-e", f"PRIMERL_CACHE={self.run_dir}/.cache/primerl",
                  "-e", f"PRIMERL_IMAGE_ID={self.image}"]
        if self.gpus:
            docker += ["--gpus", "all", "--ipc", "host"]
        for k, v in env.items():
            docker += ["-e", f"{k}={v}"]
        return [*docker, str(self.image), "python", *args]

    def shell(self, args: Sequence[str], env: Mapping[str, str]) -> str:
        """`argv` as one POSIX shell command line, run from the project (for SSH, which runs a shell)."""
        words = " ".join(shlex.quote(w) for w in self.argv(args, env))
        words = words.replace("$UID_GID", '"$(id -u):$(id -g)"')
        return f"cd {shlex.quote(self.project_dir)} && exec {words}" if self.kind == "uv" else f"exec {words}"


@dataclass(frozen=True)
class LaunchPlan:
    recipe: Recipe
    deploy: DeployConfig
    software: Software
    recipe_on_hosts: str  # the recipe's path as the hosts see it
    files: Mapping[str, str]  # run-directory-relative path -> text, written before anything starts
    admin_token: str = field(repr=False)
    processes: tuple[RoleProcess, ...]
    max_steps: int
    host_env: Mapping[str, Mapping[str, str]]  # per host: the environment everything there gets
    resume_files: Mapping[str, str] = field(default_factory=dict)  # the process configs of a resumed run (a restart)
    max_restarts: int = 0  # the rl stage's: restarts of the whole run after a process failed or the run hung
    stall_timeout_s: float = 0.0  # the rl stage's: no new metrics record for this long is a hung run (0: never)
    checkpoint_interval: int | None = None  # the trainer's: a restart resumes from the newest of these checkpoints
    overrides: Mapping[str, Any] = field(default_factory=dict)  # the command line's stage options, {"rl": {...}}

    @property
    def run_dir(self) -> str:
        return self.deploy.run_dir

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(p.host for p in self.processes))

    def path(self, relative: str) -> str:
        return str(PurePosixPath(self.run_dir) / relative)

    def log_path(self, process: RoleProcess) -> str:
        return self.path(f"logs/{process.label}.log")

    def supervised_args(self, process: RoleProcess) -> list[str]:
        """`process` under `primerl.launch.remote` (log file, token, stop on request or lost connection)."""
        args = ["-m", "primerl.launch.remote", "--log", self.log_path(process),
                "--grace", str(self.deploy.shutdown_grace_s)]
        if process.needs_token:
            args += ["--token-file", self.path(ADMIN_TOKEN_FILE)]
        return [*args, "--", *process.args]

    def checklist_log_dir(self, host: str) -> str:
        return self.path(f"logs/checklist/{host}")

    def checklist_args(self, host: str) -> list[str]:
        """`primerl check` on `host`: its report in `<run>/checklist/<host>.json`, its heavy steps' configs and logs in
        `<run>/logs/checklist/<host>/` (hosts share the run directory; their checklists must not share files)."""
        args = ["-m", "primerl.cli", "check", self.recipe_on_hosts, "--run-dir", self.run_dir,
                "--report", self.path(f"checklist/{host}.json"), "--log-dir", self.checklist_log_dir(host)]
        if self.deploy.checklist_skip:
            args += ["--skip", ",".join(self.deploy.checklist_skip)]
        return args

    def record(self, checklist: Mapping[str, Mapping[str, str]] | None = None) -> str:
        """`<run>/launch/plan.json`: what ran where, with which software and pins, the command line's stage options
        and each host's checklist (the run's manifest, `primerl.launch.manifest`, is built from it on the first
        host)."""
        sw = self.software
        return json.dumps({
            "recipe": {"name": self.recipe.name, "path": self.recipe_on_hosts,
                       "lock_sha256": self.recipe.pins.lock_sha256},
            "overrides": json.loads(json.dumps(dict(self.overrides), default=str)),
            "software": {"kind": sw.kind, "project_dir": sw.project_dir, "image": sw.image},
            "hosts": {h: self.deploy.hosts[h].address for h in self.hosts if h in self.deploy.hosts},
            "processes": [{"label": p.label, "role": p.role, "host": p.host, "args": list(p.args)}
                          for p in self.processes],
            "checklist": dict(checklist or {}),
        }, indent=2) + "\n"

    def describe(self) -> str:
        """The plan as text (`--dry-run`): software, files, then each process with its host and command."""
        sw = self.software
        where = f"uv environment {sw.python}" if sw.kind == "uv" else f"image {sw.image}"
        lines = [(f"plan: recipe {self.recipe.name} ({self.recipe_on_hosts}) | {count(self.max_steps, 'step')} | run dir "
                  f"{self.run_dir} | {where}"),
                 f"checklist on every host: {' '.join(self.checklist_args('<host>')[2:])}",
                 "files: " + ", ".join(sorted(self.files)) + f", {ADMIN_TOKEN_FILE} (0600)"]
        width = max(len(p.label) for p in self.processes)
        for p in self.processes:
            env = " ".join(f"{k}={v}" for k, v in p.env.items() if k not in _QUIET_ENV)
            lines.append(f"  {p.label.ljust(width)}  {(env + ' ') if env else ''}python {shlex.join(p.args)}")
        return "\n".join(lines)


_QUIET_ENV = {"PYTHONUNBUFFERED", *multicast_off({})}


def recipe_path_on_hosts(recipe: Recipe, project_dir: str) -> tuple[str, dict[str, str]]:
    """Where the hosts find the recipe: inside the deployed project when the recipe is part of it, else a copy put
    into the run directory (returned as a file to write). Paths are relative to this checkout."""
    try:
        relative = recipe.path.relative_to(PROJECT_ROOT)
    except ValueError:
        copy = f"launch/{recipe.path.name}"
        return copy, {copy: recipe.path.read_text()}
    return str(PurePosixPath(project_dir) / relative.as_posix()), {}


def build_plan(recipe: Recipe, deploy: DeployConfig, overrides: Mapping[str, Any] | None = None,
               address_of: Callable[[str], str] | None = None, gpus: bool | None = None) -> LaunchPlan:
    """The plan for `recipe`'s RL stage over `deploy.roles`. PlanError for what cannot work."""
    from primerl.config.rl import DeviceAssignment

    if deploy.roles is None:
        raise PlanError("deploy.roles: missing (which hosts run inference, orchestrator and trainer)")
    if recipe.info.stages != ["rl"]:
        raise PlanError(f"{recipe.path}: launch runs RL recipes (stages = ['rl']); this one has {recipe.info.stages}")
    roles = deploy.roles
    address_of = address_of or (lambda host: deploy.hosts[host].address)
    gpus = recipe.info.hardware.needs_gpu if gpus is None else gpus
    run_dir = Path(deploy.run_dir)
    try:
        cfg = validate_stage(recipe, "rl", run_dir=run_dir, overrides=(overrides or {}).get("rl"))
    except RecipeError as e:
        raise PlanError(str(e)) from None
    if cfg.teacher is not None:
        raise PlanError("rl.teacher: launch does not start a teacher server yet; run distillation with `rl` on one "
                        "machine")
    try:
        transfer_mode(cfg.weight_transfer).check_hosts("rl.weight_transfer")
    except Unsupported as e:
        raise PlanError(str(e)) from None

    software = _software(recipe, deploy, gpus)
    recipe_on_hosts, files = recipe_path_on_hosts(recipe, software.project_dir)
    if not recipe_on_hosts.startswith("/"):
        recipe_on_hosts = str(PurePosixPath(deploy.run_dir) / recipe_on_hosts)

    world = len(roles.trainer) * roles.trainer_ranks_per_host
    servers = _servers(roles.inference, roles.inference_port)
    urls = [f"http://{_url_host(address_of(host))}:{port}" for host, port in servers]
    devices = DeviceAssignment([0] if gpus else [], list(range(world)) if gpus else [])
    files.update(_process_config_files(cfg, devices, urls, world))
    resume_files = _process_config_files(cfg.model_copy(update={"resume": True}), devices, urls, world)
    config = PurePosixPath(deploy.run_dir) / "config"

    host_env = {host: _host_env(deploy, host, gpus) for host in dict.fromkeys(
        [*roles.inference, roles.orchestrator, *roles.trainer])}
    processes = []
    per_host: dict[str, int] = {}
    for i, (host, port) in enumerate(servers):
        slot = per_host[host] = per_host.get(host, -1) + 1
        env = dict(host_env[host], **({"CUDA_VISIBLE_DEVICES": str(slot)} if gpus else {}))
        processes.append(RoleProcess(
            "inference", host, i,
            ("-m", "primerl.cli", "inference", "@", str(config / "inference.toml"),
             "--host", address_of(host), "--port", str(port)),
            env, needs_token=True))
    # the servers' URLs on the command line too: a Slurm job knows its nodes' names only when it runs
    servers_option = ("--client.base_url", urls[0]) if len(urls) == 1 else ("--client.base_urls", json.dumps(urls))
    processes.append(RoleProcess(
        "orchestrator", roles.orchestrator, 0,
        ("-m", "primerl.cli", "orchestrator", "@", str(config / "orchestrator.toml"), *servers_option),
        dict(host_env[roles.orchestrator], CUDA_VISIBLE_DEVICES=""), needs_token=True))
    trainer_program = ("-m", "primerl.cli", "trainer", "@", str(config / "trainer.toml"))
    for rank, host in enumerate(roles.trainer):
        args = trainer_program if world == 1 else (
            "-m", "torch.distributed.run", f"--nnodes={len(roles.trainer)}", f"--node-rank={rank}",
            f"--nproc-per-node={roles.trainer_ranks_per_host}", f"--master-addr={address_of(roles.trainer[0])}",
            f"--master-port={roles.rendezvous_port}", "--max-restarts=0", *trainer_program)
        processes.append(RoleProcess("trainer", host, rank, args, host_env[host]))

    return LaunchPlan(recipe=recipe, deploy=deploy, software=software, recipe_on_hosts=recipe_on_hosts,
                      files=files, admin_token=secrets.token_urlsafe(32), processes=tuple(processes),
                      max_steps=cfg.max_steps, host_env=host_env, resume_files=resume_files,
                      max_restarts=cfg.max_restarts, stall_timeout_s=cfg.stall_timeout_s,
                      checkpoint_interval=cfg.trainer.ckpt.interval, overrides=dict(overrides or {}))


def _process_config_files(cfg: Any, devices: Any, urls: list[str], world: int) -> dict[str, str]:
    """The three process configs of `cfg` (an RLConfig) as run-directory files: path -> TOML text."""
    from primerl.launch.local import LaunchError, process_config_toml

    try:
        inference, orchestrator, trainer = cfg.with_devices(devices).process_configs(devices, base_url=urls[0])
        orchestrator.batch.num_ranks = world
        if len(urls) > 1:
            orchestrator.client.base_urls = urls  # requests spread over the servers; every weight version reaches all
    except (ValueError, pydantic.ValidationError) as e:
        raise PlanError(f"rl: {e}".splitlines()[0]) from None
    try:
        return {
            "config/inference.toml": process_config_toml("inference", inference, {"admin_token", "admin_token_file"}),
            "config/orchestrator.toml": process_config_toml("orchestrator", orchestrator, {"admin_token"}),
            "config/trainer.toml": process_config_toml("trainer", trainer),
        }
    except LaunchError as e:
        raise PlanError(str(e)) from None


def _servers(hosts: Sequence[str], first_port: int) -> list[tuple[str, int]]:
    """(host, port) of each inference server: several servers on one host take consecutive ports."""
    seen: dict[str, int] = {}
    out = []
    for host in hosts:
        seen[host] = seen.get(host, -1) + 1
        out.append((host, first_port + seen[host]))
    return out


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _host_env(deploy: DeployConfig, host: str, gpus: bool) -> dict[str, str]:
    env = multicast_off({"PYTHONUNBUFFERED": "1"})
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if host in deploy.hosts:
        env.update(deploy.hosts[host].env)
    return dict(env)


def _software(recipe: Recipe, deploy: DeployConfig, gpus: bool) -> Software:
    sw = deploy.software
    if sw.kind == "uv":
        return Software("uv", sw.project_dir or str(PROJECT_ROOT), None, deploy.run_dir, gpus)
    image = sw.image or _pinned_image(recipe)
    return Software("image", IMAGE_PROJECT_DIR, image, deploy.run_dir, gpus)


def _pinned_image(recipe: Recipe) -> str:
    import platform

    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), platform.machine())
    image = recipe.pins.images.get(arch)
    if not image or image == "unpinned":
        raise PlanError(f"deploy.software.image: not set, and {recipe.path} pins no image for {arch} "
                        "(pins.images); build one with `primerl image build` and pin its id")
    return image
