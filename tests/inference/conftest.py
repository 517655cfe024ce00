"""Fixtures of the inference tests: one tiny-model server per test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import RunningServer, start_server


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """One tiny-model server shared by a test module (tests that change its weights start their own)."""
    with start_server(tiny_model_dir, tmp_path_factory.mktemp("server")) as running:
        yield running
    assert "engine stopped" in running.log(), running.log()
