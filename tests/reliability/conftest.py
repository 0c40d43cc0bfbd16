"""Fixtures of the reliability tests: no leaked engine threads, a fixed torch RNG."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    state = torch.get_rng_state()
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    yield
    torch.set_rng_state(state)
    torch.set_num_threads(threads)
