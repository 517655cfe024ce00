"""Child processes of a launcher: each writes to its own log file, runs in its own process group, dies with its
parent, and is stopped politely first (SIGINT), then by force (SIGKILL to its whole group, and to what it started in
sessions of its own: torchrun's workers).

Own process groups mean a Ctrl-C in the terminal reaches only the launcher, which then stops the children in order;
on Linux each child also asks the kernel for SIGTERM when the launcher dies (even by SIGKILL), so no orphan keeps a
GPU or a port.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from primerl.cache import CACHE_VAR, follow_cache
from primerl.multicast import multicast_off

_PR_SET_PDEATHSIG = 1
# The program a launcher's children run: `python -m primerl.cli <command> ...`, or a fork that runs the same module's
# `main`. Named, not imported: the entry layer sits above the launchers, and a child is a program of its own.
ENTRY_MODULE = "primerl.cli"


class Terminated(BaseException):
    """The launcher got SIGTERM (see `raise_terminated`). A BaseException, as KeyboardInterrupt is: code that handles
    what can go wrong in its own work (`except Exception`, e.g. a failed preload that falls back to fresh interpreters)
    must not swallow the stop. It once did: a SIGTERM during the preload was taken for a failed import, and the run
    went on to its last step."""


def raise_terminated(signum, frame) -> None:
    """SIGTERM handler of a launcher's main thread: the first SIGTERM raises `Terminated`, which starts the orderly
    stop of every process; a SIGTERM during that stop is noted and ignored, so it cannot cut the stop short (a
    supervisor that wants it over sooner sends SIGKILL, which the children follow: they die with their parent)."""
    signal.signal(signal.SIGTERM, _already_stopping)
    raise Terminated()


def _already_stopping(signum, frame) -> None:
    print("stopping already; SIGKILL ends it at once", file=sys.stderr, flush=True)


def _child_setup() -> None:  # runs in the child between fork and exec
    # A launcher started in the background of a script (`rl ... &`) inherits SIGINT ignored, and so would its children:
    # they get the default back, since `stop_all` stops them with SIGINT first (they are in a session of their own, so
    # a terminal's Ctrl-C still reaches them only through the launcher).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


_watching_parent = False


def exit_with_parent(poll_s: float = 0.5) -> None:
    """SIGTERM this process when the process that started it dies (`uv run rl` killed by a CI cancel or `timeout -s
    KILL`): a launcher then stops its children instead of finishing the run with nobody watching. A thread polls the
    parent pid; unlike a parent-death signal it does not fire when merely the thread that spawned us exits."""
    global _watching_parent
    if _watching_parent:
        return
    _watching_parent = True
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        print(f"{os.path.basename(sys.argv[0])}: the process that started it ({parent}) is gone; stopping",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def primerl_command(*args: str) -> list[str]:
    """`primerl <args>` run by the interpreter of this process (works without the console scripts on PATH)."""
    return [sys.executable, "-m", ENTRY_MODULE, *args]


def torchrun_command(num_ranks: int, program: Sequence[str]) -> list[str]:
    """torchrun starting `num_ranks` processes of `program` (e.g. `["-m", "primerl.cli", "trainer", ...]`) on this host.

    `--standalone` puts the rendezvous store on a free port (runs side by side on one host never collide) and the
    ranks' process group bootstraps from that store; with no restarts, a rank that fails makes torchrun stop the
    other ranks and exit non-zero."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_ranks}",
            "--max-restarts=0", *program]


# PRIMERL_* variables that are not config keys: where models are cached and prepared, which image a run is in. Every
# child keeps them.
NON_CONFIG_VARS = ("PRIMERL_CACHE", "PRIMERL_MODEL_DIRS", "PRIMERL_IMAGE_ID")


