"""``every="auto"`` through the framework callbacks: a light step records its samples and
its training step's loss, and rebuilds bit for bit (the Trainer's own step, replayed) to
what an every=1 run of the same fit stored."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import dstt
from dstt.store._internal import Repository
from dstt.store.storage.memory import FaultyStorage, MemoryStorage

pytestmark = pytest.mark.usefixtures("one_thread")


def _slow(delay: float) -> tuple[Repository, Repository]:
    inner = MemoryStorage()
    Repository.create(inner)
    return Repository(FaultyStorage(inner, on_write=lambda key: time.sleep(delay))), Repository(
        inner
    )


def _auto(fit: Any) -> dstt.Run:
    """``fit(repo)`` on a slowed storage until the engine left light steps behind."""
    for delay in (0.02, 0.08, 0.3):
        slow, inner = _slow(delay)
        fit(slow)
        run = dstt.open(inner)
        if len(run.light_steps()) >= 2:
            return run
    raise AssertionError("the slowed storage never made the engine busy")


def _same_state(got: dstt.Snapshot, want: dstt.Snapshot) -> None:
    assert sorted(got.arrays) == sorted(want.arrays)
    for path in want.arrays:
        a = got.to_numpy(path, native=True)
        b = want.to_numpy(path, native=True)
        assert a.dtype == b.dtype, (got.step, path)
        assert a.tobytes() == b.tobytes(), (got.step, path)


def test_lightning_light_steps_rebuild_through_the_trainer(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from pl_setup import travel_data, travel_loader, travel_model, travel_trainer

    from dstt.integrations.lightning import DsttCallback

    steps, data = 10, travel_data()

    def fit(run: Any, every: int | str) -> None:
        cb = DsttCallback(run=run, every=every, max_backlog=2)
        travel_trainer([cb], steps=steps).fit(travel_model(), travel_loader(data))

    fit(tmp_path / "ref", 1)
    ref = dstt.open(tmp_path / "ref")
    run = _auto(lambda repo: fit(repo, "auto"))
    light = sorted(run.light_steps())
    assert all(bits is not None for bits in run.light_steps().values())  # a loss each
    assert all(run.batches([k])[k] for k in light)  # and its samples
    # a fresh Trainer and module, built as the script builds them (accumulation, clipping)
    fresh = travel_trainer([], steps=steps)
    run.use_replay({"trainer": fresh, "module": travel_model(seed=7), "dataset": data})
    for k in light:
        snap = run.at(k)
        assert snap.rebuilt.checked == list(range(snap.rebuilt.base + 1, k + 1))
        _same_state(snap, ref.at(k))


def test_hf_trainer_light_steps_rebuild_through_the_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from hf_setup import PatternData, default_args, tiny_gpt2
    from transformers import Trainer

    from dstt.integrations.transformers import DsttCallback

    steps, data = 8, PatternData()

    def trainer(callbacks: list[Any], seed: int = 0) -> Trainer:
        return Trainer(
            model=tiny_gpt2(seed),
            args=default_args(str(tmp_path / "out"), max_steps=steps),
            train_dataset=data,
            callbacks=callbacks,
        )

    def fit(run: Any, every: int | str) -> None:
        cb = DsttCallback(run=run, every=every, max_backlog=2)
        try:
            trainer([cb]).train()
        finally:
            cb.close()

    fit(tmp_path / "ref", 1)
    ref = dstt.open(tmp_path / "ref")
    run = _auto(lambda repo: fit(repo, "auto"))
    light = sorted(run.light_steps())
    assert all(bits is not None for bits in run.light_steps().values())  # logging_steps=1
    fresh = trainer([], seed=7)
    run.use_replay({"trainer": fresh})
    for k in light:
        snap = run.at(k)
        assert snap.rebuilt.checked == list(range(snap.rebuilt.base + 1, k + 1))
        _same_state(snap, ref.at(k))
