"""Rollouts in worker processes: with `orchestrator.workers = N`, groups run in N child processes, each a
`groups.GroupRunner` with its own event loop, interception server, renderers and token-version ledger, so verifiers'
per-rollout machinery (episodes, the interception hop, rendering, scoring) uses N cores, and the orchestrator's loop
keeps only what must stay in one place: the task order, the async bound, scoring groups, batches, checkpoints.

Parent side, `WorkerPool`, used like a `GroupRunner`:
- `async with WorkerPool(setup, count, label):` loads the environment here (the loop draws its tasks from it, and a
  bad `env.args` fails here, before any worker starts), starts the workers, and on leaving stops them (their socket
  closes and they exit; one still running after `STOP_GRACE_S` is killed) and reaps them.
- `await pool.run(draw, task, url)` sends the group to the worker with the fewest groups in flight and returns its
  samples: what `GroupRunner.run` returns in-process (the same seeds, the same server, per-token policy versions from
  the worker's own ledger). An exception the group raised in the worker is raised here.
- A worker that dies (killed, crashed, or failed to start) fails every group in flight, every later `run` and the
  future `failed` with `WorkerFailed`, naming the worker, its pid and how it ended: the loop, which waits on `failed`
  beside its groups, stops with that error at once, busy or idle, and never waits on a dead worker.
- `cpu_s`: the CPU seconds the workers reported so far (each answer carries its worker's `time.process_time()`).

Worker side (`python -m primerl.orchestrator.rollout_worker --fd N --index I --of RUN`, which runs `main`): reads
the `RolloutSetup`, then group requests, from a socket it shares with the parent alone, and answers each group as it
finishes (many run at once). It ignores SIGINT — the parent stops it, so a Ctrl-C reaching the whole process group
cannot end a worker before the loop has stopped — and exits when the socket closes, so it never outlives its
orchestrator, even one killed by SIGKILL. `--of` names the run directory, so `ps` tells whose worker it is.

Messages are pickled tuples behind a 4-byte length.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Self

from primerl.orchestrator import verifiers_bridge
from primerl.orchestrator.groups import GroupRunner, RolloutSetup, quiet_libraries

log = logging.getLogger("primerl.orchestrator")

STOP_GRACE_S = 10.0
"""How long a stopping worker may take to cancel its groups and close its interception server before it is killed."""
AUTO_MIN_CORES = 8
"""`workers = "auto"` starts workers only on a machine with at least this many cores (see `worker_count`)."""
AUTO_MAX_WORKERS = 8
_LENGTH = struct.Struct("!I")


class WorkerFailed(RuntimeError):
    """A worker process died, or could not start: the run cannot go on with its groups lost."""


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def worker_count(setting: int | str, cores: int | None = None) -> int:
    """The number of worker processes for the `orchestrator.workers` setting. `auto`: none below `AUTO_MIN_CORES`
    cores (the inference server and the trainer need the few there are, and one loop keeps up with a CPU engine),
    else half the cores, at most `AUTO_MAX_WORKERS`."""
    if setting != "auto":
        return int(setting)
    cores = usable_cores() if cores is None else cores
    return 0 if cores < AUTO_MIN_CORES else min(AUTO_MAX_WORKERS, cores // 2)


def open_groups(setup: RolloutSetup, workers: int, label: str) -> GroupRunner | WorkerPool:
    """Where the orchestrator's groups run: in its own process (`workers` 0) or in `workers` worker processes."""
    return GroupRunner(setup) if workers == 0 else WorkerPool(setup, workers, label)


# ---------------------------------------------------------------------------------------------------------------------
# Messages


def encode(message: Any) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(body)) + body


async def receive(reader: asyncio.StreamReader) -> Any:
    """The next message; `asyncio.IncompleteReadError` once the other side has closed the socket."""
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))


