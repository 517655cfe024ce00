"""Metrics: one JSON object per line in `<run>/metrics.jsonl`, a console line per step, optional W&B, PNG plots.

Every process appends its own records ({"step", "source", "time", ...metrics}) to the run's metrics.jsonl. Each record
is one `write` of one line on a file opened with O_APPEND, so records from concurrent processes never interleave.
`primerl plot RUN_DIR` turns the file into PNGs under `<run>/plots/`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.storage import atomic_write

if TYPE_CHECKING:
    from primerl.config.common import WandbConfig

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    """Appends step records to `<run_dir>/metrics.jsonl` and, when `wandb.project` is set, to the run directory's
    Weights & Biases run (`primerl.wandb_run`), with `config` as the W&B config when the run has no manifest."""

    def __init__(self, run_dir: str | os.PathLike, source: str, wandb: WandbConfig | None = None,
                 config: Mapping[str, Any] = {}, enabled: bool = True):
        self.path = Path(run_dir) / METRICS_FILE
        self.source = source
        self.enabled = enabled
        self._wandb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if wandb is not None and wandb.project and wandb.mode != "disabled":
                from primerl import wandb_run

                self._wandb = wandb_run.start(wandb, self.path.parent, source, config)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        record = {"step": int(step), "source": self.source, "time": round(time.time(), 3)}
        record.update({k: _jsonable(v) for k, v in metrics.items()})
        if self.enabled:
            line = (json.dumps(record, allow_nan=False, default=str) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
            if self._wandb is not None:
                self._wandb.log({f"{self.source}/{k}": v for k, v in record.items()
                                 if isinstance(v, int | float) and not isinstance(v, bool) and k != "time"})
        return record

    def close(self) -> None:
        """Finish the W&B run of this process (a no-op without W&B); metrics.jsonl needs no closing."""
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(run_dir: str | os.PathLike, source: str | None = None) -> list[dict[str, Any]]:
    """All records of a run (optionally of one source), skipping a torn last line of a run that is still writing."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if source is None or record.get("source") == source:
            out.append(record)
    return out


def drop_records_after(run_dir: str | os.PathLike, source: str, step: int) -> int:
    """Remove the records of `source` with a step above `step` (a resumed process writes them again) and any torn
    line; return how many went. Rewrites the file atomically: call it only while nothing writes to it."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if record.get("source") == source and int(record.get("step", 0)) > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        atomic_write(path, "".join(line + "\n" for line in kept))
    return dropped


def format_line(step: int, metrics: Mapping[str, Any], keys: Iterable[str], prefix: str = "") -> str:
    """`step 3 | loss 0.1234 | lr 1.0e-05 | ...` with compact number formatting, missing keys left out."""
    parts = [f"{prefix}step {step}"]
    for key in keys:
        value = metrics.get(key)
        if value is None:
            continue
        parts.append(f"{key} {_fmt(value)}")
    return " | ".join(parts)


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.2e}"
    return f"{value:.4g}"


# ---------------------------------------------------------------------------------------------------------------------
# Plots

# (file name, title, y-axis label, [(source, metric key), ...]) — a plot is written when any of its series has data.
# Every series is a per-step value: the orchestrator's `tokens_per_s` (a cumulative average since generation
# started) is not drawn beside the trainer's per-step figure; its `step_tokens_per_s` is.
PLOTS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("reward.png", "mean reward", "reward (mean over the step's rollouts)", [("orchestrator", "reward_mean")]),
    ("loss.png", "trainer loss", "loss", [("trainer", "loss"), ("sft", "loss")]),
    ("throughput.png", "throughput per step", "tokens/s (per step)",
     [("trainer", "tokens_per_s"), ("sft", "tokens_per_s"), ("orchestrator", "step_tokens_per_s")]),
]


def plot_data(records: list[dict[str, Any]]) -> dict[str, tuple[str, str, list[tuple[str, list[tuple[int, float]]]]]]:
    """What each plot draws: file name -> (title, y-axis label, [(series label, [(step, value), ...]), ...]), for the
    plots that have data."""
    out = {}
    for filename, title, ylabel, series in PLOTS:
        lines = []
        for source, key in series:
            points = sorted((r["step"], r[key]) for r in records if r.get("source") == source and
                            isinstance(r.get(key), int | float))
            if points:
                lines.append((f"{source}/{key}", points))
        if lines:
            out[filename] = (title, ylabel, lines)
    return out


def plot_run(run_dir: str | os.PathLike) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(run_dir) / "plots"
    written = []
    for filename, (title, ylabel, lines) in plot_data(read_metrics(run_dir)).items():
        out_dir.mkdir(parents=True, exist_ok=True)
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        for label, points in lines:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} — {Path(run_dir).name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def runs_to_plot(path: Path) -> list[Path]:
    """The directories with a metrics.jsonl that `primerl plot PATH` draws: PATH when it has one, with any of its
    subdirectories that have their own (a recipe's `sft/` stage); else its subdirectories that have one (a run
    directory split by stage, e.g. `runs/reverse-text/{sft,rl}`); else the run directory just above it (a stage or
    role name inside a run, e.g. `runs/reverse-text/rl` or `.../logs`). Empty when none of these has one."""

    def has_metrics(d: Path) -> bool:
        return (d / METRICS_FILE).is_file()

    here = [path] if has_metrics(path) else []
    children = sorted(d for d in path.iterdir() if d.is_dir() and has_metrics(d)) if path.is_dir() else []
    if here or children:
        return here + children
    return [path.parent] if has_metrics(path.parent) else []


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="primerl plot",
        description=f"Write PNG plots of a run's {METRICS_FILE} into <run>/plots/ and print their paths.",
    )
    parser.add_argument("run_dir", type=Path, help="the run directory (e.g. runs/reverse-text), or a directory in it")
    args = parser.parse_args(argv)
    runs = runs_to_plot(args.run_dir)
    if not runs:
        print(f"primerl plot: error: no {METRICS_FILE} in {args.run_dir}, its subdirectories or the directory above "
              "it; give the run directory (the one with metrics.jsonl, e.g. runs/reverse-text)", file=sys.stderr)
        return 2
    written = [path for run in runs for path in plot_run(run)]
    if not written:
        print(f"primerl plot: error: {' and '.join(str(r / METRICS_FILE) for r in runs)} has no plottable metrics",
              file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
