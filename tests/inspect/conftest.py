"""Fixtures for the inspection tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from inspect_helpers import new_repo, small_model, write_steps


@pytest.fixture
def small_run(tmp_path: Path) -> Path:
    """Steps 1..5 of ``small_model`` on timeline main, chunks of 64 bytes (many chunks)."""
    path = tmp_path / "run"
    write_steps(new_repo(path), [1, 2, 3, 4, 5], small_model, chunk_bytes=64)
    return path
