"""The embedded engine's weight intake (`HFEngine`): new weights as named tensors, from a safetensors directory
(`update_weights`), a shared buffer (`load_shared_weights`) or the trainer's weight group through a receiver thread
(`start_weight_receiver`), all through `load_named_tensors`: every name and shape is checked against the model first
(nothing changes on a mismatch), then the scheduler thread copies them into the parameters between two steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from primerl.config.inference import BroadcastReceiverSection
    from primerl.transport.broadcast import Transfer
    from primerl.transport.broadcast_receiver import BroadcastReceiver

log = logging.getLogger("primerl.inference")


class WeightIntake:
    """The weight routes of `HFEngine` and its broadcast receiver thread. The engine provides the model, its device,
    the event loop, `healthy` and `_call_scheduler` (which hands a "weights" command to the scheduler thread)."""

    model: Any
    device: torch.device
    _loop: asyncio.AbstractEventLoop | None
    _shared_reader: Any
    _receiver_thread: threading.Thread | None
    _receiver_stop: threading.Event

    async def update_weights(self, path: str | Path, step: int) -> None:
        tensors = await asyncio.to_thread(read_safetensors, Path(path))
        await self.load_named_tensors(tensors, step, source=str(path))

    async def load_shared_weights(self, snapshot: Path, run_dir: Path, step: int) -> None:
        from primerl.transport.shared import SharedReader

        if self._shared_reader is None:
            self._shared_reader = SharedReader(self.device)
        tensors = self._shared_reader.tensors(snapshot, run_dir)
        await self.load_named_tensors(tensors, step, source=f"shared weights of {snapshot}")

    async def load_named_tensors(self, tensors: Mapping[str, torch.Tensor], step: int, source: str) -> None:
        """Copy `tensors` (transformers names; a tied alias names its parameter) into the model between two decode
        steps and set `policy_version = step`. Every name and shape is checked first: on a mismatch ValueError, and
        the old weights keep serving. `source` names where the tensors came from, for messages."""
        targets = self.check_weights({name: tuple(t.shape) for name, t in tensors.items()}, source)
        await self._call_scheduler("weights", {targets[name]: t for name, t in tensors.items()}, step)

    def check_weights(self, shapes: Mapping[str, Sequence[int]], source: str) -> dict[str, str]:
        """Check named shapes against the model: every parameter present (a tied alias is enough), no unknown name,
        shapes equal. Returns each name's parameter name."""
        aliases = dict(self.model.named_parameters(remove_duplicate=False))
        params = dict(self.model.named_parameters())
        canonical = {id(p): name for name, p in params.items()}
        targets: dict[str, str] = {}
        for name, shape in shapes.items():
            if name not in aliases:
                raise ValueError(f"{source}: unknown tensor {name!r}")
            target = canonical[id(aliases[name])]
            if tuple(shape) != tuple(params[target].shape):
                raise ValueError(
                    f"{source}: {name} has shape {tuple(shape)}, model expects {tuple(params[target].shape)}"
                )
            targets[name] = target
        missing = sorted(set(params) - set(targets.values()))
        if missing:
            raise ValueError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        return targets


    # ---------------------------------------------------------------------------------------- weight broadcast

    async def start_weight_receiver(self, settings: BroadcastReceiverSection) -> None:
        if not self.healthy():
            raise RuntimeError("engine is not running")
        if self._receiver_thread is not None:
            raise RuntimeError("the weight receiver is already running")
        from primerl.transport.broadcast_receiver import BroadcastReceiver

        receiver = BroadcastReceiver(settings.host, settings.port, device=self.device,
                                     init_timeout_s=settings.init_timeout_s, timeout_s=settings.timeout_s)
        self.receiver_state = f"joining the weight group at {settings.host}:{settings.port}"
        self._receiver_thread = threading.Thread(
            target=self._follow_broadcasts, args=(receiver, settings.timeout_s), name="primerl-weights", daemon=True
        )
        self._receiver_thread.start()

    def _follow_broadcasts(self, receiver: BroadcastReceiver, timeout_s: float) -> None:
        """Receiver thread: join the group, then receive and apply every transfer until the group closes."""
        from primerl.transport.broadcast import GroupClosed, GroupFormationError

        try:
            rank = receiver.join()
        except GroupFormationError as e:
            self.receiver_state = f"failed: {e}"
            log.warning("weight broadcast: not joined, only filesystem snapshots can be loaded: %s", e)
            return
        self.receiver_state = f"rank {rank} of {receiver.world_size} ({receiver.backend})"
        try:
            while not self._receiver_stop.is_set():
                transfer = receiver.next_transfer(timeout_s=0.5)
                if transfer is not None:
                    self._receive(receiver, transfer, timeout_s)
        except GroupClosed as e:
            self.receiver_state = f"closed: {e}"
            log.info("weight broadcast: the group is closed (%s)", e)
        except Exception as e:  # the receiver is done; the server serves on
            self.receiver_state = f"failed: {e}"
            log.exception("weight broadcast: the receiver stopped")
        finally:
            receiver.close()

    def _receive(self, receiver: BroadcastReceiver, transfer: Transfer, timeout_s: float) -> None:
        source = f"weights step {transfer.step} (broadcast {transfer.transfer_id})"
        started = time.perf_counter()
        try:
            tensors = dict(receiver.receive(transfer, check=lambda m: self.check_weights(m.shapes(), source)))
            received = time.perf_counter()
            assert self._loop is not None
            applying = asyncio.run_coroutine_threadsafe(
                self.load_named_tensors(tensors, transfer.step, source), self._loop
            )
            applying.result(timeout=timeout_s)
        except Exception as e:  # noqa: BLE001 - reported to the sender, which falls back to the filesystem
            log.warning("weight broadcast not applied: %s", e)
            receiver.finish(transfer, error=str(e).splitlines()[0] if str(e) else type(e).__name__)
            return
        receiver.finish(transfer)
        manifest = transfer.manifest
        log.info(
            "weights: received step %d by broadcast: %d tensors, %.1f MB in %d bucket(s); receive %.2fs, apply %.2fs",
            transfer.step, manifest.num_tensors, manifest.num_bytes / 1e6, len(manifest.buckets),
            received - started, time.perf_counter() - received,
        )


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, or of the `*.safetensors` files of a directory."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no safetensors weights at {path}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


