"""The `[deploy]` table: where a recipe runs when it leaves this machine (`primerl launch ssh|slurm`).

    [deploy]
    target = "ssh"                       # or "slurm"
    run_dir = "/shared/runs/tiny"        # absolute; the same path on every host (a shared filesystem)
    checklist_skip = ["rl_smoke"]        # checklist steps not run on the hosts (default: none)
    known_hosts = "~/.ssh/cluster_known_hosts"  # ssh: host keys checked besides the system's and ~/.ssh/known_hosts
    accept_new_host_keys = false         # ssh: accept (and record) keys of hosts seen for the first time

    [deploy.software]                    # how primerl gets onto the hosts
    kind = "uv"                          # "uv": the project's .venv synced from uv.lock; "image": docker run by id
    project_dir = "/opt/primerl"         # uv: the project on every host (default: this checkout's path)
    image = "sha256:..."                 # image: the image id (default: the recipe's pins.images for the arch)

    [deploy.hosts.a]                     # ssh: every host by name
    address = "10.0.0.1"
    user = "ubuntu"                      # default: yours (or ~/.ssh/config's)
    port = 22
    identity_file = "~/.ssh/id_ed25519"
    env = { GLOO_SOCKET_IFNAME = "eth0" }   # extra environment of everything run on this host

    [deploy.roles]                       # ssh: which host runs what (every host of [deploy.hosts] needs a role)
    inference = ["a"]                    # one inference server per entry (a host may appear twice)
    orchestrator = "a"
    trainer = ["b", "c"]                 # one torchrun node per host, node rank = position
    trainer_ranks_per_host = 1

    [deploy.slurm]                       # slurm: the allocation
    partition = "gpu"
    nodes = 2
    inference_nodes = 1                  # of `nodes`: the first ones serve, the others train
    gpus_per_node = 8
    time_limit = "04:00:00"

A config error is one line naming the key or the host (`primerl.config` style). Nothing here imports torch.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from primerl.config.base import Section, known_names
from primerl.config.checklist import STEP_NAMES

_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_IMAGE_ID = re.compile(r"^sha256:[0-9a-f]{64}$")


class HostSection(Section):
    """One SSH host."""

    address: str = Field(..., min_length=1, description="host name or IP address sshd listens on")
    user: str | None = Field(None, description="login user (default: ~/.ssh/config's, else yours)")
    port: int = Field(22, ge=1, le=65535, description="sshd's port")
    identity_file: str | None = Field(None, description="private key to log in with (default: ssh's own choice)")
    env: dict[str, str] = Field(
        default_factory=dict, description="environment of everything run on this host (e.g. GLOO_SOCKET_IFNAME)"
    )
    # the host-key rule of the [deploy] table this host is in, set by DeployConfig (`primerl.launch.ssh_hosts`)
    _known_hosts: str | None = PrivateAttr(None)
    _accept_new: bool = PrivateAttr(False)

    @property
    def known_hosts_file(self) -> str | None:
        return self._known_hosts

    @property
    def accept_new_key(self) -> bool:
        return self._accept_new


class RolesSection(Section):
    """Which host runs which process. Hosts are names from `[deploy.hosts]`."""

    inference: list[str] = Field(..., min_length=1, description="one inference server per entry")
    orchestrator: str = Field(..., description="the host of the orchestrator")
    trainer: list[str] = Field(..., min_length=1, description="one torchrun node per host; node rank = position")
    trainer_ranks_per_host: int = Field(1, ge=1, description="trainer processes (ranks) per trainer host")
    inference_port: int = Field(8000, ge=1, le=65535, description="port of the first server on a host (+1 per next)")
    rendezvous_port: int = Field(29500, ge=1, le=65535, description="torchrun's port on the first trainer host")

    @field_validator("trainer")
    @classmethod
    def _distinct(cls, hosts: list[str]) -> list[str]:
        repeated = sorted({h for h in hosts if hosts.count(h) > 1})
        if repeated:
            raise ValueError(f"lists host(s) {repeated} twice: one trainer node per host (raise "
                             "trainer_ranks_per_host for more ranks on a host)")
        return hosts


class SoftwareSection(Section):
    """How primerl gets onto the hosts: the project's uv environment, or the pinned container image."""

    kind: Literal["uv", "image"] = Field("uv", description="uv = <project_dir>/.venv from uv.lock; image = docker")
    project_dir: str | None = Field(None, description="uv: the project on every host (default: this checkout's path)")
    sync: bool = Field(True, description="uv: run `uv sync --locked --inexact` on a host whose environment lacks "
                       "packages of uv.lock (packages installed beside the lock stay)")
    uv: str = Field("uv", description="uv: the uv program on the hosts (a name on PATH or an absolute path)")
    image: str | None = Field(None, description="image: image id sha256:<64 hex> (default: the recipe's pin)")

    @field_validator("project_dir")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if value is not None and not PurePosixPath(value).is_absolute():
            raise ValueError(f"must be an absolute path on the hosts, got {value!r}")
        return value

    @field_validator("image")
    @classmethod
    def _image_id(cls, value: str | None) -> str | None:
        if value is not None and not _IMAGE_ID.fullmatch(value):
            raise ValueError(f"must be an image id 'sha256:<64 hex digits>', got {value!r}")
        return value


