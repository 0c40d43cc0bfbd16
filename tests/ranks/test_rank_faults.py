"""Ranks that die or fail: rank 0 gives up once, typed, and keeps what every rank finished.

Real spawned gloo ranks (``faults_worker.py``). The steps here are independent per rank (no
collective), so rank 0 keeps training after its peer is gone and its session alone decides
how long it waits: one bounded wait for the lost rank (its session's end, or its silent
heartbeat), never ``rank_timeout`` per pending step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .conftest import launch, logs_of, wait

WORKER = Path(__file__).with_name("faults_worker.py")
RANK_TIMEOUT = 12.0  # faults_worker.RANK_TIMEOUT
PENDING = 4  # rank 0's steps 5-8 wait for the lost rank


def run_case(case: str, tmp_path: Path) -> dict[str, Any]:
    procs = launch(WORKER, [case, str(tmp_path / "run"), str(tmp_path)], 2, tmp_path, case)
    wait(procs, timeout=180)
    report = tmp_path / f"{case}.json"
    assert report.exists(), f"rank 0 wrote no report; logs:\n{logs_of(tmp_path, case)}"
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def test_a_rank_that_raises_keeps_the_steps_both_finished(tmp_path: Path) -> None:
    """Rank 1 raises at the start of step 5: step 4, which both ranks finished, is committed
    (it was dropped before), and rank 0 learns at once that rank 1 is gone."""
    r = run_case("raise", tmp_path)
    assert r["steps"] == [1, 2, 3, 4]
    assert r["error"] is not None, "rank 0's session must fail: its later steps cannot commit"
    assert r["lost"], r["error"]  # a CaptureError caused by a RankLostError naming rank 1
    assert "ranks [1] are gone" in r["error"], r["error"]
    # rank 1 said it left: no step waits rank_timeout for it, let alone one per step
    assert r["after_fault_s"] < RANK_TIMEOUT, r


def test_a_killed_rank_costs_one_bounded_wait_not_one_per_step(tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed with its step 5 in flight while rank 0 trains to step 8: rank 0
    notices the silent heartbeat and gives up every pending step together (a typed error),
    instead of waiting ``rank_timeout`` for each of its 4 pending steps; what both ranks
    committed stays committed."""
    r = run_case("kill", tmp_path)
    assert r["error"] is not None
    assert r["lost"], r["error"]
    assert "no heartbeat" in r["error"], r["error"]
    # steps 1-4 were committed before the kill (the worker waits for them); step 5 only
    # if rank 1's in-flight part of it became durable before the kill
    assert r["steps"] == list(range(1, len(r["steps"]) + 1)), r["steps"]
    assert 4 <= len(r["steps"]) <= 5, r["steps"]
    # noticed by the heartbeat (rank_timeout / 2 = 6 s) before any wait for it timed out
    assert r["after_fault_s"] < RANK_TIMEOUT < PENDING * RANK_TIMEOUT, r


def test_a_session_on_rank_0_alone_fails_after_start_timeout(tmp_path: Path) -> None:
    """``start_timeout`` (60 s by default, 2 here) bounds the start handshake, not the
    ``rank_timeout`` of 10 minutes."""
    r = run_case("alone", tmp_path)
    assert r["rank_error"], r["error"]
    assert "start_timeout" in r["error"], r["error"]
    assert r["start_s"] < 30, r


@pytest.mark.parametrize("bad", [0, -1.0, True, "60"])
def test_start_timeout_is_checked(tmp_path: Path, bad: object) -> None:
    import torch

    import dstt

    model = torch.nn.Linear(2, 2)
    with pytest.raises(dstt.ConfigError, match="start_timeout"):
        dstt.session(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            run=tmp_path / "r",
            start_timeout=bad,
        )  # type: ignore[arg-type]
