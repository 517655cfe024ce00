"""The training batch on disk: the orchestrator writes `<run>/rollouts/step_<n>/`, the trainer reads it
(docs/trainer.md, "Batches").

Contract, in four lines:
- A *sample* is one token sequence (prompt + completion, possibly several turns) with per-token `loss_mask` (1 on
  tokens the policy sampled), `inference_logprobs` (log-prob of each token under the policy that sampled it, aligned
  with the token itself, 0 where `loss_mask` is 0) and `advantages` (per token, or one number for the whole sample).
- `pack_samples` packs samples into rows of exactly `seq_len` tokens; `position_ids` restart at 0 for every sample and
  `sample_index` says which sample each token belongs to (-1 on padding), so attention never crosses samples.
  With `share_prefixes`, samples that begin with the same prompt (a group's rollouts) are laid out as the prompt once,
  then each sample's own tokens: those tokens have `parent_index` = the prompt segment's index and attend to it as if
  it were their own beginning (the prompt segment's index is past the samples', so it names no sample).
- `write_batch` splits the rows over data-parallel ranks (equal row counts, balanced tokens) and publishes the batch
  atomically: everything is written under a temporary name, then the directory is renamed to `step_<n>`.

Step numbering (docs/trainer.md): `rollouts/step_<n>` is the batch the trainer consumes when it holds policy version
n (the weights after n optimizer steps); it must come from policy version >= n - max_async_steps (docs/rl.md, "The
async rule").
Training on it produces policy version n + 1, published as `weights/step_<n+1>`.

Layout of `rollouts/step_<n>/`:
    meta.json              {"format_version", "step", "seq_len", "num_ranks", "rows_per_rank", "temperature",
                            "num_samples", "num_tokens", "num_loss_tokens", "num_truncated", "samples": [...], "extra"}
                           each of "samples": {"env", "policy_versions": [oldest, newest], "version_segments":
                           [[version, sampled tokens], ...] in token order (empty when unknown), "num_tokens", ...}
    rank_<r>.safetensors   arrays of shape [rows_per_rank, seq_len]: input_ids, position_ids, sample_index,
                           parent_index (int32), loss_mask (uint8), inference_logprobs, advantages (float32)

Only numpy, safetensors.numpy and JSON are used here: the orchestrator imports this module without torch.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from primerl.storage import fsync_path

FORMAT_VERSION = 2
ROLLOUTS_DIR = "rollouts"
META_FILE = "meta.json"

# name -> numpy dtype of every per-token array in a batch file
ROW_FIELDS: dict[str, Any] = {
    "input_ids": np.int32,
    "position_ids": np.int32,
    "sample_index": np.int32,
    "parent_index": np.int32,
    "loss_mask": np.uint8,
    "inference_logprobs": np.float32,
    "advantages": np.float32,
}


@dataclass
class Sample:
    """One sequence to train on. All per-token lists have the same length; see the module docstring for alignment."""

    input_ids: list[int]
    loss_mask: list[int]
    inference_logprobs: list[float]
    advantages: float | list[float]
    position_ids: list[int] | None = None  # default: 0, 1, 2, ...
    policy_versions: tuple[int, int] = (0, 0)  # oldest and newest policy version that sampled its tokens
    version_segments: list[list[int]] = field(default_factory=list)  # [version, tokens] runs over the sampled tokens
    env: str = ""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        per_token = {"loss_mask": self.loss_mask, "inference_logprobs": self.inference_logprobs}
        if not isinstance(self.advantages, (int, float)):
            per_token["advantages"] = self.advantages
        if self.position_ids is not None:
            per_token["position_ids"] = self.position_ids
        for name, values in per_token.items():
            if len(values) != n:
                raise ValueError(f"sample has {n} input_ids but {len(values)} {name}")
        if n and self.loss_mask[0]:
            raise ValueError("loss_mask[0] must be 0: the first token of a sample has no context to be predicted from")


@dataclass
class PackedRows:
    """Rows of `seq_len` tokens (numpy arrays of shape [num_rows, seq_len], keys = ROW_FIELDS) plus per-sample info."""

    arrays: dict[str, np.ndarray]
    samples: list[dict[str, Any]] = field(default_factory=list)
    num_truncated: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.arrays["input_ids"].shape[0])


@dataclass
class Batch:
    """What one trainer rank reads: its rows (numpy, [rows, seq_len]) and the batch's meta.json."""

    arrays: dict[str, np.ndarray]
    meta: dict[str, Any]

    @property
    def num_rows(self) -> int:
        return int(self.arrays["input_ids"].shape[0])