class SlurmSection(Section):
    """The allocation a Slurm job asks for, and where to submit it."""

    partition: str | None = Field(None, description="partition (default: the cluster's default)")
    account: str | None = Field(None, description="account to charge")
    nodes: int = Field(1, ge=1, description="nodes of the job")
    inference_nodes: int = Field(1, ge=1, description="multi-node jobs: the first nodes run inference servers")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (--gpus-per-node); 0 = a CPU job")
    cpus_per_node: int | None = Field(None, ge=1, description="CPUs per node (--cpus-per-task of the job's one task)")
    time_limit: str = Field("01:00:00", description="wall-clock limit, Slurm's format (HH:MM:SS, D-HH:MM)")
    login_host: str | None = Field(None, description="submit over SSH on this host of [deploy.hosts] (default: here)")
    extra: list[str] = Field(default_factory=list, description="more #SBATCH options, e.g. '--qos=high'")
    poll_s: float = Field(2.0, gt=0, description="how often to ask squeue and read the log")

    @model_validator(mode="after")
    def _nodes_left_to_train(self) -> SlurmSection:
        if self.nodes > 1 and self.inference_nodes >= self.nodes:
            raise ValueError(f"inference_nodes = {self.inference_nodes} leaves none of nodes = {self.nodes} to train")
        return self


class DeployConfig(Section):
    """Where and how a recipe runs beyond this machine."""

    target: Literal["ssh", "slurm"] = Field(..., description="ssh = hosts over SSH (fabric); slurm = an sbatch job")
    run_dir: str = Field(..., description="the run directory: an absolute path every host sees (shared filesystem)")
    software: SoftwareSection = Field(default_factory=SoftwareSection, description="how primerl gets there")
    hosts: dict[str, HostSection] = Field(default_factory=dict, description="SSH hosts by name")
    roles: RolesSection | None = Field(None, description="ssh: which host runs which process")
    slurm: SlurmSection = Field(default_factory=SlurmSection, description="slurm: the allocation")
    checklist_skip: Annotated[list[str], known_names(STEP_NAMES, "checklist step(s)", "steps")] = Field(
        default_factory=list, description="checklist steps not run on the hosts"
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="ssh: give up connecting to a host after this long")
    known_hosts: str | None = Field(
        None, description="ssh: a known_hosts file checked besides /etc/ssh/ssh_known_hosts and ~/.ssh/known_hosts; "
        "new keys accepted with accept_new_host_keys are recorded there (default: in ~/.ssh/known_hosts)")
    accept_new_host_keys: bool = Field(
        False, description="ssh: accept the key of a host not in known_hosts (first contact), record it and log its "
        "fingerprint; a key that differs from a known one is refused regardless (--accept-new-host-keys)")
    shutdown_grace_s: float = Field(20.0, gt=0, description="on stop, wait this long before killing a process")

    @field_validator("run_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not PurePosixPath(value).is_absolute():
            raise ValueError(f"must be an absolute path every host sees, got {value!r}")
        return value

    @field_validator("hosts")
    @classmethod
    def _host_names(cls, hosts: dict[str, HostSection]) -> dict[str, HostSection]:
        bad = [name for name in hosts if not _HOST_NAME.fullmatch(name)]
        if bad:
            raise ValueError(f"host name(s) {bad} must be letters, digits, '.', '_' or '-'")
        return hosts

    @model_validator(mode="after")
    def _target_complete(self) -> DeployConfig:
        if self.target == "ssh":
            if self.roles is None:
                raise ValueError("target = 'ssh' needs [deploy.roles] (inference, orchestrator, trainer)")
            named = [*self.roles.inference, self.roles.orchestrator, *self.roles.trainer]
            unknown = sorted({h for h in named if h not in self.hosts})
            if unknown:
                known = ", ".join(self.hosts) or "none"
                raise ValueError(f"roles name host(s) {unknown} that [deploy.hosts] lacks (hosts: {known})")
            idle = [h for h in self.hosts if h not in named]
            if idle:
                raise ValueError(f"host(s) {idle} in [deploy.hosts] have no role: name them in [deploy.roles] "
                                 "(inference, orchestrator, trainer) or remove them")
        login = self.slurm.login_host
        if self.target == "slurm" and login is not None and login not in self.hosts:
            raise ValueError(f"slurm.login_host '{login}' is not in [deploy.hosts]")
        for host in self.hosts.values():
            host._known_hosts, host._accept_new = self.known_hosts, self.accept_new_host_keys
        return self
