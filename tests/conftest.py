"""Fixtures for the whole suite."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

ENGINE_THREADS = ("dstt-copy", "dstt-write", "dstt-commit")


@pytest.fixture(autouse=True)
def _no_leaked_engine_threads() -> Iterator[None]:
    """Every test must leave no capture-engine thread behind (the inspection layer's shared
    read pool, ``dstt-read_N``, lives on by design)."""
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [t.name for t in threading.enumerate() if t.name.startswith(ENGINE_THREADS)]
        if not alive:
            return
        time.sleep(0.01)
    pytest.fail(f"engine threads still alive after the test: {alive}")
