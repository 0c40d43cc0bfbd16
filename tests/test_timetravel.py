"""Rollback round trip through the whole stack: train to 60, roll back to 40, resume to 70.

Training here is deterministic, so the new timeline must reproduce the old one bit for bit
where the data is the same (skip_data=0), and differ exactly where the data says it should
(skip_data=N shifts every later batch by N).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import dstt
from dstt.testing.models import SyntheticBatches, TinyGPT

DATA = SyntheticBatches(200, batch_size=4, seq=16, vocab=64, seed=11)
NAME = "layers.1.qkv.weight"


def _train(run: Path, until: int, *, resume: bool) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    with dstt.session(model, opt, run=run, resume=resume) as s:
        for x, y in s.data(DATA):
            if s.step >= until:
                break
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.log(loss=loss.item())
            losses.append(loss.item())
    return losses


def _reference(skip_at: int, skip: int, until: int) -> list[float]:
    """Losses of a plain loop (no dstt) that skips ``skip`` batches after step ``skip_at``."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=4, seq=16, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order = list(range(skip_at)) + list(range(skip_at + skip, until + skip))
    out = []
    for i in order:
        x, y = DATA[i]
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("skip", [0, 3])
def test_rollback_round_trip(tmp_path: Path, skip: int) -> None:
    run_dir = tmp_path / "run"
    first = _train(run_dir, 60, resume=False)
    run = dstt.open(run_dir)
    assert run.steps == list(range(1, 61))
    new = run.rollback(to=40, skip_data=skip)
    resumed = _train(run_dir, 70, resume=True)
    assert len(resumed) == 30

    # the losses are exactly those of a plain loop that skipped the same batches
    ref = _reference(40, skip, 70)
    assert first[:40] == ref[:40]
    if skip == 0:
        assert first == ref[:60]
    assert resumed == ref[40:70]

    run = dstt.open(run_dir)
    assert set(run.timelines) == {"main", new}
    assert run.timeline == new
    assert run.steps == list(range(1, 71))
    old_steps = [h.step for h in run.commits("main")]
    assert old_steps == list(range(1, 61))  # the abandoned timeline is intact
    old = run.trajectory(NAME, steps=slice(1, 60), timeline="main").values
    cur = run.trajectory(NAME, steps=slice(1, 60)).values
    assert np.array_equal(old[:40], cur[:40])  # shared history is the same slots
    if skip == 0:
        assert np.array_equal(old, cur)  # same data: the new timeline repeats the old exactly
    else:
        assert not np.array_equal(old[40:], cur[40:])  # shifted data: it diverges after 40
        assert all(not np.array_equal(old[i], cur[i]) for i in range(40, 59))
    for step in (41, 55, 60):
        assert run.at(step, timeline="main").to_numpy(NAME).shape == (96, 32)
    assert run.verify().ok


def test_delete_the_abandoned_timeline_after_resuming(tmp_path: Path) -> None:
    """After a rollback and a resume, deleting the old timeline frees its own 20 steps only:
    the new timeline, whose steps 1..40 are the old one's commits (deltas included), reads
    back bit-exactly, and training resumes on it again."""
    run_dir = tmp_path / "run"
    _train(run_dir, 60, resume=False)
    run = dstt.open(run_dir)
    new = run.rollback(to=40)
    _train(run_dir, 50, resume=True)
    run.refresh()
    before = run.trajectory(NAME, steps=slice(1, 50)).values
    with pytest.raises(dstt.CurrentTimelineError, match="switch"):
        run.delete_timeline(new)
    files = len(list((run_dir / "steps").iterdir()))
    rep = run.delete_timeline("main")
    assert rep.freed_steps == tuple(range(41, 61))
    assert rep.kept_steps == tuple(range(1, 41))
    assert len(list((run_dir / "steps").iterdir())) == files - rep.gc.files_removed
    assert rep.gc.files_removed > 0
    assert set(run.timelines) == {new}
    after = run.trajectory(NAME, steps=slice(1, 50)).values
    assert before.tobytes() == after.tobytes()
    assert run.verify().ok
    run.rename_timeline(new, "main")  # the old name is free again
    assert _train(run_dir, 52, resume=True)
    assert dstt.open(run_dir).steps == list(range(1, 53))
