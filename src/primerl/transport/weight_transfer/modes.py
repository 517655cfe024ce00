"""The weight-transfer modes and what each supports: the one declaration of `filesystem`, `broadcast` and `shared`.

Torch-free and free of the rest of primerl but the snapshot layout, so the config layer and the launchers can ask it.
Callers read a mode's capabilities (`transfer_mode(name).separate_devices`, ...) or call its checks, which raise one
`Unsupported` (a ValueError) naming the modes that would work; nobody outside this package compares mode names.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from primerl.transport import snapshots

WeightTransfer = Literal["filesystem", "broadcast", "shared"]


class Unsupported(ValueError):
    """A mode asked to do what it cannot (the message names the modes that can)."""


@dataclass(frozen=True)
class TransferMode:
    """One way new weights reach inference, and what it supports."""

    name: WeightTransfer
    marker: str | None  # the marker of a version published without its weights (None: every version is on disk)
    weight_group: bool  # runs over the trainer's weight group: needs its port; the server joins it at start
    separate_devices: bool  # the server and trainer rank 0 may sit on different devices
    sharded_server: bool  # the server may be sharded over several GPUs (vLLM tensor parallel)
    several_hosts: bool  # the launchers can run it with the processes on several hosts
    sft: bool  # `sft` can publish its weights this way
    shared_memory: bool  # holds a shared-memory buffer that outlives a killed trainer (`rl` releases it)
    one_device_why: str = ""  # why the mode needs the server and the trainer on one device

    def check_devices(self, inference: Sequence[int], trainer: Sequence[int], key: str = "weight_transfer") -> None:
        """The server on GPUs `inference`, the trainer on `trainer` ([] = the CPU)."""
        if self.separate_devices or list(trainer[:1]) == list(inference[:1]):
            return
        raise Unsupported(
            f"{key} = {self.name!r} needs the server and trainer rank 0 on one device ({self.one_device_why}), but "
            f"inference has GPUs {list(inference) or 'none (CPU)'} and the trainer {list(trainer) or 'none (CPU)'}; "
            f"use {_either(supporting('separate_devices'))} for separate devices"
        )

    def check_sharded_server(self, tensor_parallel_size: int, key: str = "weight_transfer") -> None:
        """A vLLM server sharded over `tensor_parallel_size` GPUs."""
        if self.sharded_server or tensor_parallel_size == 1:
            return
        raise Unsupported(
            f"{key} = {self.name!r} with vLLM needs inference.vllm.tensor_parallel_size = 1 ({self.one_device_why}), "
            f"not {tensor_parallel_size}; use {_either(supporting('sharded_server'))} to feed a sharded server"
        )

    def check_hosts(self, key: str = "weight_transfer") -> None:
        """The processes on several hosts, started by a launcher (ssh, Slurm)."""
        if not self.several_hosts:
            raise Unsupported(f"{key} = {self.name!r}: launch supports {_either(supporting('several_hosts'))} (the "
                              "run directory is shared); other transfers across hosts are not wired yet")

    def check_sft(self, key: str = "weights.transfer") -> None:
        """`sft` publishing its weights."""
        if not self.sft:
            raise Unsupported(f"SFT writes its weights to the filesystem: {key} must be {_either(supporting('sft'))}")

    def check_group_port(self, port: int, key: str, port_key: str) -> None:
        """`port` is the weight group's port (`port_key`; 0 = unset)."""
        if self.weight_group and port == 0:
            raise Unsupported(f"{key} = {self.name!r} needs {port_key} (the port of the trainer's weight store; rl "
                              "picks one itself)")


MODES: dict[str, TransferMode] = {
    mode.name: mode
    for mode in (
        TransferMode("filesystem", marker=None, weight_group=False, separate_devices=True, sharded_server=True,
                     several_hosts=True, sft=True, shared_memory=False),
        TransferMode("broadcast", marker=snapshots.BROADCAST, weight_group=True, separate_devices=True,
                     sharded_server=True, several_hosts=False, sft=False, shared_memory=False),
        TransferMode("shared", marker=snapshots.SHARED, weight_group=False, separate_devices=False,
                     sharded_server=False, several_hosts=False, sft=False, shared_memory=True,
                     one_device_why="the trainer's buffer lives on one device"),
    )
}
FILESYSTEM = MODES["filesystem"]


def transfer_mode(name: str) -> TransferMode:
    """The mode called `name`; Unsupported naming the modes for any other name."""
    try:
        return MODES[name]
    except KeyError:
        raise Unsupported(f"unknown weight transfer {name!r}: choose {_either(list(MODES))}") from None


def supporting(capability: str) -> list[str]:
    """The names of the modes that have `capability` (an attribute of TransferMode), in declaration order."""
    return [mode.name for mode in MODES.values() if getattr(mode, capability)]


def published_by(snapshot: str | os.PathLike) -> TransferMode:
    """The mode that published snapshot `snapshot` (a directory, or a weights file): the one whose marker it holds,
    else the filesystem. A directory with a marker and the full files was published both ways; its marker wins."""
    path = Path(snapshot)
    if path.is_dir():
        for mode in MODES.values():
            if mode.marker is not None and (path / mode.marker).is_file():
                return mode
    return FILESYSTEM


def _either(names: Sequence[str]) -> str:
    quoted = [f"'{name}'" for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
