"""Named tensors packed into byte buckets for the weight broadcast (primerl.transport.broadcast).

Each bucket is one contiguous uint8 buffer of at most `bucket_bytes` (a larger tensor travels alone), tensors at
64-byte aligned offsets, in the sender's order. The `Manifest` (names, dtypes, shapes, offsets per bucket) lets a
receiver rebuild every tensor as a view of its bucket.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

ALIGN_BYTES = 64  # tensor offsets inside a bucket: enough for any dtype view and for vectorised copies


class TensorSpec(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in its bucket."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def num_bytes(self) -> int:
        return _numel(self.shape) * self.torch_dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    num_bytes: int
    tensors: tuple[TensorEntry, ...]


@dataclass(frozen=True)
class Manifest:
    """What a transfer carries, bucket by bucket, in send order."""

    buckets: tuple[Bucket, ...]

    @property
    def num_bytes(self) -> int:
        return sum(b.num_bytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.tensors) for b in self.buckets)

    def entries(self) -> Iterator[TensorEntry]:
        for bucket in self.buckets:
            yield from bucket.tensors

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {e.name: e.shape for e in self.entries()}

    def summary(self) -> dict[str, Any]:
        dtypes: dict[str, int] = {}
        for entry in self.entries():
            dtypes[entry.dtype] = dtypes.get(entry.dtype, 0) + 1
        return {"num_tensors": self.num_tensors, "num_bytes": self.num_bytes, "num_buckets": len(self.buckets),
                "dtypes": dict(sorted(dtypes.items()))}

    def to_json(self) -> str:
        buckets = [{"num_bytes": b.num_bytes, "tensors": [[e.name, e.dtype, list(e.shape), e.offset] for e in b.tensors]}
                   for b in self.buckets]
        return json.dumps({"buckets": buckets}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        return cls(tuple(
            Bucket(b["num_bytes"], tuple(TensorEntry(n, d, tuple(s), o) for n, d, s, o in b["tensors"]))
            for b in data["buckets"]
        ))


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")  # noqa: TRY004 - a bad value in a manifest, not a type error
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int) -> Manifest:
    """Pack tensors, in the given order, into buckets of at most `bucket_bytes` (a bigger tensor gets a bucket of its
    own). The result depends only on the specs, so sender and receivers agree on every offset."""
    if bucket_bytes < 1:
        raise ValueError("bucket_bytes must be positive")
    buckets: list[Bucket] = []
    current: list[TensorEntry] = []
    used = 0
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r} appears twice")
        seen.add(spec.name)
        size = _numel(spec.shape) * spec.dtype.itemsize
        offset = _align(used)
        if current and offset + size > bucket_bytes:
            buckets.append(Bucket(used, tuple(current)))
            current, used, offset = [], 0, 0
        current.append(TensorEntry(spec.name, dtype_name(spec.dtype), tuple(int(d) for d in spec.shape), offset))
        used = offset + size
    if current:
        buckets.append(Bucket(used, tuple(current)))
    return Manifest(tuple(buckets))


def pack_bucket(bucket: Bucket, tensors: Sequence[Tensor], out: Tensor) -> None:
    """Copy `tensors` (in the bucket's order; cast and moved as needed) into the uint8 buffer `out`."""
    if len(tensors) != len(bucket.tensors):
        raise ValueError(f"bucket holds {len(bucket.tensors)} tensors, got {len(tensors)}")
    for entry, tensor in zip(bucket.tensors, tensors, strict=True):
        if tuple(tensor.shape) != entry.shape:
            raise ValueError(f"{entry.name}: shape {tuple(tensor.shape)}, manifest says {entry.shape}")
        _view(out, entry).copy_(tensor)


def unpack_bucket(bucket: Bucket, buffer: Tensor) -> list[tuple[str, Tensor]]:
    """The named tensors of a received bucket, as views into `buffer`."""
    return [(entry.name, _view(buffer, entry)) for entry in bucket.tensors]


def _view(buffer: Tensor, entry: TensorEntry) -> Tensor:
    return buffer[entry.offset : entry.offset + entry.num_bytes].view(entry.torch_dtype).view(entry.shape)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES
