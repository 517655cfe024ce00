"""Whether `rl` restarts a run after one of its processes died or hung (`RestartPolicy`), and the line it prints.

A restart stops every process and resumes the whole run from its last complete checkpoint, as `--resume` does. The
policy allows `max_restarts` restarts over the launcher's life, and stops sooner on a crash loop: the same process
failing the same way `CRASH_LOOP_FAILURES` times with no new trained step in between, which a restart will not fix.
It knows nothing about processes: the launcher tells it what failed (`Failure`) and acts on its `Decision`; a hang is
seen by `Progress`, the run's heartbeat (its metrics.jsonl growing).

The loop every launcher shares is here too: `watch` follows one attempt's processes until the run is done or one of
them failed or the run hung, `run_with_restarts` repeats attempts while the policy allows. So is the bookkeeping
around a restart: `record_restart` says why and records it (in metrics.jsonl, and in the run's manifest when it has
one: `count_restarts_in_manifest`), `forget_what_is_redone` clears what a resumed run trains again before any process
starts. A launcher that cannot reach the run directory itself (`launch ssh`) runs that bookkeeping on a host that can:

    python -m primerl.launch.restart steps --run-dir RUN       # prints the newest trained step
    python -m primerl.launch.restart record --run-dir RUN --restart 1 --max-restarts 3 --process P --cause C \
        --step S [--host H] < last-lines-of-the-failed-process   # record_restart, then forget_what_is_redone

A Slurm job that Slurm requeued records its restart the same way before it resumes the run (`record_requeue`):

    python -m primerl.launch.restart requeued --run-dir RUN --job ID --count SLURM_RESTART_COUNT [--host NODE]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from primerl.monitor import MetricsLogger, drop_records_after, read_metrics
from primerl.recipes.manifest import MANIFEST_FILE, now, read_manifest, write_manifest
from primerl.transport import checkpoints, snapshots

RESTART_SOURCE = "launcher"  # the `source` of the restart records in metrics.jsonl ({"event": "restart", ...})
CRASH_LOOP_FAILURES = 3  # the same failure this many times in a row, with no new trained step: a crash loop
RESTARTS_LOG = "restarts.log"  # in <run>/logs: each restart's line and the failed process's last log lines
STALLED = "the run"  # the `Failure.process` of a run that stopped making progress (which process hung is unknown)
# what the manifest keeps of each restart record (`restart_fields`)
RESTART_ENTRY_KEYS = ("restart", "process", "host", "cause", "failed_at_step", "resumed_from_step")


def restarts_of_run(run_dir: Path) -> list[dict]:
    """The restart records of the run in `run_dir`, oldest first (what the manifest's `stages.rl.restarts` counts)."""
    return [r for r in read_metrics(run_dir, RESTART_SOURCE) if r.get("event") == "restart"]


def restart_fields(run_dir: Path) -> dict[str, Any]:
    """What a manifest's rl stage says of the run's restarts: `restarts` (their number), `restart_causes` (one line
    each) and `restart_entries` (one object each: restart, process, host, cause, failed_at_step, resumed_from_step;
    `host` is None for a hung run of several hosts, where which process hung is unknown)."""
    restarts = restarts_of_run(run_dir)
    return {
        "restarts": len(restarts),
        "restart_causes": [f"{r['process']} {r['cause']} at step {r['failed_at_step']}" for r in restarts],
        "restart_entries": [{key: r.get(key) for key in RESTART_ENTRY_KEYS} for r in restarts],
    }


def count_restarts_in_manifest(run_dir: Path, prefix: str = "rl") -> bool:
    """Write `restart_fields` into the rl stage of `<run_dir>/manifest.json`, when the run has one (a recipe's run,
    through `rl`, `primerl run` or `launch ssh`). False when there is none, or it cannot be read (said in one line on
    stderr, `prefix: ...`: the restart itself goes on)."""
    if not (run_dir / MANIFEST_FILE).is_file():
        return False
    try:
        manifest = read_manifest(run_dir)
        stage = manifest["stages"]["rl"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"{prefix}: the restart is not counted in {run_dir / MANIFEST_FILE}: it cannot be read "
              f"({type(e).__name__}: {e})", file=sys.stderr, flush=True)
        return False
    stage.update(restart_fields(run_dir))
    manifest["updated_at"] = now()
    write_manifest(run_dir, manifest)
    return True


@dataclass(frozen=True)
class Failure:
    """What ended an attempt: `process` (inference, orchestrator, trainer, teacher, or `STALLED`), `cause` ("exited
    with code 1", "was killed by signal 9", "made no progress for 600s") and the last trained step when it happened."""

    process: str
    cause: str
    step: int

    @classmethod
    def exited(cls, process: str, code: int, step: int) -> Failure:
        return cls(process, f"exited with code {code}" if code >= 0 else f"was killed by signal {-code}", step)

    @classmethod
    def stalled(cls, seconds: float, step: int) -> Failure:
        return cls(STALLED, f"made no progress (no new metrics record) for {seconds:.0f}s", step)

    def describe(self) -> str:
        return f"{self.process} {self.cause} at step {self.step}"


@dataclass(frozen=True)
class Decision:
    restart: bool
    reason: str  # why the run stops (empty on a restart)


class RestartPolicy:
    """Counts restarts and failures in a row; `decide` says, for each failure, whether the run restarts."""

    def __init__(self, max_restarts: int, crash_loop_failures: int = CRASH_LOOP_FAILURES):
        if max_restarts < 0 or crash_loop_failures < 2:
            raise ValueError("max_restarts must be >= 0 and crash_loop_failures >= 2")
        self.max_restarts = max_restarts
        self.crash_loop_failures = crash_loop_failures
        self.restarts = 0
        self.repeats = 0  # failures in a row equal to `last`, with no new trained step in between
        self.last: Failure | None = None

    def decide(self, failure: Failure) -> Decision:
        """Whether to restart after `failure`; counts the restart when it says yes."""
        same = (self.last is not None and (failure.process, failure.cause) == (self.last.process, self.last.cause)
                and failure.step <= self.last.step)
        self.repeats = self.repeats + 1 if same else 1
        self.last = failure
        if self.max_restarts == 0:
            return Decision(False, f"{failure.describe()}; auto-restart is off (max_restarts = 0)")
        if self.repeats >= self.crash_loop_failures:
            return Decision(False, f"crash loop: {failure.process} {failure.cause} {self.repeats} times in a row "
                            f"without a new trained step (at step {failure.step}); a restart will not fix it")
        if self.restarts >= self.max_restarts:
            return Decision(False, f"{failure.describe()}; all {self.max_restarts} restart(s) used")
        self.restarts += 1
        return Decision(True, "")

    def message(self, failure: Failure, resume_step: int) -> str:
        """The one line a restart prints: `restart 1/3: trainer was killed by signal 9 at step 7; resuming from step
        6`."""
        return f"restart {self.restarts}/{self.max_restarts}: {failure.describe()}; {resuming(resume_step)}"


def resuming(resume_step: int) -> str:
    return f"resuming from step {resume_step}" if resume_step else "starting again from the initial model"


class Progress:
    """How long the run has gone without a new metrics record (metrics.jsonl has not grown): its heartbeat. `metrics`
    is the file, or a function that returns its size (a launcher that reads it on a host)."""

    def __init__(self, metrics: Path | Callable[[], int]):
        self.metrics = metrics
        self.size = self._size()
        self.since = time.monotonic()

    def _size(self) -> int:
        if callable(self.metrics):
            return self.metrics()
        try:
            return self.metrics.stat().st_size
        except FileNotFoundError:
            return 0

    def idle_s(self) -> float:
        if (size := self._size()) != self.size:
            self.size, self.since = size, time.monotonic()
        return time.monotonic() - self.since


# ---------------------------------------------------------------------------------------------------------------------
# The supervision loop of every launcher


class Watched(Protocol):
    def poll(self) -> int | None: ...  # the exit code once the process has ended


P = TypeVar("P", bound=Watched)


def watch(processes: Sequence[P], *, name: Callable[[P], str], finishes: Callable[[P], bool],
          stop: Callable[[Sequence[P]], None], steps_done: Callable[[], int], progress: Progress,
          stall_timeout_s: float, tick: Callable[[], None] = lambda: None, poll_s: float = 0.25) -> Failure | None:
    """Follow one attempt of the run until it ends. None: every process that `finishes` by itself (orchestrator,
    trainer) exited 0, and the others (the servers) were stopped. A `Failure`: a process exited otherwise (named by
    `name`), or no new metrics record came for `stall_timeout_s` (0: never a stall); every process was stopped, and the
    failure carries `steps_done()` as read after the stop. `tick` runs on every poll (a console's lines)."""
    while True:
        tick()
        for p in processes:
            code = p.poll()
            if code is None or (code == 0 and finishes(p)):
                continue
            stop([q for q in processes if q is not p])
            tick()
            return Failure.exited(name(p), code, steps_done())
        if all(p.poll() == 0 for p in processes if finishes(p)):
            tick()
            stop([p for p in processes if not finishes(p)])
            return None
        if stall_timeout_s and progress.idle_s() > stall_timeout_s:
            stop(processes)
            tick()
            return Failure.stalled(stall_timeout_s, steps_done())
        time.sleep(poll_s)


def run_with_restarts(policy: RestartPolicy, attempt: Callable[[], int | Failure],
                      give_up: Callable[[Failure, str], int], restart: Callable[[Failure], None]) -> int:
    """Run `attempt` (the processes started, watched and stopped) until it returns an exit code; after each `Failure`
    the policy decides: `restart(failure)` records it and prepares the resumed attempt, or `give_up(failure, reason)`
    says why the run stops and returns the exit code."""
    while True:
        outcome = attempt()
        if isinstance(outcome, int):
            return outcome
        decision = policy.decide(outcome)
        if not decision.restart:
            return give_up(outcome, decision.reason)
        restart(outcome)


# ---------------------------------------------------------------------------------------------------------------------
# Bookkeeping of restarts and resumes


def record_restart(run_dir: Path, policy: RestartPolicy, failure: Failure, last_lines: str | None, host: str | None,
                   prefix: str = "rl") -> None:
    """Say why the run restarts (one line on stderr, `prefix: restart ...`; `last_lines`, the failed process's last log
    lines, in the log of restarts), append a `restart` record to metrics.jsonl (source `launcher`) and count it in the
    run's manifest, when it has one. `host`: where the failed process ran (None: not known, a hung run of several
    hosts)."""
    resume_step = checkpoints.latest_trainer_step(run_dir)
    _record(run_dir, policy.message(failure, resume_step), last_lines, prefix, {
        "restart": policy.restarts, "max_restarts": policy.max_restarts, "process": failure.process, "host": host,
        "cause": failure.cause, "failed_at_step": failure.step, "resumed_from_step": resume_step,
    })


def record_requeue(run_dir: Path, job: str, count: int, host: str | None, prefix: str = "primerl") -> None:
    """A Slurm job that Slurm requeued (node failure, preemption, `scontrol requeue`) starts again and resumes the run:
    a restart no launcher decided, recorded as `record_restart` records one (the line, the log of restarts, a record
    in metrics.jsonl, the manifest). `count`: the job's SLURM_RESTART_COUNT; `host`: the node it starts again on."""
    resume_step = checkpoints.latest_trainer_step(run_dir)
    cause = f"was requeued by Slurm (SLURM_RESTART_COUNT {count})"
    failure = Failure(f"slurm job {job}", cause, trained_steps(run_dir))
    _record(run_dir, f"restart (requeue {count}): {failure.describe()}; {resuming(resume_step)}", None, prefix, {
        "restart": count, "max_restarts": None, "process": failure.process, "host": host, "cause": failure.cause,
        "failed_at_step": failure.step, "resumed_from_step": resume_step,
    })


def _record(run_dir: Path, line: str, last_lines: str | None, prefix: str, fields: dict[str, Any]) -> None:
    print(f"{prefix}: {line}", file=sys.stderr, flush=True)
    log = run_dir / "logs" / RESTARTS_LOG
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
        if last_lines is not None:
            f.write(f"{last_lines}\n\n")
    MetricsLogger(run_dir, RESTART_SOURCE).log(fields["resumed_from_step"], {"event": "restart", **fields})
    count_restarts_in_manifest(run_dir, prefix)


def forget_what_is_redone(run_dir: Path, stream, prefix: str = "rl") -> None:
    """Before a resumed run starts: weight snapshots newer than the trainer checkpoint it resumes from go (those steps
    are trained again; a server that loaded the old version k would never load the new one), and so do staging
    leftovers of a killed export and the trainer's metrics records of those steps (written again, once). Done here,
    before any process starts, so no server can load the snapshots and no process writes metrics meanwhile."""
    step = checkpoints.latest_trainer_step(run_dir)
    leftovers = snapshots.remove_staging_leftovers(run_dir)
    removed = snapshots.remove_after(run_dir, step)
    records = drop_records_after(run_dir, "trainer", step)
    where = run_dir / checkpoints.CHECKPOINTS_DIR / f"step_{step}"
    print(f"{prefix}: resuming the trainer from {where} (step {step})" if step else f"{prefix}: no trainer checkpoint; "
          "the trainer starts from the initial model", file=stream, flush=True)
    if removed or leftovers or records:
        print(f"{prefix}: steps after {step} are trained again: removed weight snapshots {removed}, {len(leftovers)} "
              f"staging leftover(s), {records} trainer record(s) of metrics.jsonl", file=stream, flush=True)


def trained_steps(run_dir: Path) -> int:
    """The newest step the trainer recorded in metrics.jsonl (0: none)."""
    return max((int(r["step"]) for r in read_metrics(run_dir, "trainer")), default=0)


def main(argv: list[str] | None = None) -> int:
    """The bookkeeping of a restart, run on a host that sees the run directory (see the module's docstring)."""
    parser = argparse.ArgumentParser(prog="python -m primerl.launch.restart", description=main.__doc__)
    parser.add_argument("what", choices=("steps", "record", "requeued"))
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--restart", type=int, default=1, help="record: this restart's number, from 1")
    parser.add_argument("--max-restarts", type=int, default=1)
    parser.add_argument("--process", default=STALLED, help="record: the failed process")
    parser.add_argument("--cause", default="", help="record: how it failed")
    parser.add_argument("--step", type=int, default=0, help="record: the last trained step when it failed")
    parser.add_argument("--host", help="record: the host of the failed process (none: not known); requeued: the node")
    parser.add_argument("--job", help="requeued: the Slurm job's id")
    parser.add_argument("--count", type=int, help="requeued: the job's SLURM_RESTART_COUNT")
    parser.add_argument("--prefix", default="launch", help="record: the word before each line printed")
    ns = parser.parse_args(argv)
    if ns.what == "steps":
        print(trained_steps(ns.run_dir))
        return 0
    if ns.what == "requeued":
        if ns.job is None or ns.count is None or ns.count < 1:
            parser.error("requeued needs --job and --count (SLURM_RESTART_COUNT, from 1)")
        record_requeue(ns.run_dir, ns.job, ns.count, ns.host, ns.prefix)
        return 0
    if not 1 <= ns.restart <= ns.max_restarts:
        parser.error(f"--restart {ns.restart}: must be within 1..--max-restarts ({ns.max_restarts})")
    policy = RestartPolicy(ns.max_restarts)
    policy.restarts = ns.restart
    last_lines = sys.stdin.read().rstrip("\n") or None
    record_restart(ns.run_dir, policy, Failure(ns.process, ns.cause, ns.step), last_lines, ns.host, ns.prefix)
    forget_what_is_redone(ns.run_dir, sys.stderr, ns.prefix)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
