"""Mode `shared`: the server copies each version from a buffer trainer rank 0 shares with it on their one device.

Trainer: rank 0 allocates the buffer when the publisher is built (primerl.transport.shared: CUDA IPC on a GPU, a
shared-memory file on the CPU). For each version but the last and checkpoint steps, every rank takes part in the
gathers, rank 0 waits until the server applied the version the buffer holds, fills it, and publishes
`weights/step_<k>/` holding a `SHARED` marker. A server that does not confirm within `shared_timeout_s` hands the rest
of the run to the filesystem.

Server: asked to load a `SHARED` marker directory, the engine copies the buffer into its parameters between two
decode steps; the receiver then writes `weights/shared/applied`, which frees the trainer to overwrite the buffer.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from primerl.transport.shared import SharedSegment, SharedWeightsError, write_applied
from primerl.transport.weight_transfer.base import (
    LoadRefused,
    Publisher,
    PublishSettings,
    Receiver,
    TransferFailed,
    WeightSource,
)
from primerl.transport.weight_transfer.modes import MODES

log = logging.getLogger("primerl.transport.weight_transfer")


class SharedBufferPublisher(Publisher):
    mode = MODES["shared"]

    def __init__(self, source: WeightSource, run_dir: Path, settings: PublishSettings) -> None:
        super().__init__(source, run_dir, settings)
        self.segment: SharedSegment | None = None
        if source.is_main:
            entries = [(spec.name, tuple(spec.shape)) for spec in source.specs()]
            self.segment = SharedSegment(run_dir, entries, source.dtype, source.device)
            log.info("weights: shared %s buffer of %.1f MB for inference on the same device",
                     source.device.type, self.segment.num_bytes / 1e6)

    def publish(self, step: int, is_last: bool, also_full: bool) -> dict[str, Any]:
        if self.sending and not is_last and not also_full:
            try:
                metrics = self._share(step)
            except TransferFailed as e:
                self._fall_back(str(e))
            else:
                self._prune()
                metrics["weight_transfer"] = self.label
                return metrics
        return self._write_full(step)

    def _share(self, step: int) -> dict[str, Any]:
        """Put version `step` into the buffer and publish its marker directory; TransferFailed on every rank when the
        server did not confirm the previous version in time."""
        started = time.perf_counter()
        segment, timeout_s = self.segment, self.settings.shared_timeout_s
        ok = segment is None or segment.wait_until_applied(timeout_s)
        if not self.source.agree(ok):
            raise TransferFailed(f"inference did not apply shared weights step {segment.written if segment else '?'} "
                                 f"within {timeout_s:.0f}s")
        waited = time.perf_counter() - started
        names = [spec.name for spec in self.source.specs()]
        (tensors,) = self.source.gather([names])  # every rank takes part in the gathers
        if segment is not None and tensors is not None:
            segment.fill(dict(zip(names, tensors, strict=True)))
            segment.publish(step)
        return {"weights_shared_s": time.perf_counter() - started - waited, "weights_shared_wait_s": waited}

    def _release(self, why: str) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class SharedBufferReceiver(Receiver):
    mode = MODES["shared"]
    live_note = "(shared)"
    loaded_note = "copied step {step} from the trainer's shared buffer"

    def identity(self, snapshot: Path, step: int) -> tuple:
        return (self.mode.name, step)

    async def apply(self, snapshot: Path, step: int, shown: str) -> None:
        run_dir = snapshot.parent.parent
        try:
            await self.engine.load_shared_weights(snapshot, run_dir, step)
        except NotImplementedError as e:
            raise LoadRefused(f"{e}; use a full snapshot", "weights_not_loadable") from None
        except (OSError, ValueError, KeyError, SharedWeightsError) as e:
            raise LoadRefused(f"could not load shared weights for step {step}: {e}") from None
        write_applied(run_dir, step)
