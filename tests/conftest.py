"""Shared fixtures. Models come from primerl's own registry (built or converted once, then cached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from primerl.ports import free_port


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from primerl.models import resolve_model

    return resolve_model("tiny")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from primerl.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture
def port() -> int:
    return free_port()


_TIER_ORDER = {"integration": 2, "slow": 1, "system": 3, "images": 4}


def pytest_collection_modifyitems(config, items):
    """Run cheap tests first: unit tests, then tests on the embedded model, then integration, then system tests
    (which start daemons). A quick failure is reported before the heavy set-up begins."""

    def tier(item) -> int:
        return max((_TIER_ORDER[m.name] for m in item.iter_markers() if m.name in _TIER_ORDER), default=0)

    items.sort(key=tier)
