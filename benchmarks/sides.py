"""Helpers shared by the benchmarks that run each side of a comparison in its own process (vllm_offline.py,
p1_gpu_matrix.py): a side's process with a time limit, CPU seconds of a process and its descendants, cProfile's top
functions, a `primerl inference` server and a batch sent through its token route, installed package versions."""

from __future__ import annotations

import asyncio
import json
import os
import pstats
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TOKEN_ROUTE = "/inference/v1/generate"


def run_side(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one side's process; its result is the last stdout line (one JSON object). A failure or a timeout becomes
    {"error": ...} (never a figure), with the wall time either way."""
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or "")[-1500:]
        return {"error": f"timed out after {timeout_s:.0f} s", "stderr_tail": tail,
                "wall_s": round(time.monotonic() - started, 1)}
    sys.stderr.write(done.stderr[-3000:])
    wall = round(time.monotonic() - started, 1)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}", "stderr_tail": done.stderr[-1500:], "wall_s": wall}
    try:
        return {**json.loads(lines[-1]), "wall_s": wall}
    except json.JSONDecodeError:
        return {"error": "the side printed no JSON result", "stdout_tail": done.stdout[-1500:], "wall_s": wall}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc); 0.0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    """The live processes below `pid` (children, grandchildren, ...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpu_snapshot(pid: int) -> dict[str, float]:
    """CPU seconds of `pid` itself and of its live descendants together (e.g. vLLM's engine-core process)."""
    return {"process": cpu_seconds(pid), "children": sum(cpu_seconds(p) for p in descendants(pid))}


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: round(after[key] - before[key], 3) for key in before}


def profile_top(profile: Any, limit: int = 25) -> list[dict[str, Any]]:
    """The `limit` functions of a cProfile.Profile with the most own time: where, calls, own and cumulative s."""
    stats = pstats.Stats(profile)
    rows = []
    for (file, line, name), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": calls, "tottime_s": round(own, 4),
                     "cumtime_s": round(cumulative, 4)})
    return sorted(rows, key=lambda r: r["tottime_s"], reverse=True)[:limit]


def pyspy_top(raw: str, limit: int = 25) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks summarized: the samples, and the `limit` functions with the most samples on
    top of the stack (own) and anywhere in it (inclusive), each with its share of the samples."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]  # a function, not its lines
        total += int(count)
        own[frames[-1]] = own.get(frames[-1], 0) + int(count)
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + int(count)

    def top(counts: dict[str, int]) -> list[dict[str, Any]]:
        rows = sorted(counts.items(), key=lambda kv: kv[1], reverse=True)[:limit]
        return [{"frame": frame, "samples": n, "share": round(n / total, 4)} for frame, n in rows]

    return {"samples": total, "top_own": top(own), "top_inclusive": top(inclusive)}


@contextmanager
def inference_server(model_dir: Path, log_path: Path, *args: str, startup_s: float = 300.0) -> Iterator[tuple[str, int]]:
    """`primerl inference` on loopback and a free port serving `model_dir` as "bench"; yields (base URL, pid)
    once /health answers 200, stops it with SIGTERM (then kill) on the way out."""
    import httpx

    command = [sys.executable, "-m", "primerl.cli", "inference", "--model.name", str(model_dir),
               "--served-model-name", "bench", "--port", "0", *args]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline, base_url = time.monotonic() + startup_s, None
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}: {log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy after {startup_s:.0f} s: {log_path.read_text()[-2000:]}")
            if base_url is None and (match := re.search(r"listening on ([\d.]+):(\d+)", log_path.read_text())):
                base_url = f"http://{match[1]}:{match[2]}"
            if base_url is not None:
                try:
                    if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.25)
        yield base_url, process.pid
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def token_route_batch(base_url: str, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds to complete every prompt at once through the token route (`new_tokens` each, temperature 1, eos
    ignored, the sampled token's log-prob asked, as the orchestrator asks); a short reply is an error."""
    import httpx

    params = {"max_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=600) as client:
        async def one(prompt: list[int]) -> None:
            response = await client.post(TOKEN_ROUTE, json={"model": "bench", "token_ids": prompt,
                                                            "sampling_params": params})
            response.raise_for_status()
            got = len(response.json()["choices"][0]["token_ids"])
            if got != new_tokens:
                raise RuntimeError(f"a reply of {got} tokens, {new_tokens} asked")

        started = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - started


def package_versions(python: str, names: list[str], env: dict[str, str] | None = None) -> dict[str, str | None]:
    """Installed versions of `names` as interpreter `python` sees them (with `env`): package metadata, else the
    module's __version__; None where absent."""
    probe = ("import importlib, importlib.metadata as m, json, sys\nout = {}\nfor n in sys.argv[1:]:\n"
             "    try:\n        out[n] = m.version(n)\n    except m.PackageNotFoundError:\n"
             "        try:\n            out[n] = importlib.import_module(n).__version__\n"
             "        except Exception:\n            out[n] = None\nprint(json.dumps(out))\n")
    try:
        done = subprocess.run([python, "-c", probe, *names], capture_output=True, text=True, check=True, timeout=120,
                              env=env)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, json.JSONDecodeError, IndexError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}  # type: ignore[dict-item]
