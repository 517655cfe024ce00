"""The receiving end of the weight broadcast (primerl.transport.broadcast has the contract): `TransferFeed` follows
the sender's announcements through the store, `BroadcastReceiver` is one receiver rank of the group.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from primerl.transport.broadcast import (
    _IDLE_POLL_S,
    GroupClosed,
    GroupFormationError,
    Transfer,
    WeightTransferError,
    _broadcast,
    _buffer_device,
    _device_label,
    _get,
    _Keys,
    _process_group,
    _short,
    _store,
    _wait_keys,
)
from primerl.transport.buckets import Manifest, unpack_bucket

log = logging.getLogger("primerl.transport.broadcast")


class TransferFeed:
    """A store client that follows the sender's announcements and answers for receiver ranks. A receiver process
    uses it through `BroadcastReceiver`; a vLLM server process (whose ranks live in its workers) uses it directly to
    learn when to make the workers receive, and to confirm for them."""

    def __init__(self, host: str, port: int, *, init_timeout_s: float = 600.0, timeout_s: float = 120.0):
        self.host, self.port = host, port
        self.init_timeout_s, self.timeout_s = init_timeout_s, timeout_s
        self._store: dist.Store | None = None
        self.next_seq = 1

    def connect(self) -> dist.Store:
        if self._store is None:
            try:
                self._store = _store(self.host, self.port, is_master=False, timeout_s=self.init_timeout_s)
                self._store.get(_Keys.group_id)  # the sender writes it first thing
            except Exception as e:  # noqa: BLE001
                self._store = None
                raise GroupFormationError(f"no weight store at {self.host}:{self.port} within "
                                          f"{self.init_timeout_s:g}s ({_short(e)}); is the trainer running with "
                                          "weights.transfer = broadcast?") from None
            self._store.set_timeout(datetime.timedelta(seconds=self.timeout_s))
        return self._store

    @property
    def store(self) -> dist.Store:
        if self._store is None:
            raise RuntimeError("not connected")
        return self._store

    def closed_reason(self) -> str | None:
        try:
            if self.store.check([_Keys.closed]):
                return _get(self.store, _Keys.closed)
        except Exception as e:  # noqa: BLE001 - the sender (and with it the store) is gone
            return f"the weight store went away ({_short(e)})"
        return None

    def next_transfer(self, timeout_s: float) -> Transfer | None:
        """The next announced transfer, or None if none came within `timeout_s`. Raises GroupClosed once the sender
        has closed the group or gone away."""
        key = _Keys.transfer(self.next_seq, "announce")
        missing = _wait_keys(self.store, [key], timeout_s, stop=self.closed_reason, poll_s=_IDLE_POLL_S)
        if missing:
            if (reason := self.closed_reason()) is not None:
                raise GroupClosed(reason)
            return None
        data = json.loads(_get(self.store, key))
        transfer = Transfer(self.next_seq, data["step"], data["transfer_id"],
                            Manifest.from_json(json.dumps(data["manifest"])))
        self.next_seq += 1
        return transfer

    def answer(self, transfer: Transfer, what: Literal["ready", "done"], rank: int, error: str | None = None) -> None:
        try:
            self.store.set(_Keys.transfer(transfer.seq, what, rank), "ok" if error is None else f"error: {error}")
        except Exception as e:  # noqa: BLE001
            raise GroupClosed(f"the weight store went away ({_short(e)})") from None

    def close(self) -> None:
        self._store = None


class WeightReceiver(ABC):
    """The receiving end of a weight transfer, as an engine uses it (the embedded engine in its receiver thread, the
    vLLM worker extension in each worker):

        rank = receiver.join()                          # once; GroupFormationError if the group does not form
        while True:
            transfer = receiver.next_transfer(1.0)      # None: nothing yet; GroupClosed: the sender is done
            for name, tensor in receiver.receive(transfer, check):   # check(manifest) may refuse it
                ...                                     # apply or stage; views stay valid while referenced
            receiver.finish(transfer, error=None)       # after applying: the sender waits for this
        receiver.close()
    """

    @abstractmethod
    def join(self) -> int:
        """Join the group; return this receiver's rank."""

    @abstractmethod
    def next_transfer(self, timeout_s: float) -> Transfer | None:
        """The next announced transfer, None after `timeout_s` without one."""

    @abstractmethod
    def receive(self, transfer: Transfer, check: Callable[[Manifest], None] | None = None
                ) -> Iterator[tuple[str, Tensor]]:
        """Answer `ready` (or the error `check` raised), then yield every named tensor of the transfer, bucket by
        bucket. Raises WeightTransferError when the sender aborts or the collective fails."""

    @abstractmethod
    def finish(self, transfer: Transfer, error: str | None = None) -> None:
        """Confirm that the weights are applied (or say why not)."""

    @abstractmethod
    def close(self) -> None:
        """Leave the group."""


