"""The time-travel loop under ``lightning.Trainer`` (a tiny GPT, CPU, synthetic data).

Proves, with ``accumulate_grad_batches=2`` and ``gradient_clip_val=1.0``: the callback records
the dataset indices of every micro-batch of every step without changing one (the loss sequence
equals a run without dstt bit for bit); ``run.spikes()`` with its defaults finds the step where
corrupted samples were planted; ``run.replay`` runs the module's own ``training_step`` and
Lightning's clipping bit-exactly and names the planted samples; a rollback that skips them,
resumed through the callback, brings that step's loss back to the clean level with every other
sample in its old order and the old timeline intact; a skip set that the loader cannot honour
raises instead of training on the samples; manual optimization, which steps inside
``training_step``, cannot be replayed and says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from pl_setup import (
    ACCUM,
    PLANTED,
    SPIKE,
    TRAVEL_STEPS,
    Batches,
    ResumableLoader,
    loader,
    make_trainer,
    model,
    travel_data,
    travel_loader,
    travel_model,
    travel_trainer,
)
from torch.utils.data import DataLoader

import dstt
from dstt.errors import ConfigError, ReplayError
from dstt.integrations.lightning import DsttCallback

pytestmark = pytest.mark.usefixtures("one_thread")


def _indices(run: dstt.Run, timeline: str | None = None) -> dict[int, list[list[int]]]:
    return {k: [b.samples for b in v] for k, v in run.batches(timeline=timeline).items()}


def test_indices_of_every_micro_batch_are_recorded_and_no_batch_changes(tmp_path: Path) -> None:
    data = travel_data()

    def fit(run: Path | None) -> Batches:
        seen = Batches()
        cbs: list[object] = [seen] + ([DsttCallback(run=run)] if run is not None else [])
        shuffled = DataLoader(
            data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3)
        )
        travel_trainer(cbs, steps=5).fit(travel_model(), shuffled)
        return seen

    plain, recorded = fit(None), fit(tmp_path / "run")
    assert recorded.losses == plain.losses  # bit for bit
    assert all(torch.equal(a, b) for a, b in zip(recorded.seen, plain.seen, strict=True))
    steps = _indices(dstt.open(tmp_path / "run"))
    assert sorted(steps) == [1, 2, 3, 4, 5]
    lists = [ix for k in sorted(steps) for ix in steps[k]]
    assert all(len(v) == ACCUM for v in steps.values())
    assert sorted(i for ix in lists for i in ix) == sorted(set(i for ix in lists for i in ix))
    for ix, x in zip(lists, recorded.seen, strict=True):  # the indices of what was trained on
        assert torch.equal(data.tensors[0][ix], x)


def test_spike_replay_rollback_and_resume_without_the_planted_samples(tmp_path: Path) -> None:
    path = tmp_path / "run"
    data = travel_data()
    module, trainer = travel_model(), travel_trainer([DsttCallback(run=path)])
    trainer.fit(module, travel_loader(data))
    run = dstt.open(path)
    spikes = run.spikes()
    assert spikes, "no spike found with run.spikes()'s defaults"
    assert spikes[0].start == SPIKE

    replay = run.replay(SPIKE, trainer=trainer, module=module)
    assert replay.faithful, (replay.max_abs_diff, replay.differs[:3])
    assert sorted(replay.worst(3)) == sorted(PLANTED)
    assert replay.losses[-1] > 2 * replay.losses[0]  # the planted micro-batch
    # Lightning clipped this step's gradients: a replay without the clipping misses
    unclipped = run.replay(SPIKE, trainer=trainer, module=module, before_step=lambda: None)
    assert not unclipped.faithful
    # a fresh Trainer and module, built as the script builds them, replay the same step
    fresh = run.replay(SPIKE, trainer=travel_trainer([]), module=travel_model(seed=7), dataset=data)
    assert fresh.faithful
    assert fresh.worst(3) == replay.worst(3)

    old = run.timeline
    old_losses = run.metrics()["loss"].values.copy()
    old_batches = _indices(run)
    run.rollback(SPIKE - 1, skip_samples=replay.worst(3))
    seen = Batches()
    resumed = travel_trainer([seen, DsttCallback(run=path, resume=True)])
    resumed.fit(travel_model(seed=1), travel_loader(data))

    run = dstt.open(path)
    assert run.timeline != old
    new = _indices(run)
    expected = {
        k: [[i for i in ix if i not in PLANTED] for ix in old_batches[k]]
        for k in range(SPIKE, TRAVEL_STEPS + 1)
    }
    assert {k: new[k] for k in expected} == expected  # the same order, without them
    lists = [ix for k in sorted(expected) for ix in expected[k]]
    assert all(torch.equal(data.tensors[0][ix], x) for ix, x in zip(lists, seen.seen, strict=True))
    losses = run.metrics()["loss"].sel(step=slice(SPIKE - 3, SPIKE)).values
    assert losses[-1] < 2 * max(losses[:-1])  # step k back to the clean level
    assert losses[-1] < old_losses[SPIKE - 1] / 10
    # the old timeline is intact
    assert _indices(run, old) == old_batches
    assert (run.metrics(old)["loss"].values == old_losses).all()
    assert run.commits(old)[-1].step == TRAVEL_STEPS


def test_a_skip_set_the_loader_cannot_honour_raises(tmp_path: Path) -> None:
    """A loader that does not fetch by sample index (here a custom iterable) records a hash
    of each batch; resuming a timeline that skips samples, or whole batches, raises."""
    path = tmp_path / "run"
    make_trainer([DsttCallback(run=path)], steps=3).fit(model(), ResumableLoader(loader()))
    run = dstt.open(path)
    batches = run.batches()
    assert sorted(batches) == [1, 2, 3]
    assert all(b.indices is None and b.hash for v in batches.values() for b in v)
    old = run.timeline
    for i, kwargs in enumerate([{"skip_samples": [5]}, {"skip_data": 1}]):
        run.rollback(2, timeline=old, name=f"skip-{i}", **kwargs)  # type: ignore[arg-type]
        cb = DsttCallback(run=path, resume=True)
        with pytest.raises(ConfigError, match="skip"):
            make_trainer([cb], steps=5).fit(model(), ResumableLoader(loader()))
        assert cb.session is None
        run = dstt.open(path)
        assert run.commits()[-1].step == 2  # nothing trained on the new timeline
    assert [h.step for h in run.commits(old)] == [1, 2, 3]


def test_replay_of_manual_optimization_raises(tmp_path: Path) -> None:
    path = tmp_path / "run"
    make_trainer([DsttCallback(run=path)], steps=2).fit(model(manual=True), loader())
    with pytest.raises(ReplayError, match="manual optimization"):
        dstt.open(path).replay(2, trainer=make_trainer([], steps=2), module=model(manual=True))
