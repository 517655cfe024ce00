"""Many concurrent streaming chat requests at once (the `fuzz` load test and `benchmarks/load_cpu.py`): each must
stream to `[DONE]` or be refused at once with 429/503 by the admission limit; nothing else."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass
class Outcome:
    status: int | None  # None: the connection failed
    completed: bool  # 200 and the stream ended with [DONE]
    first_event_s: float | None
    total_s: float
    error: str = ""


async def _one(http: httpx.AsyncClient, body: dict) -> Outcome:
    started = time.monotonic()
    first = None
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            done = False
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: "):
                    first = time.monotonic() - started
                done = done or line == "data: [DONE]"
            return Outcome(response.status_code, response.status_code == 200 and done, first,
                           time.monotonic() - started)
    except httpx.HTTPError as e:
        return Outcome(None, False, first, time.monotonic() - started, repr(e))


async def _storm(base_url: str, concurrency: int, body: dict, timeout_s: float) -> list[Outcome]:
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as http:
        return await asyncio.gather(*(_one(http, body) for _ in range(concurrency)))


def stream_storm(base_url: str, concurrency: int, max_tokens: int, timeout_s: float = 600) -> list[Outcome]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True}
    return asyncio.run(_storm(base_url, concurrency, body, timeout_s))


def memory_mb(pid: int, field: str = "VmHWM") -> float:
    """A memory figure of the process from /proc/<pid>/status, MiB: VmHWM (peak resident) or VmRSS (resident now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for pid {pid}")
