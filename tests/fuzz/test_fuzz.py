"""Bounded fuzzing (see fuzzing.py) and load (load.py): no request makes the server answer >= 500 or stop answering,
a storm of streams completes or is refused with 429, and no config or recipe makes a loader raise anything but its
one-line error.

The default test run sends a light budget; `.ci/run` runs this group again with the full one
(`PRIMERL_FUZZ_REQUESTS=10000 PRIMERL_FUZZ_LOADER_INPUTS=1000 PRIMERL_LOAD_STREAMS=256 uv run pytest -m fuzz`);
`benchmarks/fuzz.py` and `benchmarks/load_cpu.py` record the figures."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
from fuzzing import LoaderTally, fuzz_config_loader, fuzz_recipe_loader, fuzz_server, health_after
from load import memory_mb, stream_storm
from server_process import start_server

pytestmark = pytest.mark.fuzz

REQUESTS = int(os.environ.get("PRIMERL_FUZZ_REQUESTS", "600"))
LOADER_INPUTS = int(os.environ.get("PRIMERL_FUZZ_LOADER_INPUTS", "200"))
STREAMS = int(os.environ.get("PRIMERL_LOAD_STREAMS", "64"))
REPO = Path(__file__).resolve().parents[2]
MEMORY_BOUND_MB = 4096  # the tiny-model server's peak RSS under the storm (about 0.8 GiB measured)


def test_fuzzed_requests_never_get_a_5xx(tiny_model_dir: Path, tmp_path: Path):
    fuzzed = fuzz_server(tiny_model_dir, tmp_path, REQUESTS)
    tally = fuzzed.tally
    assert fuzzed.health_after
    assert fuzzed.tracebacks_in_server_log == 0
    assert tally.requests >= REQUESTS * 0.95, tally.as_dict()
    assert not tally.server_errors, tally.as_dict()
    assert not tally.conformance_failures, tally.as_dict()
    assert len(tally.statuses) >= 4, tally.as_dict()  # the fuzzer reached past validation: 200, 400, 401, 404 ...


def test_config_loader_never_raises_a_traceback():
    tally = LoaderTally()
    fuzz_config_loader(LOADER_INPUTS, tally)
    assert not tally.tracebacks, tally.as_dict()
    assert tally.refused_in_one_line and tally.accepted, tally.as_dict()


def test_recipe_loader_never_raises_a_traceback():
    tally = LoaderTally()
    fuzz_recipe_loader(LOADER_INPUTS, tally, REPO / "recipes" / "tiny.toml")
    assert not tally.tracebacks, tally.as_dict()
    assert tally.refused_in_one_line and tally.accepted, tally.as_dict()


def test_a_storm_of_streams_completes_or_is_refused_with_429(tiny_model_dir: Path, tmp_path: Path):
    """STREAMS concurrent streaming chats against a server admitting a quarter of them: every one streams to [DONE]
    or gets 429 at once; the server's memory stays under the bound and it answers afterwards."""
    admitted = STREAMS // 4
    args = ("--max-concurrent-requests", str(admitted), "--max-batch-size", "32")
    with start_server(tiny_model_dir, tmp_path, *args) as server:
        outcomes = stream_storm(server.base_url, concurrency=STREAMS, max_tokens=16)
        assert health_after(server.base_url)
        peak = memory_mb(server.process.pid, "VmHWM")
    statuses = Counter(o.status for o in outcomes)
    assert all(o.completed or o.status in (429, 503) for o in outcomes), statuses
    assert statuses[200] >= admitted and statuses[429] > 0, statuses
    assert peak < MEMORY_BOUND_MB, peak
