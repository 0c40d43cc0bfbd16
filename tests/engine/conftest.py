"""Fixtures for the capture-engine tests: no leaked engine threads, small real models."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_leaked_engine_threads() -> Iterator[None]:
    """Every test must leave no dstt copy/writer/commit thread behind."""
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("dstt-")]
        if not alive:
            return
        time.sleep(0.01)
    pytest.fail(f"engine threads still alive after the test: {alive}")


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    state = torch.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.set_rng_state(state)