def empty_rows(num_rows: int, seq_len: int, pad_token_id: int = 0) -> dict[str, np.ndarray]:
    """Padding rows: pad tokens, no loss, sample_index -1, positions 0..seq_len-1 (one causal block of padding)."""
    rows = {name: np.zeros((num_rows, seq_len), dtype=dtype) for name, dtype in ROW_FIELDS.items()}
    rows["input_ids"][:] = pad_token_id
    rows["sample_index"][:] = -1
    rows["parent_index"][:] = -1
    rows["position_ids"][:] = np.arange(seq_len, dtype=np.int32)
    return rows


def shared_prompt_length(sample: Sample) -> int:
    """How many leading tokens of `sample` it may share with others: those before its first loss token (0 when it
    has its own position ids, which a shared layout would not keep)."""
    if sample.position_ids is not None:
        return 0
    return next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.input_ids))


@dataclass
class _Unit:
    """What first-fit places in one row: a shared prompt (or none) followed by the own tokens of `members`."""

    prompt: int  # tokens of the shared prompt laid out first (0: members are whole samples)
    members: list[int]
    length: int


def _units(samples: Sequence[Sample], lengths: list[int], seq_len: int, share_prefixes: bool) -> list[_Unit]:
    """Whole samples, each alone; with `share_prefixes`, samples that start with the same prompt and have tokens of
    their own after it form units of one prompt plus as many members as fit in a row."""
    families: dict[tuple[int, ...], list[int]] = {}
    units = []
    for i, sample in enumerate(samples):
        prompt = shared_prompt_length(sample) if share_prefixes else 0
        if 0 < prompt < lengths[i] == len(sample.input_ids):
            families.setdefault(tuple(sample.input_ids[:prompt]), []).append(i)
        else:
            units.append(_Unit(0, [i], lengths[i]))
    for prompt, members in families.items():
        if len(members) == 1:
            units.append(_Unit(0, members, lengths[members[0]]))
            continue
        unit = _Unit(len(prompt), [], len(prompt))
        for i in members:
            own = lengths[i] - len(prompt)
            if unit.members and unit.length + own > seq_len:
                units.append(unit)
                unit = _Unit(len(prompt), [], len(prompt))
            unit.members.append(i)
            unit.length += own
        units.append(unit if len(unit.members) > 1 else _Unit(0, unit.members, lengths[unit.members[0]]))
    return units


