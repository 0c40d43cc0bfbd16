"""Fixtures for the whole suite."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest

ENGINE_THREADS = ("dstt-copy", "dstt-write", "dstt-commit", "dstt-flusher-start")

# a session's flusher process starts at once in the suite (the default waits a second, so
# that a short run never pays for it): the tests' short sessions keep exercising the child,
# as they did before the delay; tests/engine/test_flusher_start.py tests the delay itself.
# Set here, before any test runs, so that the processes the tests spawn inherit it.
os.environ.setdefault("DSTT_FLUSHER_START_S", "0")


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
