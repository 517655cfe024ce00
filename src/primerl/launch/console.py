"""What the commands print while they run: `rl`'s console (`Console`: follows `<run>/metrics.jsonl` and prints one line
per trained step, the orchestrator's record of the batch next to the trainer's record of training on it, under a
progress bar on a terminal), and one line, never a traceback, for a Ctrl-C or SIGTERM while a command is already
stopping (`stop_quietly`).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path

from primerl.monitor import METRICS_FILE, format_line

ORCHESTRATOR_KEYS = ["reward_mean", "completion_len_mean", "truncated_frac", "policy_lag_max", "rollouts_per_s"]
TRAINER_KEYS = ["loss", "entropy", "mismatch_kl", "grad_norm", "tokens_per_s"]


class Console:
    """Follows metrics.jsonl and prints one line per trained step: the orchestrator's record of the batch next to
    the trainer's record of training on it, with a progress bar on a terminal."""

    def __init__(self, run_dir: Path, max_steps: int, first_step: int, stream=sys.stdout):
        self.path = run_dir / METRICS_FILE
        self.max_steps = max_steps
        self.stream = stream
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        self.orchestrator: dict[int, dict] = {}
        self.first_record_at: float | None = None
        self.first_step = self.steps_done = first_step
        self.started = self.last_wait_line = time.monotonic()
        self.bar = None
        if stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=max_steps, initial=first_step, unit="step", dynamic_ncols=True, file=sys.stderr)

    WAIT_LINE_EVERY_S = 10.0

    def poll(self) -> None:
        self._say_what_step_one_waits_for()
        for record in self._new_records():
            if self.first_record_at is None:
                self.first_record_at = time.time()
            if record.get("source") == "orchestrator":
                self.orchestrator[record["step"]] = record
            elif record.get("source") == "trainer":
                self._trained(record)

    def _say_what_step_one_waits_for(self) -> None:
        """Until the first step is trained, a line every `WAIT_LINE_EVERY_S` seconds saying what it waits for."""
        now = time.monotonic()
        if self.steps_done > self.first_step or now - self.last_wait_line < self.WAIT_LINE_EVERY_S:
            return
        self.last_wait_line = now
        doing = ("the trainer trains on the first batch" if self.orchestrator else
                 "the server loads the model and the orchestrator samples the first batch")
        self._print(f"rl: waiting for step {self.first_step + 1}: {doing} ({now - self.started:.0f} s)")

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, file=self.stream, flush=True)

    def _new_records(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next poll
        self.offset += len(complete)
        records = []
        for line in complete.decode(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def _trained(self, record: dict) -> None:
        step = int(record["step"])
        batch = self.orchestrator.pop(step, {})
        merged = {**{k: batch.get(k) for k in ORCHESTRATOR_KEYS}, **{k: record.get(k) for k in TRAINER_KEYS}}
        line = format_line(step, merged, ORCHESTRATOR_KEYS + TRAINER_KEYS).replace(
            f"step {step}", f"step {step}/{self.max_steps}", 1)
        if self.bar is not None:
            self.bar.write(line)
            self.bar.update(max(0, step - self.steps_done))
        else:
            print(line, file=self.stream, flush=True)
        self.steps_done = max(self.steps_done, step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def count(n: int, noun: str) -> str:
    """`count(1, "step")` -> "1 step", `count(40, "step")` -> "40 steps"."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


# ---------------------------------------------------------------------------------------------------------------------
# Signals and waits: what every command prints while it stops or waits


def stop_quietly(prog: str) -> None:
    """Once a command is stopping (after Ctrl-C or SIGTERM), a further Ctrl-C or SIGTERM prints one line and is
    otherwise ignored, so it neither cuts the stop short nor prints a traceback (SIGKILL ends it at once; the children
    die with their parent). Only in the main thread, where signal handlers live."""
    if threading.current_thread() is not threading.main_thread():
        return

    def already_stopping(signum, frame) -> None:
        print(f"{prog}: stopping already; SIGKILL ends it at once", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, already_stopping)
    signal.signal(signal.SIGTERM, already_stopping)
