"""Fixtures for recipe tests: copies of pinned artifacts to tamper with (the real cache and checkout stay untouched)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from recipe_helpers import ROOT, flip_last_byte


@pytest.fixture
def tampered_lock(tmp_path) -> Path:
    """A copy of uv.lock with one byte changed."""
    lock = tmp_path / "uv.lock"
    shutil.copy(ROOT / "uv.lock", lock)
    flip_last_byte(lock)
    return lock


@pytest.fixture
def tampered_model_cache(tmp_path, tiny_model_dir) -> Path:
    """A primerl cache directory holding a copy of the tiny model whose weights differ by one byte."""
    cache = tmp_path / "cache"
    copy = cache / "models" / tiny_model_dir.name
    shutil.copytree(tiny_model_dir, copy)
    weights = copy / "model.safetensors"
    weights.chmod(0o644)
    flip_last_byte(weights)
    return cache


@pytest.fixture
def tampered_data_path(tmp_path) -> Path:
    """A directory to put first on sys.path, holding a copy of the reverse_text package with a changed word list."""
    import reverse_text

    pkgs = tmp_path / "pkgs"
    copy = pkgs / "reverse_text"
    shutil.copytree(Path(reverse_text.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    words = copy / "data" / "words.txt"
    words.write_text(words.read_text() + "tampered\n")
    return pkgs
