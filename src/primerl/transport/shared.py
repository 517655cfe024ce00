"""Weights through shared memory, for a trainer and an inference server on the same device (`transfer = "shared"`).

When both processes sit on one GPU (or one CPU host), a new policy version need not leave the device: the trainer
writes every exported tensor into one flat buffer of the export dtype, which the server maps too, and the server
copies from it into its own parameters (device to device).

- The buffer: allocated once by the trainer; `weights/shared/segment.json` says what it holds (each tensor's name,
  dtype, shape and element offset) and how to map it: on CUDA a CUDA IPC handle (torch's own tensor reduction,
  pickled into `segment.pkl`), on the CPU a file under /dev/shm that both processes map. Written atomically; its
  `segment_id` changes whenever the trainer allocates a new buffer.
- Version k: the trainer waits until the server applied the version it wrote before (`applied` below), fills the
  buffer, synchronizes the device, and publishes `weights/step_<k>/` holding only a `SHARED` marker (the step and
  the segment id) and `STABLE`, so the orchestrator sees a new version as always and asks the server to load it.
- The server, asked to load a directory with a `SHARED` marker, copies the buffer into its parameters between two
  decode steps and then writes `weights/shared/applied` (the step), which frees the trainer to overwrite the buffer.
- Whenever the server does not confirm in time (it is gone, or loads from elsewhere), the trainer writes that version
  in full on the filesystem instead; the last step and checkpoint steps are always written in full too, so the run
  directory stays loadable by a server started later.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from primerl.storage import atomic_write
from primerl.transport import snapshots

SHARED = snapshots.SHARED
SEGMENT_JSON, SEGMENT_HANDLE = snapshots.SEGMENT_JSON, snapshots.SEGMENT_HANDLE
segment_dir, release = snapshots.shared_segment_dir, snapshots.release_shared_buffer
APPLIED = "applied"
_ALIGN = 64  # elements: every tensor starts 128-byte aligned (bf16)


class SharedWeightsError(RuntimeError):
    """The shared buffer cannot be used (another device, a missing segment, a layout that does not match)."""


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements of the buffer's dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layout(entries: list[tuple[str, tuple[int, ...]]]) -> tuple[list[Slot], int]:
    """Aligned slots for `(name, shape)` entries, and the buffer's total size in elements."""
    slots, offset = [], 0
    for name, shape in entries:
        slot = Slot(name, tuple(shape), offset)
        slots.append(slot)
        offset += -(-slot.numel // _ALIGN) * _ALIGN
    return slots, max(offset, 1)


def read_applied(run_dir: str | os.PathLike) -> int | None:
    try:
        return int((segment_dir(run_dir) / APPLIED).read_text())
    except (OSError, ValueError):
        return None


def write_applied(run_dir: str | os.PathLike, step: int) -> None:
    atomic_write(segment_dir(run_dir) / APPLIED, str(step).encode())


class SharedSegment:
    """The trainer's side: owns the buffer, fills it, and publishes versions that point at it."""

    def __init__(self, run_dir: str | os.PathLike, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype,
                 device: torch.device):
        self.run_dir = Path(run_dir)
        self.slots, size = layout(entries)
        self.dtype, self.device = dtype, device
        self.segment_id = uuid.uuid4().hex
        self.dir = segment_dir(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        release(run_dir)  # a buffer left by a trainer of this run that did not close its own (killed)
        (self.dir / APPLIED).unlink(missing_ok=True)
        self.shm_path: Path | None = None
        if device.type == "cuda":
            self.buffer = torch.empty(size, dtype=dtype, device=device)
            from torch.multiprocessing.reductions import reduce_tensor

            atomic_write(self.dir / SEGMENT_HANDLE, pickle.dumps(reduce_tensor(self.buffer)))
            where = {"kind": "cuda_ipc", "device_uuid": str(torch.cuda.get_device_properties(device).uuid)}
        else:
            shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else self.dir
            self.shm_path = shm / f"primerl-weights-{self.segment_id}"
            self.buffer = torch.from_file(str(self.shm_path), shared=True, size=size, dtype=dtype)
            # every page touched now, before the trainer waits for its first batch: the first fill would otherwise
            # fault the whole file in inside the first step (0.4 s for 540 MB on a CPU core)
            self.buffer.zero_()
            where = {"kind": "file", "path": str(self.shm_path)}
        description = {
            "segment_id": self.segment_id, "dtype": str(dtype).removeprefix("torch."), "numel": size,
            "tensors": [[s.name, list(s.shape), s.offset] for s in self.slots], **where,
        }
        atomic_write(self.dir / SEGMENT_JSON, json.dumps(description).encode())
        self.written: int | None = None  # the step the buffer holds now

    @property
    def num_bytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def wait_until_applied(self, timeout_s: float) -> bool:
        """True once the server applied the version the buffer holds (or it holds none yet)."""
        if self.written is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            applied = read_applied(self.run_dir)
            if applied is not None and applied >= self.written:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    def fill(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy (and cast) every slot's tensor into the buffer, then wait for the copies to finish."""
        for slot in self.slots:
            view = self.buffer[slot.offset : slot.offset + slot.numel].view(slot.shape)
            view.copy_(tensors[slot.name], non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def publish(self, step: int) -> Path:
        """Publish `weights/step_<step>/` as a marker directory pointing at the buffer."""
        self.written = step
        return snapshots.publish_marker(self.run_dir, step, SHARED, {"step": step, "segment_id": self.segment_id})

    def close(self) -> None:
        """Remove this buffer and the description of it (not `release`: that removes whatever buffer the description
        names, which after a restart is another trainer's)."""
        for name in (SEGMENT_JSON, SEGMENT_HANDLE):
            (self.dir / name).unlink(missing_ok=True)
        if self.shm_path is not None:
            self.shm_path.unlink(missing_ok=True)


class SharedReader:
    """The server's side: maps the trainer's buffer (once per segment) and yields its tensors as views."""

    def __init__(self, device: torch.device):
        self.device = device
        self.segment_id: str | None = None
        self.views: dict[str, torch.Tensor] = {}

    def tensors(self, snapshot: str | os.PathLike, run_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
        """Views into the buffer that snapshot directory `snapshot` points at (no copy)."""
        wanted = (snapshots.marker(snapshot, SHARED) or {}).get("segment_id")
        if wanted is None:
            raise SharedWeightsError(f"{snapshot} has no {SHARED} marker")
        if wanted != self.segment_id:
            self._map(segment_dir(run_dir), wanted)
        return self.views

    def _map(self, directory: Path, wanted: str) -> None:
        try:
            description = json.loads((directory / SEGMENT_JSON).read_text())
        except OSError as e:
            raise SharedWeightsError(f"no shared weight segment in {directory}: {e}") from None
        if description["segment_id"] != wanted:
            raise SharedWeightsError(
                f"the shared weight segment in {directory} is {description['segment_id']}, the snapshot wants {wanted} "
                "(the trainer restarted): load a full snapshot"
            )
        dtype = getattr(torch, description["dtype"])
        if description["kind"] == "cuda_ipc":
            if self.device.type != "cuda":
                raise SharedWeightsError("the trainer shares CUDA memory but this server runs on the CPU")
            here = str(torch.cuda.get_device_properties(self.device).uuid)
            if here != description["device_uuid"]:
                raise SharedWeightsError(
                    f"the trainer's buffer is on GPU {description['device_uuid']}, this server on {here}: shared "
                    "weights need both on one GPU (use filesystem or broadcast)"
                )
            rebuild, args = pickle.loads((directory / SEGMENT_HANDLE).read_bytes())
            buffer = rebuild(*args)
        else:
            buffer = torch.from_file(description["path"], shared=True, size=description["numel"], dtype=dtype)
        self.views = {
            name: buffer[offset : offset + math.prod(shape)].view(shape)
            for name, shape, offset in description["tensors"]
        }
        self.segment_id = wanted
