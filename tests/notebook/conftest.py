"""Fixtures for the notebook-experience tests (runs from ``notebook_helpers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from notebook_helpers import STEPS, write_run

import dstt


@pytest.fixture
def run_path(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    write_run(path, STEPS)
    return path


@pytest.fixture
def run(run_path: Path) -> Any:
    return dstt.open(run_path)


@pytest.fixture
def summarized_run(tmp_path: Path) -> Any:
    path = tmp_path / "run-sum"
    write_run(path, STEPS, summaries=True)
    return dstt.open(path)
