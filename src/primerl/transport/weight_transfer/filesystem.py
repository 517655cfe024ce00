"""Mode `filesystem`: every version written in full as `weights/step_<k>/` and read from disk by the server.

The trainer gathers the full state dict on rank 0 and publishes it atomically (`STABLE` last,
primerl.transport.snapshots); the server loads the directory's safetensors into its engine between two decode steps.
The other modes fall back to this one, and their server side loads full snapshots through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from primerl.transport.weight_transfer.base import LoadRefused, Publisher, Receiver
from primerl.transport.weight_transfer.modes import MODES


class FilesystemPublisher(Publisher):
    mode = MODES["filesystem"]

    def publish(self, step: int, is_last: bool, also_full: bool) -> dict[str, Any]:
        return self._write_full(step)


class FilesystemReceiver(Receiver):
    mode = MODES["filesystem"]
    live_note = "from {shown}"
    loaded_note = "loaded {shown}"

    def identity(self, snapshot: Path, step: int) -> tuple:
        """The path and its files' sizes and modification times."""
        files = sorted(snapshot.iterdir()) if snapshot.is_dir() else [snapshot]
        return (str(snapshot.resolve()), *((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files
                                           if f.is_file()))

    async def apply(self, snapshot: Path, step: int, shown: str) -> None:
        try:
            await self.engine.update_weights(snapshot, step)
        except (OSError, ValueError, KeyError) as e:
            raise LoadRefused(f"could not load weights from {shown}: {e}") from None
