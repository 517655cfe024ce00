"""Running the checklist: `run_checklist(recipe, run_dir, steps)` runs the steps in order and returns the report; it
never raises for a failing step.

Each step runs in a worker thread, so a fixed time limit holds even for in-process work (a step past it fails as
timed out). On a CPU-only machine with two or more cores, neighbouring steps marked `concurrent` run at the same time
(`Context.concurrent_ok`); the report keeps the steps' order. The heavy steps' logs go to the given log directory
(`<run>/logs/checklist` for `primerl check` and `primerl run`) and are kept; without one, to a scratch directory that
is removed when nothing failed and kept, named on the console, when something did.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from primerl.checklist.context import STALL_TIMEOUT_S, Context, Fail, Skip, Status, Step
from primerl.checklist.report import ChecklistReport, StepResult
from primerl.launch.console import stop_quietly
from primerl.recipes.schema import Recipe

CHECKLIST_LOGS = Path("logs") / "checklist"  # the heavy steps' logs, inside the run directory
STOP_WAIT_S = 30.0  # after Ctrl-C, how long a running step may take to stop its children


def _stopping(ctx: Context) -> None:
    """The first Ctrl-C or SIGTERM during the checklist: one line; the steps stop their children; a further signal
    prints one line and is otherwise ignored."""
    if not ctx.stopping.is_set():
        ctx.stopping.set()
        ctx.say("checklist: interrupted; stopping its steps (nothing was trained)")
        stop_quietly("checklist")


def run_checklist(recipe: Recipe | None, run_dir: Path, steps: Sequence[Step], log_dir: Path | None = None,
                  out=sys.stdout, stall_timeout_s: float = STALL_TIMEOUT_S) -> ChecklistReport:
    """Run `steps` in order; never raises for a failing step. The heavy steps' logs go to `log_dir` and are kept;
    without one, to a temporary directory that is removed when every step passed or was skipped and kept, named, when
    one failed. Their outputs go to a scratch directory removed at the end."""
    if not any(step.writes_logs for step in steps):  # only light steps: no log directory is made
        report = _run_steps(recipe, run_dir, steps, Path(tempfile.gettempdir()), out, stall_timeout_s)
        report.log_dir = None
        return report
    scratch = log_dir is None or not _made(log_dir)  # unwritable: the run_dir step says why; the logs go to scratch
    if scratch:
        log_dir = Path(tempfile.mkdtemp(prefix="primerl-checklist-logs-"))
    report = _run_steps(recipe, run_dir, steps, log_dir, out, stall_timeout_s)
    if scratch and report.failed:
        print(f"checklist logs: {log_dir}", file=out, flush=True)
    elif scratch:
        shutil.rmtree(log_dir, ignore_errors=True)
        report.log_dir = None
    return report


def _made(folder: Path) -> bool:
    """Whether `folder` exists or could be created."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return True


def _run_steps(recipe: Recipe | None, run_dir: Path, steps: Sequence[Step], log_dir: Path, out,
               stall_timeout_s: float) -> ChecklistReport:
    def say(message: str) -> None:
        print(f"        {message}", file=out, flush=True)

    results = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="primerl-checklist-") as work_dir:
        ctx = Context(recipe=recipe, run_dir=run_dir, log_dir=log_dir, work_dir=Path(work_dir), say=say,
                      stall_timeout_s=stall_timeout_s)
        try:
            _run_groups(steps, ctx, out, results)
        except BaseException:  # Ctrl-C or SIGTERM between steps too: one line, then the error goes on
            _stopping(ctx)
            raise
    return ChecklistReport(str(recipe.path) if recipe else None, str(run_dir), results, str(log_dir),
                           round(time.monotonic() - started, 1))


def _run_groups(steps: Sequence[Step], ctx: Context, out, results: list[StepResult]) -> None:
    for group in _groups(steps, ctx):
        first = len(results) + 1
        if len(group) == 1:
            print(f"[{first}/{len(steps)}] {group[0].name}: {group[0].summary} ...", file=out, flush=True)
            result = _run_step(group[0], ctx)
            print(f"        {result.status}: {result.detail} ({result.seconds:.1f} s)", file=out, flush=True)
            results.append(result)
            continue
        for i, step in enumerate(group, first):
            print(f"[{i}/{len(steps)}] {step.name}: {step.summary} ... (together with "
                  f"{', '.join(other.name for other in group if other is not step)})", file=out, flush=True)
        pool = ThreadPoolExecutor(len(group), thread_name_prefix="checklist")
        try:
            running = {pool.submit(_run_step, step, ctx): step for step in group}
            done: dict[str, StepResult] = {}
            for future in as_completed(running):
                result = future.result()
                print(f"        {result.name} {result.status}: {result.detail} ({result.seconds:.1f} s)",
                      file=out, flush=True)
                done[result.name] = result
        except BaseException:  # Ctrl-C, SIGTERM: the running steps stop their children, then the error goes on
            _stopping(ctx)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown(wait=True)
        results.extend(done[step.name] for step in group)


def _groups(steps: Sequence[Step], ctx: Context) -> Iterator[list[Step]]:
    """`steps` in order, neighbouring concurrent steps together where the machine allows it, each other step alone."""
    together = None  # decided at the first concurrent step, after the torch step has probed the machine
    group: list[Step] = []
    for step in steps:
        if step.concurrent and (together if together is not None else (together := ctx.concurrent_ok())):
            group.append(step)
            continue
        if group:
            yield group
            group = []
        yield [step]
    if group:
        yield group


def _run_step(step: Step, ctx: Context) -> StepResult:
    """Run one step in a worker thread so a fixed timeout holds even for in-process work (steps without one watch
    their child's progress themselves)."""
    outcome: list[tuple[Status, str]] = []

    def work() -> None:
        try:
            outcome.append(("passed", step.run(ctx)))
        except Skip as e:
            outcome.append(("skipped", str(e)))
        except Fail as e:
            outcome.append(("failed", str(e)))
        except Exception as e:  # noqa: BLE001 -- a step that crashes is a failed step, reported with its error
            outcome.append(("failed", f"{type(e).__name__}: {e}"))

    started = time.monotonic()
    worker = threading.Thread(target=work, name=f"check-{step.name}", daemon=True)
    try:
        worker.start()
        worker.join(step.timeout_s)
    except BaseException:  # Ctrl-C, SIGTERM: the step stops its children (a little while at most), then it goes on
        if threading.current_thread() is threading.main_thread():
            _stopping(ctx)
            if worker.is_alive():
                worker.join(STOP_WAIT_S)
        raise
    seconds = round(time.monotonic() - started, 1)
    if not outcome:
        return StepResult(step.name, "failed", f"timed out after {step.timeout_s:.0f} s", seconds)
    status, detail = outcome[0]
    return StepResult(step.name, status, detail, seconds)