def pack_samples(
    samples: Sequence[Sample], seq_len: int, pad_token_id: int = 0, share_prefixes: bool = False
) -> PackedRows:
    """Pack samples into rows of exactly `seq_len` tokens, first-fit by decreasing length.

    A sample longer than `seq_len` is cut to its first `seq_len` tokens (counted in `num_truncated`). Each sample keeps
    its own position ids (restarting at 0); the tail of a row is padding with `loss_mask` 0 and `sample_index` -1.
    Sample `i` of the input is `sample_index == i` in the rows, whatever row it lands in. With `share_prefixes`, see
    the module docstring: a shared prompt is laid out once per row, with `sample_index` len(samples) + k.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    lengths = [min(len(s.input_ids), seq_len) for s in samples]
    units = [u for u in _units(samples, lengths, seq_len, share_prefixes) if u.length > 0]
    row_fill: list[int] = []
    placement: list[tuple[_Unit, int, int]] = []  # (unit, row, offset)
    for unit in sorted(units, key=lambda u: -u.length):
        row = next((r for r, used in enumerate(row_fill) if used + unit.length <= seq_len), None)
        if row is None:
            row_fill.append(0)
            row = len(row_fill) - 1
        placement.append((unit, row, row_fill[row]))
        row_fill[row] += unit.length

    arrays = empty_rows(len(row_fill), seq_len, pad_token_id)
    infos = []
    for i, sample in enumerate(samples):
        n = lengths[i]
        infos.append(
            {
                "env": sample.env,
                "policy_versions": list(sample.policy_versions),
                "version_segments": sample.version_segments,
                "num_tokens": n,
                "num_loss_tokens": int(sum(sample.loss_mask[:n])),
                "truncated": n < len(sample.input_ids),
            }
        )

    def put(row: int, start: int, sample: Sample, first: int, end: int, index: int, parent: int) -> None:
        """Tokens first..end-1 of `sample` at row[start:], as segment `index` continuing segment `parent`."""
        span = slice(start, start + end - first)
        arrays["input_ids"][row, span] = sample.input_ids[first:end]
        positions = sample.position_ids[first:end] if sample.position_ids is not None else np.arange(first, end)
        arrays["position_ids"][row, span] = positions
        arrays["sample_index"][row, span] = index
        arrays["parent_index"][row, span] = parent
        loss_mask = np.asarray(sample.loss_mask[first:end], dtype=np.uint8)
        arrays["loss_mask"][row, span] = loss_mask
        arrays["inference_logprobs"][row, span] = (
            np.asarray(sample.inference_logprobs[first:end], dtype=np.float32) * loss_mask
        )
        advantages = sample.advantages
        arrays["advantages"][row, span] = advantages if isinstance(advantages, (int, float)) else advantages[first:end]

    next_prompt_index = len(samples)
    for unit, row, offset in placement:
        if not unit.prompt:
            (i,) = unit.members
            put(row, offset, samples[i], 0, lengths[i], i, -1)
            continue
        prompt_index, next_prompt_index = next_prompt_index, next_prompt_index + 1
        put(row, offset, samples[unit.members[0]], 0, unit.prompt, prompt_index, -1)  # no loss tokens in a prompt
        arrays["advantages"][row, offset : offset + unit.prompt] = 0.0
        offset += unit.prompt
        for i in unit.members:
            put(row, offset, samples[i], unit.prompt, lengths[i], i, prompt_index)
            offset += lengths[i] - unit.prompt
    for row, used in enumerate(row_fill):  # the padding tail is a pseudo-sample of its own: positions restart
        arrays["position_ids"][row, used:] = np.arange(seq_len - used, dtype=np.int32)
    return PackedRows(arrays=arrays, samples=infos, num_truncated=sum(info["truncated"] for info in infos))


def split_rows(arrays: dict[str, np.ndarray], num_ranks: int, pad_token_id: int = 0) -> list[dict[str, np.ndarray]]:
    """Deal rows to `num_ranks` ranks: every rank gets the same number of rows (padding rows added where needed) and
    about the same number of loss tokens (rows go, heaviest first, to the rank with the fewest loss tokens so far)."""
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    num_rows, seq_len = arrays["input_ids"].shape
    rows_per_rank = max(1, -(-num_rows // num_ranks))
    weight = arrays["loss_mask"].sum(axis=1)
    assigned: list[list[int]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for row in sorted(range(num_rows), key=lambda r: -int(weight[r])):
        open_ranks = [k for k in range(num_ranks) if len(assigned[k]) < rows_per_rank]
        k = min(open_ranks, key=lambda k: (load[k], k))
        assigned[k].append(row)
        load[k] += int(weight[row])
    out = []
    for rows in assigned:
        part = {name: arr[sorted(rows)] for name, arr in arrays.items()}
        missing = rows_per_rank - len(rows)
        if missing:
            pad = empty_rows(missing, seq_len, pad_token_id)
            part = {name: np.concatenate([part[name], pad[name]]) for name in ROW_FIELDS}
        out.append(part)
    return out


def batch_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / ROLLOUTS_DIR / f"step_{step}"


def write_batch(
    run_dir: str | os.PathLike,
    step: int,
    samples: Sequence[Sample],
    seq_len: int,
    num_ranks: int = 1,
    pad_token_id: int = 0,
    temperature: float = 1.0,
    extra: dict[str, Any] | None = None,
    share_prefixes: bool = False,
) -> Path:
    """Pack `samples`, split them over `num_ranks` trainer ranks and publish `<run>/rollouts/step_<step>/` atomically.

    `temperature` is the sampling temperature the inference engine used: the trainer divides its logits by it so its
    log-probs are comparable with `inference_logprobs`. `extra` (JSON-serialisable) is stored as is in meta.json.
    Returns the published directory. Raises FileExistsError if that step was already published.
    """
    final = batch_dir(run_dir, step)
    if final.exists():
        raise FileExistsError(f"{final} already exists")
    packed = pack_samples(samples, seq_len, pad_token_id, share_prefixes)
    parts = split_rows(packed.arrays, num_ranks, pad_token_id)
    meta = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "seq_len": seq_len,
        "num_ranks": num_ranks,
        "rows_per_rank": int(parts[0]["input_ids"].shape[0]),
        "pad_token_id": pad_token_id,
        "temperature": temperature,
        "num_samples": len(samples),
        "num_tokens": int(sum(s["num_tokens"] for s in packed.samples)),
        "num_loss_tokens": int(packed.arrays["loss_mask"].sum()),
        "num_packed_tokens": int((packed.arrays["sample_index"] >= 0).sum()),
        "num_truncated": packed.num_truncated,
        "samples": packed.samples,
        "extra": extra or {},
    }
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        for rank, part in enumerate(parts):
            save_file(part, str(tmp / f"rank_{rank}.safetensors"), metadata={"step": str(step), "rank": str(rank)})
        (tmp / META_FILE).write_text(json.dumps(meta))
        fsync_path(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_path(final.parent)
    return final


def read_batch(path: str | os.PathLike, rank: int = 0, world_size: int = 1) -> Batch:
    """Read the rows of `rank` out of `world_size` from a published batch directory.

    When the batch was split for another number of ranks (the trainer was restarted at another world size), all row
    files are read and dealt again, so every rank still gets the same number of rows.
    """
    path = Path(path)
    meta = json.loads((path / META_FILE).read_text())
    if meta.get("format_version") not in (1, FORMAT_VERSION):
        raise ValueError(f"{path}: batch format {meta.get('format_version')}, this trainer reads 1 and {FORMAT_VERSION}")

    def load(r: int) -> dict[str, np.ndarray]:
        arrays = load_file(str(path / f"rank_{r}.safetensors"))
        arrays.setdefault("parent_index", np.full_like(arrays["sample_index"], -1))  # format 1: nothing shared
        return arrays

    if meta["num_ranks"] == world_size:
        arrays = load(rank)
    else:
        parts = [load(r) for r in range(meta["num_ranks"])]
        merged = {name: np.concatenate([p[name] for p in parts]) for name in ROW_FIELDS}
        arrays = split_rows(merged, world_size, meta.get("pad_token_id", 0))[rank]
    return Batch(arrays={name: arrays[name] for name in ROW_FIELDS}, meta=meta)


def wait_for_batch(
    run_dir: str | os.PathLike,
    step: int,
    poll_interval_s: float = 0.05,
    timeout_s: float | None = None,
    on_wait: Callable[[Path, float], None] | None = None,
    log_every_s: float = 30.0,
) -> tuple[Path, float]:
    """Block until `rollouts/step_<step>` is published; return its path and the seconds spent waiting.

    `on_wait(path, waited_s)` is called once when waiting starts and then every `log_every_s` seconds.
    Raises TimeoutError after `timeout_s` (None waits forever).
    """
    path = batch_dir(run_dir, step)
    start = time.monotonic()
    next_log = start
    while not (path / META_FILE).is_file():
        now = time.monotonic()
        if timeout_s is not None and now - start > timeout_s:
            raise TimeoutError(f"no batch at {path} after {timeout_s:.0f}s")
        if on_wait is not None and now >= next_log:
            on_wait(path, now - start)
            next_log = now + log_every_s
        time.sleep(poll_interval_s)
    return path, time.monotonic() - start
