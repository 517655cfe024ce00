"""What the memory benchmarks read from /proc: a process tree's members by role, and each one's memory, open files and
threads (Linux only). A library of soak.py and memory_fit.py, not a benchmark.

Roles come from the command line: a primerl child shows `primerl <command> ...` (forked children too), so the first
of `ROLES` among its words names it; the launcher itself is "rl".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROLES = ("inference", "orchestrator", "trainer", "sft", "rl")


def role_of(pid: int) -> str | None:
    try:
        words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    names = [w.decode(errors="replace").rsplit("/", 1)[-1] for w in words]
    for name in names:
        if name in ROLES:
            return name
    return None


def descendants(root: int) -> list[int]:
    """`root` and every process below it (children found through /proc/<pid>/task/*/children)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
            except OSError:
                pass
    return found


def sample_process(pid: int) -> dict[str, Any] | None:
    """RSS, PSS, USS (private pages) and anonymous memory (MB, /proc/<pid>/smaps_rollup), open files and threads of
    `pid`; None once it is gone. PSS also moves when another process stops sharing a page (a forked server's pages
    shared with its launcher): USS and anonymous memory are what the process itself holds."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    kb = {}
    for line in rollup.splitlines()[1:]:
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            kb[key] = int(parts[0])
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    private_kb = kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)  # the pages no other process maps (USS)
    return {"rss_mb": kb.get("Rss", 0) / 1024, "pss_mb": kb.get("Pss", 0) / 1024, "uss_mb": private_kb / 1024,
            "anon_mb": kb.get("Anonymous", 0) / 1024, "fds": fds,
            "threads": int(fields["Threads"].strip()), "hwm_mb": int(fields.get("VmHWM", "0 kB").split()[0]) / 1024}


def sample_tree(root: int) -> dict[str, dict[str, Any]]:
    """Every process of `root`'s tree that has a role: {role: sample}; several of one role (inference servers,
    trainer ranks) are summed, their fds and threads too."""
    out: dict[str, dict[str, Any]] = {}
    for pid in descendants(root):
        role = role_of(pid)
        if role is None or (facts := sample_process(pid)) is None:
            continue
        if role in out:
            out[role] = {k: out[role][k] + v for k, v in facts.items()}
        else:
            out[role] = facts
    return out


def tree_size(path: Path) -> tuple[float, int]:
    """(MB, files) under `path`."""
    total, files = 0, 0
    for folder, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                continue
            files += 1
    return total / 1e6, files


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys over xs; None with fewer than 3 points or no spread in xs."""
    n = len(xs)
    if n < 3:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


def median_slope(xs: list[float], ys: list[float]) -> float | None:
    """Theil-Sen slope: the median of the slopes between every two points with different xs. A short spike (a
    checkpoint's buffers, a weight update's copies) moves it little, where it can tilt a least-squares line. None with
    fewer than 3 points or no spread in xs."""
    if len(xs) < 3:
        return None
    slopes = sorted((ys[j] - ys[i]) / (xs[j] - xs[i]) for i in range(len(xs)) for j in range(i + 1, len(xs))
                    if xs[j] != xs[i])
    if not slopes:
        return None
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2