def picklable(error: BaseException) -> BaseException:
    """`error` if it survives the trip through pickle, else a `RuntimeError` with its type and text."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 -- whatever pickle raises, the error cannot travel as it is
        return RuntimeError(f"{type(error).__name__}: {error}")


def how_it_ended(returncode: int | None) -> str:
    if returncode is None:
        return "closed its connection"
    if returncode < 0:
        return f"was killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    return f"exited with code {returncode}"


# ---------------------------------------------------------------------------------------------------------------------
# Parent side


@dataclass(eq=False)
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    cpu_s: float = 0.0
    receiving: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"orchestrator worker {self.index} (pid {self.process.pid})"


class WorkerPool:
    """Groups in worker processes; see the module docstring."""

    def __init__(self, setup: RolloutSetup, count: int, label: str):
        if count < 1:
            raise ValueError(f"a worker pool needs at least one worker, not {count}")
        self.setup = setup
        self.count = count
        self.label = label
        self.env: Any = None
        self.workers: list[_Worker] = []
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.failed.add_done_callback(lambda f: f.cancelled() or f.exception())  # the loop may be gone: no warning
        self._requests = itertools.count()
        self._stopping = False

    @property
    def cpu_s(self) -> float:
        return sum(worker.cpu_s for worker in self.workers)

    async def __aenter__(self) -> Self:
        self.env = verifiers_bridge.env_from_config(self.setup.env)
        try:
            for index in range(self.count):
                self.workers.append(await self._start(index))
        except BaseException:
            await self._stop()
            raise
        log.info("rollouts run in %d worker processes (pids %s)", self.count,
                 ", ".join(str(worker.process.pid) for worker in self.workers))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stop()

    async def _start(self, index: int) -> _Worker:
        ours, theirs = socket.socketpair()
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "primerl.orchestrator.rollout_worker", "--fd", str(theirs.fileno()),
                "--index", str(index), "--of", self.label, pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        reader, writer = await asyncio.open_connection(sock=ours)
        worker = _Worker(index, process, writer)
        writer.write(encode(self.setup))
        worker.receiving = asyncio.create_task(self._receive(worker, reader), name=f"orchestrator-worker-{index}")
        return worker

    async def run(self, draw: int, task: Any, url: str) -> list[verifiers_bridge.RolloutSample]:
        if self.failed.done():
            self.failed.result()
        request_id = next(self._requests)
        try:
            request = encode(("run", request_id, draw, task, url))
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            raise WorkerFailed(
                f"task {verifiers_bridge.task_id(task)} of environment {self.setup.env.id!r} cannot be sent to a worker "
                f"process ({type(error).__name__}: {error}); run with orchestrator.workers = 0"
            ) from error
        worker = min(self.workers, key=lambda w: len(w.pending))
        future = asyncio.get_running_loop().create_future()
        worker.pending[request_id] = future
        try:
            worker.writer.write(request)
            return await future
        finally:
            worker.pending.pop(request_id, None)

    async def _receive(self, worker: _Worker, reader: asyncio.StreamReader) -> None:
        """Hand each answer of `worker` to the group waiting for it; when the worker is gone, fail the pool."""
        unreadable = None
        try:
            while True:
                kind, *body = await receive(reader)
                if kind == "failed to start":
                    (error,) = body
                    self._fail(WorkerFailed(f"{worker.name} could not start: {verifiers_bridge.one_line(str(error))}"))
                    return
                worker.cpu_s = body[-1]
                if kind == "ready":
                    log.debug("%s ready", worker.name)
                    continue
                request, result, _ = body
                future = worker.pending.get(request)
                if future is None or future.done():
                    continue
                if kind == "done":
                    future.set_result(result)
                else:
                    future.set_exception(result)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as error:  # noqa: BLE001 -- a message that does not unpickle: the worker cannot be trusted
            unreadable = error
            with contextlib.suppress(ProcessLookupError):
                worker.process.kill()
        if self._stopping:
            return
        in_flight = len(worker.pending)
        if unreadable is not None:
            self._fail(WorkerFailed(f"{worker.name} sent an unreadable answer ({type(unreadable).__name__}: "
                                    f"{unreadable}) with {in_flight} group(s) in flight; it was stopped"))
            return
        try:
            returncode = await asyncio.wait_for(worker.process.wait(), STOP_GRACE_S)
        except TimeoutError:
            returncode = None
        self._fail(WorkerFailed(f"{worker.name} {how_it_ended(returncode)} with {in_flight} group(s) in flight"))

    def _fail(self, failure: WorkerFailed) -> None:
        """Every group in flight, every later `run` and `failed` fail with `failure` (the first one, if several)."""
        if self._stopping or self.failed.done():
            return
        log.error("%s", failure)
        self.failed.set_exception(failure)
        for worker in self.workers:
            for future in worker.pending.values():
                if not future.done():
                    future.set_exception(failure)

    async def _stop(self) -> None:
        """Close every worker's socket (it cancels its groups and exits), wait, kill what is left, reap."""
        self._stopping = True
        for worker in self.workers:
            worker.writer.close()
        for worker in self.workers:
            try:
                await asyncio.wait_for(worker.process.wait(), STOP_GRACE_S)
            except TimeoutError:
                log.warning("%s did not stop within %.0fs: killing it", worker.name, STOP_GRACE_S)
                with contextlib.suppress(ProcessLookupError):
                    worker.process.kill()
                await worker.process.wait()
        receiving = [worker.receiving for worker in self.workers if worker.receiving is not None]
        for task in receiving:
            task.cancel()
        await asyncio.gather(*receiving, return_exceptions=True)


# ---------------------------------------------------------------------------------------------------------------------
# Worker side


async def serve(sock: socket.socket) -> int:
    """Run groups for the parent at the other end of `sock` until it closes the socket."""
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        setup: RolloutSetup = await receive(reader)
    except asyncio.IncompleteReadError:
        return 0
    async with contextlib.AsyncExitStack() as stack:
        try:
            runner = await stack.enter_async_context(GroupRunner(setup))
        except Exception as error:
            log.exception("could not start")
            writer.write(encode(("failed to start", picklable(error))))
            await writer.drain()
            return 1
        writer.write(encode(("ready", time.process_time())))
        running: set[asyncio.Task] = set()
        try:
            while True:
                try:
                    _, request, draw, task, url = await receive(reader)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return 0
                answer = asyncio.create_task(_answer(runner, writer, request, draw, task, url))
                running.add(answer)
                answer.add_done_callback(running.discard)
        finally:
            for answer in running:
                answer.cancel()
            await asyncio.gather(*running, return_exceptions=True)


async def _answer(runner: GroupRunner, writer: asyncio.StreamWriter, request: int, draw: int, task: Any,
                  url: str) -> None:
    try:
        reply = ("done", request, await runner.run(draw, task, url), time.process_time())
    except Exception as error:
        log.exception("the group of the task drawn %d failed", draw)
        reply = ("error", request, picklable(error), time.process_time())
    writer.write(encode(reply))
    with contextlib.suppress(ConnectionError):
        await writer.drain()


def main(argv: list[str] | None = None) -> int:
    """A worker process (its entry point, `rollout_worker`, has set SIGINT to be ignored before importing this)."""
    parser = argparse.ArgumentParser(description="an orchestrator's rollout worker (started by the orchestrator)")
    parser.add_argument("--fd", type=int, required=True, help="the socket shared with the orchestrator")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--of", required=True, help="the run directory (names the worker's run in `ps`)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[worker {args.index}]: %(message)s")
    quiet_libraries()
    return asyncio.run(serve(socket.socket(fileno=args.fd)))

