"""Fixtures for the capture-engine tests: no leaked engine threads, small real models."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _seeded() -> Iterator[None]:
    state = torch.get_rng_state()
    torch.manual_seed(0)
    yield
    torch.set_rng_state(state)
