"""Is a child process still making progress? For commands that wait on a child with no fixed time limit.

Progress is new output in the child's log, or CPU time spent by the child and every process it started (the three
processes under `rl`, for one). On a busy machine a child runs slowly but keeps spending CPU; a stuck child (a
deadlock, a wait on something that never comes) spends almost none. `ProgressWatch` samples both and says when the
child stalled and, now and then, what it is doing; what to do about a stall is the caller's business.
"""

from __future__ import annotations

import os
import re
import time

from primerl.launch.processes import ManagedProcess, below, process_table


class ProgressWatch:
    """Follows one `ManagedProcess` (call `sample` often): `stalled` after `stall_timeout_s` without new output and
    without CPU time spent; `heartbeat_due` every `HEARTBEAT_EVERY_S`, when `report` tells what changed. The few
    milliseconds of an idle poll loop stay far below `MIN_CPU_S` per `SAMPLE_EVERY_S`."""

    SAMPLE_EVERY_S = 5.0
    MIN_CPU_S = 0.1
    HEARTBEAT_EVERY_S = 15.0

    def __init__(self, proc: ManagedProcess, stall_timeout_s: float):
        self.proc = proc
        self.stall_timeout_s = stall_timeout_s
        now = time.monotonic()
        self.started = self.last_output = self.last_working = self.last_sample = self.last_heartbeat = now
        self.log_size = self._log_size()
        self.cpu_s = tree_cpu_seconds(proc.pid) or 0.0
        self.heartbeat_output = self.log_size  # the log's size at the last heartbeat

    def _log_size(self) -> int:
        try:
            return self.proc.log_path.stat().st_size
        except OSError:
            return 0

    def sample(self) -> None:
        now = time.monotonic()
        if now - self.last_sample < self.SAMPLE_EVERY_S:
            return
        self.last_sample = now
        size, cpu_s = self._log_size(), tree_cpu_seconds(self.proc.pid)
        if size != self.log_size:
            self.log_size, self.last_output = size, now
        if cpu_s is not None and cpu_s - self.cpu_s >= self.MIN_CPU_S:
            self.last_working = now
        self.cpu_s = max(self.cpu_s, cpu_s or 0.0)

    def stalled(self) -> bool:
        return time.monotonic() - max(self.last_output, self.last_working) > self.stall_timeout_s

    def heartbeat_due(self) -> bool:
        now = time.monotonic()
        if now - self.last_heartbeat < self.HEARTBEAT_EVERY_S:
            return False
        self.last_heartbeat = now
        return True

    def report(self) -> str:
        """What changed since the last report: `42 s, 37 CPU-s; <newest log line>` when there is new output, else
        `...; no new output for 30 s` (and `, idle for 20 s` when the processes spend no CPU either)."""
        now = time.monotonic()
        head = f"{now - self.started:.0f} s, {self.cpu_s:.0f} CPU-s"
        if self.log_size != self.heartbeat_output:
            self.heartbeat_output = self.log_size
            return f"{head}; {last_line(self.proc.tail(5))[:100]}"
        idle = now - self.last_working
        return f"{head}; no new output for {now - self.last_output:.0f} s" + (
            f", idle for {idle:.0f} s" if idle > self.SAMPLE_EVERY_S else "")


def last_line(text: str) -> str:
    """The last line of `text` that is not blank, or `(no output)`."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


# A line that ends a Python traceback: `ValueError: ...`, `primerl.x.ConfigError: ...`, `KeyboardInterrupt`.
_EXCEPTION = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Fault|Failure)(?::.*)?$")
# A one-line error of a command: `rl: error: ...`, `primerl check: failed: ...`, `ERROR ...`.
_ERROR = re.compile(r"(?:^|[\s:])(?:error|ERROR|failed|FAILED|Error)(?:[:\s]|$)")
# A prefix some logs put before each line: `[trainer] `, `[inference.0@a] `, `trainer | `.
_PREFIX = re.compile(r"^(?:\[[^\]\s]+\]\s|[\w.@-]+ \| )")


def root_cause(text: str) -> str:
    """The line of a failing command's output that says why it failed, rather than its last line (often something
    a process printed on its way down). In order: the exception line that ends the last Python traceback (of the
    same process, where lines carry a process prefix); else the last line that reads as an error (`error:`,
    `failed`); else the last non-blank line; `(no output)` for none. A `[name] ` or `name | ` prefix on a line is
    kept off the match, not off the result."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "(no output)"
    prefixes = [m.group(0) if (m := _PREFIX.match(line)) else "" for line in lines]
    bare = [line[len(prefix):] for line, prefix in zip(lines, prefixes)]
    tracebacks = [i for i, line in enumerate(bare) if line.startswith("Traceback (most recent call last)")]
    if tracebacks:  # its frames are indented; the first line of the same process that is not ends it
        start = tracebacks[-1]
        for i in range(start + 1, len(bare)):
            if prefixes[i] == prefixes[start] and not bare[i].startswith((" ", "\t")):
                return lines[i].strip()
    for i in reversed(range(len(bare))):
        if _EXCEPTION.match(bare[i]) or _ERROR.search(bare[i]):
            return lines[i].strip()
    return lines[-1].strip()


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system) spent by process `pid`, its descendants, and the children they have reaped, read
    from /proc; None where there is no /proc (then only the log shows progress)."""
    table = process_table()
    if table is None or pid not in table:
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return sum(sum(int(v) for v in table[p][11:15]) / tick for p in [pid, *below(table, pid)])
