"""The interfaces of a weight transfer: a `Publisher` on the trainer, a `Receiver` on the inference server.

Publisher (every method collective: all trainer ranks call it):
- `publish(step, is_last, also_full)` makes policy version `step` loadable as `weights/step_<step>/` and returns the
  step's metrics (`weight_transfer` = `label`). The mode sends the version its own way where it can; the last step,
  and checkpoint steps (`also_full`), are always written in full too, so the run directory ends loadable by a server
  started later. A mode that fails on any rank (`TransferFailed`, agreed by all ranks) hands this and every later
  version to the filesystem; `label` then says `filesystem (fallback: <reason>)`.
- `resumed(step)` after a resume at checkpoint `step`: staging leftovers and snapshots newer than `step` go, and when
  the run publishes (or published) versions without their weights, version `step` is written in full.
- The trainer plugs in as a `WeightSource` (what inference loads, gathered from the policy).

Receiver (one per mode in the server, sharing one `LoadState`):
- `start()` once the engine runs (the broadcast receiver joins the trainer's weight group).
- `load(snapshot, step, shown)` makes version `step` live from snapshot directory `snapshot` and returns once it is;
  a repeated request for the snapshot already live (the first answer was lost) loads nothing. A snapshot that cannot
  be loaded here is a `LoadRefused` (the admin route's 400) and the old weights keep serving. `shown` is how messages
  name the snapshot (the server escapes what a client sent).
- The server plugs in its engine as a `ServingEngine`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from primerl.transport import snapshots
from primerl.transport.weight_transfer.modes import TransferMode, published_by

if TYPE_CHECKING:
    import torch

    from primerl.transport.buckets import TensorSpec

log = logging.getLogger("primerl.transport.weight_transfer")


class TransferFailed(RuntimeError):
    """A mode could not send a version (every rank raises it together); the publisher falls back to the filesystem."""


class LoadRefused(Exception):
    """A snapshot this server cannot load; `code` is the error code of the admin route's answer."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code = message, code


# ---------------------------------------------------------------------------------------------------------------------
# Trainer side


class WeightSource(Protocol):
    """What a publisher needs of the trainer. `specs` is local; every other method is collective."""

    is_main: bool  # trainer rank 0: the one that writes and sends
    dtype: torch.dtype  # the export dtype
    device: torch.device

    def specs(self) -> Sequence[TensorSpec]:
        """Every tensor inference loads (transformers names), in state-dict order; the same on every rank."""

    def gather(self, groups: Sequence[Sequence[str]]) -> Iterator[list[torch.Tensor] | None]:
        """For each group of names, in order: the full export tensors on rank 0, None on the other ranks (which take
        part in the gathers). Collective: every rank iterates to the end."""

    def write_full(self, run_dir: Path, step: int, marker: tuple[str, dict] | None = None) -> None:
        """Write and publish `weights/step_<step>/` in full, with `marker` (name, JSON) in it too."""

    def agree(self, ok: bool) -> bool:
        """True when `ok` holds on every rank."""


class PublishSettings(Protocol):
    """The trainer's `weights` section (primerl.config.trainer.WeightsConfig), as the publishers read it."""

    transfer: str
    keep_last: int | None
    shared_timeout_s: float
    broadcast: Any  # host, port, receivers, backend, bucket_mb, init_timeout_s, timeout_s


