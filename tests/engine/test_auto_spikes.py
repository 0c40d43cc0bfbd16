"""A loss spike in an ``every="auto"`` run whose window is made of light steps: after gc
with a spike window, every light step of the window still rebuilds bit for bit (against an
every=1 reference run), and ``run.explain`` answers on the rebuilt steps, replaying the
spike's step from its rebuilt predecessor."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import dstt
from dstt.store._internal import Repository
from dstt.store.storage.memory import FaultyStorage, MemoryStorage

from ._helpers import same_bits, stored

STEPS, SPIKE, WINDOW = 40, 30, 3
X = torch.randn(STEPS * 4, 8, generator=torch.Generator().manual_seed(1))
Y = torch.randn(STEPS * 4, 4, generator=torch.Generator().manual_seed(2))
Y[(SPIKE - 1) * 4 : SPIKE * 4] *= 40.0  # step SPIKE's batch: far-off targets
DATA = torch.utils.data.TensorDataset(X, Y)


def _objects() -> dict[str, Any]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    return {"model": m, "optimizer": torch.optim.Adam(m.parameters(), lr=1e-2)}


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _train(repo: Repository, **options: Any) -> None:
    obj = _objects()
    m, opt = obj["model"], obj["optimizer"]
    loader = torch.utils.data.DataLoader(DATA, batch_size=4)
    with dstt.session(m, opt, run=repo, **options) as s:
        for batch in s.data(loader):
            loss = _loss(m, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.log(loss=loss)


def _window() -> list[int]:
    return list(range(SPIKE - WINDOW, SPIKE + WINDOW + 1))


@pytest.fixture(scope="module")
def pair() -> tuple[Repository, Repository]:
    """(an every=1 reference run, the same run under every="auto" with light steps in the
    spike's window)."""
    ref = MemoryStorage()
    Repository.create(ref)
    _train(Repository(ref), every=1)
    delay = 0.02
    for _ in range(4):  # a fast machine may keep up now and then: slow it until it does not
        inner = MemoryStorage()
        Repository.create(inner)
        slow = FaultyStorage(inner, on_write=lambda key, d=delay: time.sleep(d))
        _train(Repository(slow), every="auto", max_backlog=2, max_gap=3)
        light = dstt.open(Repository(inner)).light_steps()
        if len(set(light) & set(_window())) >= 2:
            return Repository(ref), Repository(inner)
        delay *= 3
    raise AssertionError("the slowed storage never left light steps in the spike's window")


def test_a_spike_window_of_light_steps_rebuilds_after_gc(
    pair: tuple[Repository, Repository],
) -> None:
    ref, inner = pair
    run = dstt.open(inner)
    (spike,) = [s for s in run.spikes() if s.start == SPIKE]
    report = run.gc(retention=dstt.Retention(keep_last=1, spike_window=WINDOW))
    run.refresh()
    assert report.pruned_steps  # gc pruned stored steps outside the window
    assert not report.stranded_light or all(k not in _window() for _, k in report.stranded_light)
    light = sorted(k for k in run.light_steps() if k in _window())
    assert len(light) >= 2
    run.use_replay({**_objects(), "dataset": DATA, "loss_fn": _loss})
    for k in light:
        snap = run.at(k)
        assert snap.rebuilt is not None
        assert snap.rebuilt.faithful
        for path in dstt.open(ref).at(k).arrays:
            got = torch.from_numpy(snap.to_numpy(path, native=True))
            assert same_bits(got, stored(ref, k, path)), (k, path)
    assert spike.step >= SPIKE


def test_explain_answers_on_the_rebuilt_steps_of_a_light_spike(
    pair: tuple[Repository, Repository],
) -> None:
    ref, inner = pair
    run = dstt.open(inner, replay={**_objects(), "dataset": DATA, "loss_fn": _loss})
    (spike,) = [s for s in run.spikes() if s.start == SPIKE]
    got = run.explain(spike, replay={**_objects(), "dataset": DATA, "loss_fn": _loss})
    want = dstt.open(ref).explain(SPIKE, replay={**_objects(), "dataset": DATA, "loss_fn": _loss})
    bad = {f.mechanism: f for f in got.findings}["bad_data"]
    assert bad.verdict == {f.mechanism: f for f in want.findings}["bad_data"].verdict
    assert bad.verdict != "unknown"
