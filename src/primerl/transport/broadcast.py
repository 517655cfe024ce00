"""Weight broadcast: trainer rank 0 sends each new policy version to the inference receivers over a collective group.

Contract (docs/weights.md has the whole story):
- The group is built without torch's default process group: trainer rank 0 hosts a `TCPStore` at (host, port); every
  member builds `ProcessGroupNCCL` (CUDA everywhere, distinct GPUs) or `ProcessGroupGloo` over a `PrefixStore`. Rank 0
  is the sender; ranks 1..N are receivers (one per inference process, or one per vLLM worker), which claim their rank
  from the store. Formation that fails (nobody joins within `init_timeout_s`, port in use, ...) raises
  `GroupFormationError`, which callers turn into a fallback to the filesystem.
- A transfer moves named tensors packed into byte buckets (`primerl.transport.buckets`), described by a `Manifest`.
- Every transfer starts with a handshake through the store, so nothing ever waits in a collective for a peer that is
  not coming: the sender announces (seq, step, manifest); each receiver checks the manifest and answers `ready` (or
  an error); the sender waits for all answers at most `timeout_s`, then says `go` (or `abort`) and broadcasts the
  buckets; each receiver answers `done` once the weights are applied. Anything missing raises `WeightTransferError`
  naming what did not arrive and how long the sender waited. The collectives themselves time out after `timeout_s`.

This module holds the errors, the store layout, the process group and the sender; the receivers are in
`primerl.transport.broadcast_receiver`. Imported by trainer and inference code and the weight-transfer component (it imports torch);
`primerl.transport.snapshots` stays torch-free.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor

from primerl.multicast import multicast_off
from primerl.transport.buckets import Manifest, pack_bucket

log = logging.getLogger(__name__)

Backend = Literal["auto", "nccl", "gloo"]
SENDER_RANK = 0
_POLL_S = 0.02  # handshake waits
_IDLE_POLL_S = 0.1  # a receiver waiting for the next announcement
_KEY_PREFIX = "primerl/weights/"


class GroupFormationError(RuntimeError):
    """The weight group could not be formed; the caller falls back to the filesystem transfer."""


class WeightTransferError(RuntimeError):
    """One transfer failed (a peer did not answer in time, refused the manifest, or the collective broke)."""


class GroupClosed(WeightTransferError):
    """The sender closed the group (run over, or it fell back to the filesystem)."""



# ---------------------------------------------------------------------------------------------------------------------
# The group: store keys and process group


@dataclass(frozen=True)
class Transfer:
    """An announced transfer, as a receiver sees it."""

    seq: int
    step: int
    transfer_id: str
    manifest: Manifest

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for handing a transfer to another process (vLLM's collective_rpc)."""
        return {"seq": self.seq, "step": self.step, "transfer_id": self.transfer_id,
                "manifest": self.manifest.to_json()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Transfer:
        return cls(data["seq"], data["step"], data["transfer_id"], Manifest.from_json(data["manifest"]))


@dataclass(frozen=True)
class TransferStats:
    step: int
    transfer_id: str
    num_bytes: int
    num_buckets: int
    num_tensors: int
    seconds: float


class _Keys:
    """The store layout. Formation: `world_size`, `group_id`, `ranks` (counter), `joined/<r>`, `backend`.
    Transfer `seq`: `t/<seq>/announce`, `t/<seq>/ready/<r>`, `t/<seq>/go`, `t/<seq>/done/<r>`. `closed` ends it."""

    world_size = "world_size"
    group_id = "group_id"
    ranks = "ranks"
    backend = "backend"
    closed = "closed"

    @staticmethod
    def joined(rank: int) -> str:
        return f"joined/{rank}"

    @staticmethod
    def transfer(seq: int, what: str, rank: int | None = None) -> str:
        return f"t/{seq}/{what}" + ("" if rank is None else f"/{rank}")


def _store(host: str, port: int, is_master: bool, timeout_s: float) -> dist.Store:
    raw = dist.TCPStore(host, port, is_master=is_master, wait_for_workers=False,
                        timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(_KEY_PREFIX, raw)


def _get(store: dist.Store, key: str) -> str:
    return store.get(key).decode()


def _wait_keys(store: dist.Store, keys: Sequence[str], timeout_s: float, stop: Callable[[], str | None] = lambda: None,
               poll_s: float = _POLL_S) -> list[str]:
    """Poll until every key exists or `timeout_s` passed; return the keys still missing. `stop()` returning a
    message ends the wait early with that message as a GroupClosed; so does a store that went away."""
    deadline = time.monotonic() + timeout_s
    missing = list(keys)
    while True:
        try:
            missing = [k for k in missing if not store.check([k])]
        except Exception as e:  # noqa: BLE001 - DistNetworkError & co.: the host of the store is gone
            raise GroupClosed(f"the weight store went away ({_short(e)})") from None
        if not missing or time.monotonic() >= deadline:
            return missing
        if (reason := stop()) is not None:
            raise GroupClosed(reason)
        time.sleep(poll_s)


def _device_label(device: torch.device) -> str:
    """'cuda:<uuid>' (the physical GPU, whatever CUDA_VISIBLE_DEVICES says) or 'cpu'."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def _is_loopback(host: str) -> bool:
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1"
                   for info in socket.getaddrinfo(host, None))
    except OSError:
        return False


def _process_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout_s: float, host: str):
    """A process group of its own (no default group), rendezvousing through `store`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("pg/", store)
    if backend == "nccl":
        multicast_off(os.environ)  # NCCL_NVLS_ENABLE=0 & co. before the communicator exists
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # a group on loopback stays on loopback: no hostname lookup (which may name an address nobody can reach)
    device = (dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if _is_loopback(host)
              else dist.ProcessGroupGloo.create_default_device())
    options._devices = [device]
    return dist.ProcessGroupGloo(prefixed, rank, world_size, options)


def _broadcast(group, tensor: Tensor, timeout_s: float) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = SENDER_RANK
    options.timeout = datetime.timedelta(seconds=timeout_s)
    group.broadcast([tensor], options).wait()


def _short(error: BaseException) -> str:
    """The first line of an error (c10d appends C++ stack traces)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def _buffer_device(backend: str, device: torch.device) -> torch.device:
    return device if backend == "nccl" else torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------------
# Sender (trainer rank 0)


class BroadcastSender:
    """Rank 0 of the weight group: hosts the store, forms the group, runs transfers.

    A transfer is `begin(step, manifest)`, then `send_bucket(i, tensors)` for every bucket in order, then `end()`.
    Each raises `WeightTransferError` on failure; after one, the group is unusable: `close()` it."""

    def __init__(self, host: str, port: int, receivers: int, *, backend: Backend = "auto",
                 device: torch.device | str = "cpu", init_timeout_s: float = 600.0, timeout_s: float = 120.0):
        if receivers < 1:
            raise ValueError("a weight group needs at least one receiver")
        self.host, self.port, self.receivers = host, port, receivers
        self.requested_backend = backend
        self.device = torch.device(device)
        self.init_timeout_s, self.timeout_s = init_timeout_s, timeout_s
        self.backend: str | None = None
        self.group_id = secrets.token_hex(4)
        self._store: dist.Store | None = None
        self._group = None
        self._seq = 0
        self._transfer: tuple[int, int, Manifest, float] | None = None
        self._buffer: Tensor | None = None

    @property
    def world_size(self) -> int:
        return 1 + self.receivers

    @property
    def receiver_ranks(self) -> list[int]:
        return list(range(1, self.world_size))

    def form(self) -> None:
        """Host the store, wait for every receiver to join, agree on the backend, build the group and check it with a
        first broadcast. Raises GroupFormationError."""
        started = time.monotonic()
        try:
            self._store = _store(self.host, self.port, is_master=True, timeout_s=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - DistNetworkError, OSError, ...: all mean "cannot host the store"
            raise GroupFormationError(f"cannot host the weight store on {self.host}:{self.port}: {_short(e)}") from None
        store = self._store
        store.set(_Keys.world_size, str(self.world_size))
        store.set(_Keys.group_id, self.group_id)
        log.info("weight group %s: store on %s:%d, waiting up to %.0fs for %d receiver(s)", self.group_id, self.host,
                 self.port, self.init_timeout_s, self.receivers)
        missing = _wait_keys(store, [_Keys.joined(r) for r in self.receiver_ranks], self.init_timeout_s)
        if missing:
            ranks = [int(k.rsplit("/", 1)[1]) for k in missing]
            self._fail_formation(f"receiver rank(s) {ranks} of {self.receivers} did not join within "
                                 f"{self.init_timeout_s:g}s (store {self.host}:{self.port})")
        devices = {r: json.loads(_get(store, _Keys.joined(r)))["device"] for r in self.receiver_ranks}
        try:
            self.backend = self._choose_backend(devices)
        except GroupFormationError as e:
            self._fail_formation(str(e))
        store.set(_Keys.backend, self.backend)
        try:
            if self.backend == "nccl":
                torch.cuda.set_device(self.device)
            self._group = _process_group(self.backend, store, SENDER_RANK, self.world_size, self.timeout_s, self.host)
            token = torch.tensor([int(self.group_id, 16)], dtype=torch.int64,
                                 device=_buffer_device(self.backend, self.device))
            _broadcast(self._group, token, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure of the first collective means no group
            self._fail_formation(f"the {self.backend} group did not form: {_short(e)}")
        log.info("weight group %s formed in %.1fs: %s, %d receiver(s) on %s", self.group_id,
                 time.monotonic() - started, self.backend, self.receivers, ", ".join(sorted(set(devices.values()))))

    def _choose_backend(self, devices: dict[int, str]) -> str:
        mine = _device_label(self.device)
        labels = [mine, *devices.values()]
        all_cuda = all(label.startswith("cuda:") for label in labels)
        distinct = len(set(labels)) == len(labels)
        if self.requested_backend == "gloo":
            return "gloo"
        if self.requested_backend == "nccl":
            if not all_cuda:
                raise GroupFormationError(f"backend nccl needs every member on a GPU; devices: {labels}")
            if not distinct:
                raise GroupFormationError("backend nccl cannot join two processes on the same GPU (trainer and "
                                          "inference colocated); use backend gloo or the filesystem transfer")
            return "nccl"
        return "nccl" if all_cuda and distinct else "gloo"

    def _fail_formation(self, message: str) -> NoReturn:
        if self._store is not None:
            try:
                self._store.set(_Keys.backend, f"error: {message}")
            except Exception as e:  # noqa: BLE001 - the store itself may be what failed
                log.debug("could not tell the receivers: %s", _short(e))
        self.close(message)
        raise GroupFormationError(message)

    def begin(self, step: int, manifest: Manifest) -> None:
        """Announce a transfer of policy version `step` and wait until every receiver is ready for it."""
        store = self._require_group()
        self._seq += 1
        seq, started = self._seq, time.perf_counter()
        transfer_id = f"{self.group_id}-{seq}"
        announce = {"step": step, "transfer_id": transfer_id, "manifest": json.loads(manifest.to_json())}
        store.set(_Keys.transfer(seq, "announce"), json.dumps(announce))
        keys = [_Keys.transfer(seq, "ready", r) for r in self.receiver_ranks]
        missing = _wait_keys(store, keys, self.timeout_s)
        refused = {} if missing else self._errors(keys)
        if missing or refused:
            store.set(_Keys.transfer(seq, "go"), "abort")
            if missing:
                ranks = [int(k.rsplit("/", 1)[1]) for k in missing]
                raise WeightTransferError(f"weights step {step}: no 'ready' from receiver rank(s) {ranks} within "
                                          f"{self.timeout_s:g}s")
            raise WeightTransferError(f"weights step {step}: refused by " + "; ".join(
                f"rank {r}: {msg}" for r, msg in refused.items()))
        store.set(_Keys.transfer(seq, "go"), "send")
        self._transfer = (seq, step, manifest, started)
        if seq > 1:  # the previous transfer's keys are no longer needed by anyone
            for key in _transfer_keys(seq - 1, self.receiver_ranks):
                store.delete_key(key)

    def send_bucket(self, index: int, tensors: Sequence[Tensor]) -> None:
        """Pack bucket `index` of the announced manifest from `tensors` and broadcast it."""
        if self._transfer is None:
            raise RuntimeError("send_bucket outside a transfer (call begin first)")
        _, step, manifest, _ = self._transfer
        bucket = manifest.buckets[index]
        buffer = self._bucket_buffer(max(b.num_bytes for b in manifest.buckets))[: bucket.num_bytes]
        pack_bucket(bucket, tensors, buffer)
        try:
            _broadcast(self._group, buffer, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - gloo/NCCL errors and timeouts
            raise WeightTransferError(f"weights step {step}: broadcast of bucket {index + 1}/{len(manifest.buckets)} "
                                      f"failed: {_short(e)}") from None

    def end(self) -> TransferStats:
        """Wait until every receiver has applied the weights; return the transfer's figures."""
        if self._transfer is None:
            raise RuntimeError("end outside a transfer (call begin first)")
        seq, step, manifest, started = self._transfer
        self._transfer = None
        store = self._require_group()
        keys = [_Keys.transfer(seq, "done", r) for r in self.receiver_ranks]
        missing = _wait_keys(store, keys, self.timeout_s)
        if missing:
            ranks = [int(k.rsplit("/", 1)[1]) for k in missing]
            raise WeightTransferError(f"weights step {step}: receiver rank(s) {ranks} did not confirm within "
                                      f"{self.timeout_s:g}s after the last bucket")
        if failed := self._errors(keys):
            raise WeightTransferError(f"weights step {step}: " + "; ".join(
                f"rank {r} could not apply them: {msg}" for r, msg in failed.items()))
        return TransferStats(step, f"{self.group_id}-{seq}", manifest.num_bytes, len(manifest.buckets),
                             manifest.num_tensors, time.perf_counter() - started)

    def _errors(self, keys: list[str]) -> dict[int, str]:
        answers = {int(k.rsplit("/", 1)[1]): _get(self._require_group(), k) for k in keys}
        return {r: a.removeprefix("error: ") for r, a in answers.items() if a != "ok"}

    def _bucket_buffer(self, num_bytes: int) -> Tensor:
        device = _buffer_device(self.backend or "gloo", self.device)
        if self._buffer is None or self._buffer.numel() < num_bytes or self._buffer.device != device:
            self._buffer = torch.empty(num_bytes, dtype=torch.uint8, device=device)
        return self._buffer

    def _require_group(self) -> dist.Store:
        if self._store is None or self._group is None:
            raise WeightTransferError("the weight group is not formed (or was closed)")
        return self._store

    def close(self, reason: str = "sender closed the group") -> None:
        """Tell the receivers the group is over and release it. Idempotent."""
        if self._store is not None:
            try:
                self._store.set(_Keys.closed, reason)
                time.sleep(4 * _POLL_S)  # let polling receivers read it before the store goes away with us
            except Exception as e:  # noqa: BLE001 - closing must not raise
                log.debug("could not tell the receivers the group is closed: %s", _short(e))
        self._group = None
        self._store = None
        self._buffer = None


def _transfer_keys(seq: int, ranks: Sequence[int]) -> list[str]:
    keys = [_Keys.transfer(seq, "announce"), _Keys.transfer(seq, "go")]
    for r in ranks:
        keys += [_Keys.transfer(seq, "ready", r), _Keys.transfer(seq, "done", r)]
    return keys