class Publisher(ABC):
    """The trainer side of one mode (module docstring). Subclasses send a version their way in `publish` and fall
    back through `_write_full`."""

    mode: ClassVar[TransferMode]

    def __init__(self, source: WeightSource, run_dir: Path, settings: PublishSettings) -> None:
        self.source, self.run_dir, self.settings = source, Path(run_dir), settings
        self.fallback: str | None = None  # why this mode gave way to the filesystem

    @property
    def label(self) -> str:
        """The mode in use, for the metrics: the mode's name, or `filesystem (fallback: <reason>)`."""
        return self.mode.name if self.fallback is None else f"filesystem (fallback: {self.fallback})"

    @property
    def sending(self) -> bool:
        """Whether versions still go this mode's way (no fall-back yet)."""
        return self.fallback is None

    @abstractmethod
    def publish(self, step: int, is_last: bool, also_full: bool) -> dict[str, Any]:
        """Publish policy version `step`; return its metrics."""

    def resumed(self, step: int) -> None:
        """After resuming at `step` (0: no checkpoint). Staging leftovers of a killed export go, and so do snapshots
        newer than `step`: their steps are trained again, and a server must never load the old version k when the
        new one is published (on a GPU they differ). A restarted server holds nothing that was broadcast or shared, so
        when the run uses (or used) such markers, version `step` is made loadable from disk; what comes next travels
        the mode's way."""
        run_dir = self.run_dir
        uses_markers = self.mode.marker is not None or any(
            published_by(snapshots.weights_dir(run_dir, s)).marker is not None for s in snapshots.stable_steps(run_dir))
        if self.source.is_main:
            if leftovers := snapshots.remove_staging_leftovers(run_dir):
                log.info("resume: removed staging leftovers of a killed export: %s", ", ".join(leftovers))
            if removed := snapshots.remove_after(run_dir, step):
                log.info("resume: removed weight snapshots %s (newer than checkpoint step %d)", removed, step)
        if not self.source.agree(not uses_markers):
            path = snapshots.weights_dir(run_dir, step)
            on_disk = snapshots.is_stable(path) and snapshots.has_files(path)
            if step > 0 and not self.source.agree(on_disk):
                self.source.write_full(run_dir, step)
                if self.source.is_main:
                    log.info("resume: wrote weights/step_%d in full for the restarted inference server", step)

    def close(self) -> None:
        self._release("the trainer finished")

    def _release(self, why: str) -> None:
        """Free what the mode holds (a group, a buffer); `why` is told to its peers."""

    def _fall_back(self, reason: str) -> None:
        self.fallback = reason
        self._release(f"the trainer fell back to the filesystem: {reason}")
        if self.source.is_main:
            log.warning("WEIGHT BROADCAST UNAVAILABLE: %s -- the rest of the run publishes full weights on the "
                        "filesystem instead", reason)

    def _write_full(self, step: int, marker: tuple[str, dict] | None = None,
                    metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write version `step` in full (with `marker` in it too), prune, and return `metrics` completed."""
        metrics = {} if metrics is None else metrics
        started = time.perf_counter()
        self.source.write_full(self.run_dir, step, marker)
        self._prune()
        metrics["weights_export_s"] = time.perf_counter() - started
        metrics["weight_transfer"] = self.label
        return metrics

    def _prune(self) -> None:
        if self.source.is_main and self.settings.keep_last is not None:
            snapshots.prune(self.run_dir, self.settings.keep_last)


# ---------------------------------------------------------------------------------------------------------------------
# Inference side


class ServingEngine(Protocol):
    """What a receiver needs of the server's engine (primerl.inference.engines.base.Engine)."""

    policy_version: int
    receiver_state: str

    async def update_weights(self, path: Path, step: int) -> None: ...

    async def load_shared_weights(self, snapshot: Path, run_dir: Path, step: int) -> None: ...

    async def start_weight_receiver(self, settings: Any) -> None: ...


@dataclass
class LoadState:
    """What the server's receivers share: one weight change (or pause) at a time, and what was loaded last."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    loaded: tuple | None = None  # the identity of the snapshot loaded last (`Receiver.identity`)


class Receiver(ABC):
    """The inference side of one mode (module docstring)."""

    mode: ClassVar[TransferMode]
    live_note: ClassVar[str]  # the log's "weights: step <step> ... is already live", e.g. "from {shown}"
    loaded_note: ClassVar[str]  # the log's "weights: ... as policy version <step>", e.g. "loaded {shown}"

    def __init__(self, engine: ServingEngine, state: LoadState, group: Any) -> None:
        self.engine, self.state, self.group = engine, state, group  # group: the trainer's weight group (broadcast)

    async def start(self) -> None:
        """What the mode needs once the engine runs."""

    async def load(self, snapshot: Path, step: int, shown: str) -> None:
        async with self.state.lock:
            identity = self.identity(snapshot, step)
            if self.engine.policy_version == step and self.state.loaded == identity:
                # a retried request (its first attempt's answer was lost with the connection): already live
                log.info("weights: step %d %s is already live", step, self.live_note.format(shown=shown))
                return
            started = time.perf_counter()
            await self.apply(snapshot, step, shown)
            self.state.loaded = identity
            log.info("weights: %s as policy version %d in %.3fs", self.loaded_note.format(shown=shown, step=step),
                     step, time.perf_counter() - started)

    @abstractmethod
    def identity(self, snapshot: Path, step: int) -> tuple:
        """What tells two loads apart (a snapshot re-published under the same step after a resume is another)."""

    @abstractmethod
    async def apply(self, snapshot: Path, step: int, shown: str) -> None:
        """Make version `step` live; LoadRefused when it cannot be (the old weights keep serving)."""


class Receivers:
    """The server's receivers, one per mode: the configured mode's starts with the engine, and each snapshot is
    loaded by the receiver of the mode that published it (its marker says which): a trainer that fell back publishes
    full snapshots whatever the server's mode, and a resumed run may hold older markers."""

    def __init__(self, configured: TransferMode, receivers: dict[str, Receiver]) -> None:
        self.configured, self.receivers = configured, receivers

    async def start(self) -> None:
        await self.receivers[self.configured.name].start()

    async def load(self, snapshot: Path, step: int, shown: str) -> None:
        """Make version `step` live from `snapshot`; LoadRefused (`weights_not_found`, ...) when it cannot be."""
        try:
            found = snapshot.exists()
        except OSError as e:  # a name too long for the filesystem, ...
            raise LoadRefused(f"no weights at {shown}: {e.strerror}", "weights_not_found") from None
        if not found:
            raise LoadRefused(f"no weights at {shown}", "weights_not_found")
        await self.receivers[published_by(snapshot).name].load(snapshot, step, shown)
