"""Build a mode's publisher (trainer side) or the server's receivers: the only map from a mode to its classes.

    publisher = build_publisher(cfg.weights, source, run_dir)          # the trainer (a WeightSource over its policy)
    receivers = build_receivers(cfg.weight_transfer, engine, cfg.weight_broadcast, state)   # the inference server

Both raise `Unsupported` for an unknown mode. Building a broadcast publisher forms the weight group (collective: every
trainer rank builds it); building a shared one allocates the buffer on rank 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from primerl.transport.weight_transfer.base import (
    LoadState,
    Publisher,
    PublishSettings,
    Receiver,
    Receivers,
    ServingEngine,
    WeightSource,
)
from primerl.transport.weight_transfer.filesystem import FilesystemPublisher, FilesystemReceiver
from primerl.transport.weight_transfer.modes import transfer_mode
from primerl.transport.weight_transfer.shared_buffer import SharedBufferPublisher, SharedBufferReceiver
from primerl.transport.weight_transfer.weight_group import WeightGroupPublisher, WeightGroupReceiver

PUBLISHERS: dict[str, type[Publisher]] = {
    cls.mode.name: cls for cls in (FilesystemPublisher, WeightGroupPublisher, SharedBufferPublisher)
}
RECEIVERS: dict[str, type[Receiver]] = {
    cls.mode.name: cls for cls in (FilesystemReceiver, WeightGroupReceiver, SharedBufferReceiver)
}


def build_publisher(settings: PublishSettings, source: WeightSource, run_dir: Path) -> Publisher:
    """The publisher of mode `settings.transfer`. Collective: every trainer rank calls it."""
    return PUBLISHERS[transfer_mode(settings.transfer).name](source, Path(run_dir), settings)


def build_receivers(mode: str, engine: ServingEngine, group: Any, state: LoadState | None = None) -> Receivers:
    """The server's receivers, mode `mode` the one started with the engine. `group` is where the trainer's weight
    group is (the server's `weight_broadcast`); `state` is shared with whatever else must not overlap a weight
    change (the server's pause and resume)."""
    state = state or LoadState()
    return Receivers(transfer_mode(mode), {name: cls(engine, state, group) for name, cls in RECEIVERS.items()})