def child_environment(extra: Mapping[str, str] | None = None, keep_primerl_vars: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment without PRIMERL_* config variables (children get complete config files instead, so
    the variables already took effect here) except `keep_primerl_vars` and `NON_CONFIG_VARS`, plus `extra`; NVLink
    multicast off unless this environment says otherwise (`primerl.multicast`); OpenMP threads that wait sleep rather
    than spin unless OMP_WAIT_POLICY says otherwise (on a CPU shared with other work, torch's spinning threads wait
    at every barrier for a thread the scheduler descheduled: a 2-thread matmul loop ran 3x slower than with 1 thread
    at load 10, and as fast as 1 thread once passive; benchmarks/NOTES.md)."""
    keep = {*keep_primerl_vars, *NON_CONFIG_VARS}
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIMERL_") or k in keep}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    multicast_off(env)
    if extra and extra.get(CACHE_VAR):
        follow_cache(env, extra[CACHE_VAR])
    env.update(extra or {})
    return env


def preload(modules: Iterable[str]) -> None:
    """Import `modules` into this process, so that children started with `ManagedProcess(fork=True)` begin with them
    loaded. OpenMP reads its settings once, when torch loads it: this process takes the children's wait policy first
    (`child_environment`'s passive default)."""
    import importlib

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for module in modules:
        importlib.import_module(module)


class ForkedChild:
    """The part of `subprocess.Popen` the launchers use (pid, poll, wait, returncode), for a forked child."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _primerl_args(argv: Sequence[str]) -> list[str]:
    """The arguments of a `primerl_command` (what follows `python -m primerl.cli`)."""
    head = primerl_command()
    if list(argv[: len(head)]) != head:
        raise ValueError(f"only a primerl command of this interpreter can be forked, not {' '.join(argv)!r}")
    return list(argv[len(head):])


def _fork_primerl(argv: Sequence[str], log_fd: int, env: Mapping[str, str] | None, cwd: Path | None) -> ForkedChild:
    """Start `primerl <args>` as a fork of this process: what `subprocess.Popen` of the same command line does (own
    session, stdin from /dev/null, output to the log, `env`, `cwd`, SIGTERM when this process dies), without a new
    interpreter importing everything again."""
    args = _primerl_args(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(ready_w)
        os.read(ready_r, 1)  # as Popen returns: the child has its own session (a stop can reach its group) or is gone
        os.close(ready_r)
        return ForkedChild(pid)
    code: int = 1
    try:
        os.close(ready_r)
        code = _forked_main(args, log_fd, env, cwd, ready_w)
    except BaseException:  # noqa: BLE001 -- whatever happens, the child must not return into the launcher's code
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


_PR_SET_NAME = 15


def _set_process_title(args: Sequence[str], libc) -> None:
    """Show this forked child as `primerl <args>` in `ps` and /proc/<pid>/cmdline (it inherited the launcher's command
    line): the kernel reads the command line from the memory of the original arguments, which the interpreter copied at
    start-up and no longer uses, so the title is written there, cut to its size; `comm` (`ps -o comm`, top) becomes
    `pl-<command>`."""
    if not args:
        return
    libc.prctl(_PR_SET_NAME, f"pl-{args[0]}"[:15].encode(), 0, 0, 0)
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end: fields 48 and 49 of stat(5)
    except (OSError, IndexError, ValueError):
        return
    size = end - start
    if size <= 1:
        return
    title = "\0".join(["primerl", *args]).encode()[: size - 1]
    ctypes.memmove(start, title + b"\0" * (size - len(title)), size)


def _forked_main(args: list[str], log_fd: int, env: Mapping[str, str] | None, cwd: Path | None, ready: int) -> int:
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own, as in a new interpreter
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the launcher's `raise_terminated`
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        _set_process_title(args, libc)
    os.write(ready, b"1")
    os.close(ready)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    # New stream objects: another thread of the launcher may have held the old ones' locks at the fork.
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:
        os.chdir(cwd)
    import atexit
    import importlib

    cli = importlib.import_module(ENTRY_MODULE)
    sys.argv = [cli.__file__, *args]
    try:
        result = cli.main(args)
    except SystemExit as stop:
        result = stop.code
    except KeyboardInterrupt:
        result = 128 + signal.SIGINT
    atexit._run_exitfuncs()  # what the interpreter runs on its way out (logging's flush, the children's own hooks)
    if result is None or isinstance(result, int):
        code = result or 0
    else:  # sys.exit("message"): printed, exit status 1
        print(result, file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return code


@dataclass
class ManagedProcess:
    """One named child process with its log file. With `fork`, a `primerl_command` starts as a fork of this process
    (see `preload`) instead of a new interpreter: the same process for everything that watches it, minus the imports."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    fork: bool = False
    popen: subprocess.Popen | ForkedChild | None = field(default=None, repr=False)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.argv)}{'  (forked, preloaded)' if self.fork else ''}\n".encode())
            log.flush()
            if self.fork:
                self.popen = _fork_primerl(self.argv, log.fileno(), self.env, self.cwd)
                return
            self.popen = subprocess.Popen(
                list(self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(self.env) if self.env is not None else None,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=_child_setup,  # noqa: PLW1509 - launchers start children from one thread
            )

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was not started"
        return self.popen.pid

    def poll(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the child's process group (the child and anything it started, e.g. torchrun's workers)."""
        if self.popen is None or self.popen.poll() is not None:
            return
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def tail(self, max_lines: int = 40) -> str:
        """The last `max_lines` lines of the log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        return "\n".join(lines[-max_lines:])


def stop_all(processes: Sequence[ManagedProcess], grace_s: float, first_signal: int = signal.SIGINT) -> None:
    """Send `first_signal` to every running process, wait up to `grace_s` seconds for all of them, then SIGKILL the
    groups of those still running, and reap them; then SIGKILL whatever they had started that outlived them in a
    session of its own (torchrun's workers: a hung or stopped worker outlives an agent killed before its own stop of
    them ended). A process never started is passed by."""
    running = [p for p in processes if p.popen is not None and p.poll() is None]
    below = {proc for p in running for proc in descendants(p.popen.pid)}  # type: ignore[union-attr]
    for p in running:
        p.signal_group(first_signal)
    deadline = time.monotonic() + grace_s
    while any(p.poll() is None for p in running) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in running:
        if p.poll() is None:
            below |= descendants(p.popen.pid)  # type: ignore[union-attr]
            p.signal_group(signal.SIGKILL)
    for p in running:
        if p.popen is not None:
            p.popen.wait()
    for pid, started in below:
        if _start_time(pid) == started:  # still the same process (a pid is reused only after its process ended)
            try:
                os.kill(pid, signal.SIGKILL)  # stopped or not: SIGKILL ends it
            except ProcessLookupError:
                pass


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command name: state, ppid, pgrp, session, ... (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_time(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[19] if fields else None


def process_table() -> dict[int, list[str]] | None:
    """Every process's /proc/<pid>/stat fields after its command name (state, ppid, pgrp, ...), by pid; None where
    there is no /proc."""
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return None
    return {int(name): fields for name in entries if (fields := _stat_fields(name)) is not None}


def below(table: Mapping[int, list[str]], pid: int) -> list[int]:
    """The pids under `pid` in `table` (`process_table`), whatever their process group or session."""
    children: dict[int, list[int]] = {}
    for child, fields in table.items():
        children.setdefault(int(fields[1]), []).append(child)
    out: list[int] = []
    todo = [pid]
    while todo:
        found = children.get(todo.pop(), [])
        out += found
        todo += found
    return out


def descendants(pid: int) -> set[tuple[int, str]]:
    """(pid, start time) of every live process below `pid`, whatever its process group or session (empty where there
    is no /proc)."""
    live = {p: fields for p, fields in (process_table() or {}).items() if fields[0] != "Z"}
    return {(p, live[p][19]) for p in below(live, pid)}
