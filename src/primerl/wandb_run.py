"""One Weights & Biases run per run directory, shared by every process that logs into it.

The first process to start (trainer or orchestrator of an `rl` run, or `sft`/`eval` alone) creates `<run>/wandb-run-id`
with a fresh W&B run id; the others read it, so all of them log to the same W&B run, and a resumed run (`--resume`)
continues it (`resume="allow"`). Online, the processes write to it in W&B's shared mode, labelled by source, with the
creator as the primary writer. Offline (`mode = "offline"`, or `WANDB_MODE=offline` in the environment, which wins
over the config), each process keeps its own files under `<run>/wandb/<source>/` (two offline writers cannot share
one directory), which `wandb sync` uploads into the one run. Each source's metrics are
`<source>/<key>` against their own step axis `<source>/step`, so the trainer's and the orchestrator's steps never
collide. The run's config is the recipe's manifest (`manifest.json` in the run directory or the one above it, where
`primerl run` writes it for its stages), else the process's own resolved config.
"""

from __future__ import annotations

import json
import os
import struct
import uuid
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from primerl.config.common import WandbConfig

RUN_ID_FILE = "wandb-run-id"
MANIFEST_FILE = "manifest.json"  # primerl.recipes.manifest.MANIFEST_FILE (not imported: it pulls in the recipe code)


def shared_run_id(run_dir: Path) -> tuple[str, bool]:
    """The run directory's W&B run id and whether this call created it (exactly one caller does)."""
    path = run_dir / RUN_ID_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    candidate = uuid.uuid4().hex[:12]  # W&B run ids: letters and digits
    draft = run_dir / f".{RUN_ID_FILE}.{os.getpid()}"
    draft.write_text(candidate + "\n")
    try:
        os.link(draft, path)  # appears whole or not at all: a reader never sees it empty
    except FileExistsError:
        return path.read_text().strip(), False
    finally:
        draft.unlink()
    return candidate, True


def run_config(run_dir: Path, fallback: Mapping[str, Any]) -> dict[str, Any]:
    for directory in (run_dir, run_dir.parent):
        if (directory / MANIFEST_FILE).is_file():
            return json.loads((directory / MANIFEST_FILE).read_text())
    return dict(fallback)


def start(cfg: WandbConfig, run_dir: Path, source: str, config: Mapping[str, Any]):
    """The W&B run `source` logs to (wandb.Run), started with the shared id; `config` is used when there is no
    manifest."""
    import wandb

    run_id, primary = shared_run_id(run_dir)
    mode = cfg.mode
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):  # wandb's own switch wins over the config
        mode = os.environ["WANDB_MODE"]
    if mode == "online":
        settings = wandb.Settings(mode="shared", x_label=source, x_primary=primary, x_update_finish_state=primary)
    else:
        settings = wandb.Settings(mode=mode, x_label=source)
    out = run_dir / "wandb" / source
    out.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        name=cfg.name or run_dir.resolve().name,
        id=run_id,
        resume="allow",
        dir=out,
        config=run_config(run_dir, config),
        settings=settings,
    )
    run.define_metric(f"{source}/step")
    run.define_metric(f"{source}/*", step_metric=f"{source}/step")
    return run


# The framing of W&B's transaction log (`run-<id>.wandb`): a 7-byte file header, then blocks of 32 KiB holding records,
# each a 7-byte header (crc32, length, kind) and a piece of one serialized `Record`; a record longer than the rest of
# its block continues in the next ones (kinds FIRST, MIDDLE, LAST); a block's tail shorter than a header is padding.
_FILE_HEADER = struct.Struct("<4sHB")  # b":W&B", 0xBEE1, version 0
_RECORD_HEADER = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def transaction_records(path: Path) -> list[bytes]:
    """The serialized records of one `.wandb` file, in order; ValueError on a file that is not one."""
    data = path.read_bytes()
    ident, magic, version = _FILE_HEADER.unpack_from(data, 0)
    if (ident, magic, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path} is not a W&B transaction log")
    records, pieces, offset = [], [], _FILE_HEADER.size
    while offset + _RECORD_HEADER.size <= len(data):
        room = _BLOCK - offset % _BLOCK
        if room < _RECORD_HEADER.size:
            offset += room
            continue
        checksum, length, kind = _RECORD_HEADER.unpack_from(data, offset)
        start = offset + _RECORD_HEADER.size
        if length == 0 and kind == 0:  # zero-filled rest of the last block
            break
        payload = data[start:start + length]
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != checksum:
            raise ValueError(f"{path}: bad checksum at byte {offset}")
        pieces.append(payload)
        if kind in (_FULL, _LAST):
            records.append(b"".join(pieces))
            pieces = []
        offset = start + length
    return records


def offline_history(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Every history row (`run.log`) in the offline W&B files under `<run_dir>/wandb/`, by W&B run id, in order."""
    from wandb.proto import wandb_internal_pb2

    history: dict[str, list[dict[str, Any]]] = {}
    for path in sorted((run_dir / "wandb").glob("*/wandb/offline-run-*/run-*.wandb")):
        run_id = path.stem.removeprefix("run-")
        for raw in transaction_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                history.setdefault(run_id, []).append(row)
    return history