class BroadcastReceiver(WeightReceiver):
    """One receiver rank: claims its rank in the store, joins the process group, receives buckets into buffers on
    `device` (the engine's device with NCCL, the CPU with gloo)."""

    def __init__(self, host: str, port: int, *, device: torch.device | str = "cpu", init_timeout_s: float = 600.0,
                 timeout_s: float = 120.0):
        self.feed = TransferFeed(host, port, init_timeout_s=init_timeout_s, timeout_s=timeout_s)
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.rank: int | None = None
        self.world_size: int | None = None
        self.backend: str | None = None
        self._group = None

    def join(self) -> int:
        feed = self.feed
        store = feed.connect()
        world_size = int(_get(store, _Keys.world_size))
        rank = int(store.add(_Keys.ranks, 1))
        if rank >= world_size:
            raise GroupFormationError(f"the weight group at {feed.host}:{feed.port} expects {world_size - 1} "
                                      f"receiver(s) and all have joined (weights.broadcast.receivers on the trainer)")
        store.set(_Keys.joined(rank), json.dumps({"device": _device_label(self.device), "host": socket.gethostname(),
                                                  "pid": os.getpid()}))
        missing = _wait_keys(store, [_Keys.backend], feed.init_timeout_s)
        if missing:
            raise GroupFormationError(f"the trainer did not finish forming the weight group within "
                                      f"{feed.init_timeout_s:g}s")
        backend = _get(store, _Keys.backend)
        if backend.startswith("error: "):
            raise GroupFormationError(backend.removeprefix("error: "))
        try:
            if backend == "nccl":
                if self.device.type != "cuda":
                    raise GroupFormationError("backend nccl but this receiver is not on a GPU")
                torch.cuda.set_device(self.device)
            self._group = _process_group(backend, store, rank, world_size, self.timeout_s, feed.host)
            token = torch.zeros(1, dtype=torch.int64, device=_buffer_device(backend, self.device))
            _broadcast(self._group, token, self.timeout_s)
        except GroupFormationError:
            raise
        except Exception as e:  # noqa: BLE001
            raise GroupFormationError(f"the {backend} weight group did not form: {_short(e)}") from None
        if int(token.item()) != int(_get(store, _Keys.group_id), 16):
            raise GroupFormationError("the first broadcast of the weight group carried the wrong group id")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        log.info("joined weight group %s at %s:%d as rank %d of %d (%s)", _get(store, _Keys.group_id), feed.host,
                 feed.port, rank, world_size, backend)
        return rank

    def next_transfer(self, timeout_s: float) -> Transfer | None:
        return self.feed.next_transfer(timeout_s)

    def receive(self, transfer: Transfer, check: Callable[[Manifest], None] | None = None
                ) -> Iterator[tuple[str, Tensor]]:
        if self.rank is None or self._group is None:
            raise WeightTransferError("not joined to a weight group")
        try:
            if check is not None:
                check(transfer.manifest)
        except Exception as e:
            self.feed.answer(transfer, "ready", self.rank, error=str(e).splitlines()[0] if str(e) else _short(e))
            raise
        self.feed.answer(transfer, "ready", self.rank)
        go_key = _Keys.transfer(transfer.seq, "go")
        if _wait_keys(self.feed.store, [go_key], self.timeout_s, stop=self.feed.closed_reason):
            raise WeightTransferError(f"weights step {transfer.step}: no 'go' from the sender within "
                                      f"{self.timeout_s:g}s")
        if _get(self.feed.store, go_key) != "send":
            raise WeightTransferError(f"weights step {transfer.step}: the sender aborted the transfer")
        device = _buffer_device(self.backend or "gloo", self.device)
        buckets = transfer.manifest.buckets
        for index, bucket in enumerate(buckets):
            buffer = torch.empty(bucket.num_bytes, dtype=torch.uint8, device=device)
            try:
                _broadcast(self._group, buffer, self.timeout_s)
            except Exception as e:  # noqa: BLE001
                raise WeightTransferError(f"weights step {transfer.step}: bucket {index + 1}/{len(buckets)} did not "
                                          f"arrive: {_short(e)}") from None
            yield from unpack_bucket(bucket, buffer)

    def finish(self, transfer: Transfer, error: str | None = None) -> None:
        if self.rank is None:
            raise RuntimeError("not joined to a weight group")
        self.feed.answer(transfer, "done", self.rank, error)

    def close(self) -> None:
        self._group = None
        self.feed.close()
