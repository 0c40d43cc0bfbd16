"""Fixtures of the reliability tests: no leaked engine threads, a fixed torch RNG."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _no_leaked_engine_threads() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        # the inspection layer's shared read pool (``dstt-read_N``) lives on by design
        alive = [t.name for t in threading.enumerate()
                 if t.name.startswith("dstt-") and not t.name.startswith("dstt-read")]
        if not alive:
            return
        time.sleep(0.01)
    pytest.fail(f"engine threads still alive after the test: {alive}")


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    state = torch.get_rng_state()
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    yield
    torch.set_rng_state(state)
    torch.set_num_threads(threads)
