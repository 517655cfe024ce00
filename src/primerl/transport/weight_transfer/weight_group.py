"""Mode `broadcast`: each version sent from trainer rank 0 to the server over the trainer's weight group.

Trainer: rank 0 forms the group (primerl.transport.broadcast) when the publisher is built, all ranks learn the outcome.
Each version but the last is gathered tensor by tensor on every rank, packed into buckets and broadcast by rank 0;
once every receiver applied it, `weights/step_<k>/` is published holding a `BROADCAST` marker (step, transfer id,
backend, manifest summary), and on checkpoint steps the full files as well. A group that cannot form, or a transfer
that fails, hands the rest of the run to the filesystem.

Server: the engine joins the group at start and applies every version it receives by itself; asked to load a marker
directory, the receiver confirms a version the engine already serves and refuses one it never received (unless the
directory holds the full files too, which load from disk).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from primerl.transport import snapshots
from primerl.transport.broadcast import BroadcastSender, GroupFormationError, WeightTransferError
from primerl.transport.buckets import plan_buckets
from primerl.transport.weight_transfer.base import LoadRefused, Publisher, PublishSettings, TransferFailed, WeightSource
from primerl.transport.weight_transfer.filesystem import FilesystemReceiver
from primerl.transport.weight_transfer.modes import MODES

log = logging.getLogger("primerl.transport.weight_transfer")


class WeightGroupPublisher(Publisher):
    mode = MODES["broadcast"]

    def __init__(self, source: WeightSource, run_dir: Path, settings: PublishSettings) -> None:
        super().__init__(source, run_dir, settings)
        self.group = settings.broadcast
        self.sender: BroadcastSender | None = None
        error = None
        if source.is_main:
            g = self.group
            sender = BroadcastSender(g.host, g.port, g.receivers, backend=g.backend, device=source.device,
                                     init_timeout_s=g.init_timeout_s, timeout_s=g.timeout_s)
            try:
                sender.form()
                self.sender = sender
            except GroupFormationError as e:
                error = str(e)
        if not source.agree(error is None):
            self._fall_back(error or "rank 0 could not form the weight group")

    @property
    def backend(self) -> str | None:
        """The group's backend (rank 0, while the group serves), else None."""
        return self.sender.backend if self.sender is not None else None

    def publish(self, step: int, is_last: bool, also_full: bool) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        if not self.sending or is_last:
            return self._write_full(step)
        try:
            marker = (snapshots.BROADCAST, self._broadcast(step, metrics))
        except TransferFailed as e:
            self._fall_back(str(e))
            return self._write_full(step)
        if also_full:
            return self._write_full(step, marker, metrics)
        if self.source.is_main:
            snapshots.publish_marker(self.run_dir, step, *marker)
        self._prune()
        metrics["weight_transfer"] = self.label
        return metrics

    def _broadcast(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Send version `step` through the group; the marker's JSON (on rank 0; {} elsewhere). TransferFailed on
        every rank when it failed on any."""
        manifest = plan_buckets(self.source.specs(), self.group.bucket_mb * 2**20)
        sender = self.sender
        error: str | None = None
        if sender is not None:
            try:
                sender.begin(step, manifest)
            except WeightTransferError as e:
                error = str(e)
        if not self.source.agree(error is None):
            raise TransferFailed(error or "rank 0 could not start the transfer")
        stats = None
        for index, tensors in enumerate(self.source.gather([[t.name for t in b.tensors] for b in manifest.buckets])):
            if tensors is not None and error is None:
                try:
                    sender.send_bucket(index, tensors)  # type: ignore[union-attr]  # rank 0 holds the tensors
                except WeightTransferError as e:
                    error = str(e)  # keep gathering: the other ranks are in the loop too
            del tensors
        if sender is not None and error is None:
            try:
                stats = sender.end()
            except WeightTransferError as e:
                error = str(e)
        if not self.source.agree(error is None):
            raise TransferFailed(error or "the transfer failed on rank 0")
        if stats is None:
            return {}
        log.info("weights step %d: broadcast to %d receiver(s) over %s in %.2fs: %d tensors, %.1f MB, %d bucket(s)",
                 step, self.group.receivers, self.backend, stats.seconds, stats.num_tensors, stats.num_bytes / 1e6,
                 stats.num_buckets)
        metrics.update(weights_broadcast_s=stats.seconds, weights_broadcast_bytes=stats.num_bytes,
                       weights_broadcast_buckets=stats.num_buckets)
        return {"step": step, "transfer_id": stats.transfer_id, "backend": self.backend,
                "receivers": self.group.receivers, "seconds": round(stats.seconds, 4), **manifest.summary()}

    def _release(self, why: str) -> None:
        if self.sender is not None:
            self.sender.close(why)
            self.sender = None


class WeightGroupReceiver(FilesystemReceiver):
    mode = MODES["broadcast"]

    async def start(self) -> None:
        await self.engine.start_weight_receiver(self.group)

    async def load(self, snapshot: Path, step: int, shown: str) -> None:
        if self.engine.policy_version >= step:
            # the trainer publishes a broadcast marker only after every receiver applied it: confirm, load nothing
            marker = snapshots.marker(snapshot, snapshots.BROADCAST) or {}
            log.info("weights: step %d is live (received by broadcast %s)", step, marker.get("transfer_id"))
            return
        if not snapshots.has_files(snapshot):
            raise LoadRefused(
                f"weights step {step} were broadcast to the trainer's weight group and this server does not hold "
                f"them (it serves policy version {self.engine.policy_version}; weight receiver: "
                f"{self.engine.receiver_state}); load a full snapshot instead",
                "weights_not_received",
            )
        await super().load(snapshot, step, shown)
