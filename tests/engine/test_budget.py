"""The overhead budget of ``every="auto"`` (dstt/engine/capture/budget.py): each step earns
its share of the wall time, the engine's cost is spent, and a store waits for a balance
that is not negative; and a real session under it stores less than at the disk's pace."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from dstt.engine.capture.budget import OverheadBudget, cpu_seconds
from dstt.training import session

from ._helpers import MLP, mlp_batch, train_step


def test_a_store_waits_until_its_cost_is_earned_back() -> None:
    b = OverheadBudget(0.05)
    b.tick(0.0, 0.0)
    assert b.allows()  # nothing spent yet: the first step may be stored
    b.tick(0.1, 0.2)  # a store cost 0.2 s over a 0.1 s step
    assert not b.allows()
    assert b.balance == pytest.approx(0.05 * 0.1 - 0.2)
    ticks = 0
    now = 0.1
    while not b.allows():  # quiet steps of 0.1 s earn 5 ms each
        now += 0.1
        b.tick(now, 0.2)
        ticks += 1
    assert ticks == 39  # 0.195 s to earn back at 5 ms a step: over 5 % of the time overall
    assert b.spent_s == pytest.approx(0.2)


def test_the_cost_is_cumulative_and_credit_is_capped() -> None:
    b = OverheadBudget(0.5)
    b.tick(0.0, 1.0)  # the first reading is the baseline, not a cost
    assert b.balance == 0.0
    b.tick(100.0, 1.0)  # a long stretch of light steps banks at most the cap
    assert b.balance == pytest.approx(1.0)
    b.tick(101.0, 0.5)  # a thread that ended: its CPU leaves the sum; never a credit
    assert b.balance == pytest.approx(1.0)
    with pytest.raises(ValueError, match="share"):
        OverheadBudget(0.0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads Linux /proc")
def test_cpu_seconds_reads_a_busy_thread_and_ignores_an_ended_one() -> None:
    done = threading.Event()
    ids: list[int | None] = []

    def spin() -> None:
        ids.append(threading.get_native_id())
        t = time.thread_time()
        while time.thread_time() - t < 0.3:
            pass
        done.wait()

    th = threading.Thread(target=spin)
    th.start()
    while not ids:
        time.sleep(0.01)
    deadline = time.monotonic() + 60
    got = 0.0
    while got < 0.25 and time.monotonic() < deadline:
        got = cpu_seconds(ids) or 0.0
        time.sleep(0.02)
    assert got >= 0.25
    done.set()
    th.join()
    assert cpu_seconds(ids) == 0.0  # gone: nothing to read, no error
    assert (cpu_seconds([], [os.getpid()]) or 0.0) > 0.0


def test_a_session_under_budget_stores_less_than_at_the_disks_pace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's real cost: with a budget of 5 % most steps are light, and never more
    than ``max_gap`` in a row; with an unlimited share (1.0) more are stored."""
    from dstt.engine.capture import pipeline as pipeline_mod

    real = pipeline_mod.OverheadBudget
    stored: dict[float, list[int]] = {}
    for share in (1.0, 0.05):
        monkeypatch.setattr(pipeline_mod, "OverheadBudget", lambda s=share: real(s))
        m = MLP()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        with session(m, opt, run=tmp_path / f"r{share}", every="auto", max_gap=6) as s:
            for i in range(30):
                train_step(m, opt, *mlp_batch(i))
                s.wait()  # the previous step committed: only the budget can say no
        stored[share] = [mm.step for mm in s.metrics if mm.stored]
    assert len(stored[1.0]) > len(stored[0.05])
    gaps = [b - a - 1 for a, b in zip(stored[0.05], stored[0.05][1:], strict=False)]
    assert max(gaps) <= 6
