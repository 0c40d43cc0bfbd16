"""The time-travel loop under a ``transformers.Trainer`` with its default arguments (clipping
at ``max_grad_norm=1.0``) and gradient accumulation 2, on a tiny GPT-2 (CPU).

A clean run gives step ``K``'s samples (the sampler's order); a second run has 3 of them
replaced by random tokens. Proves: the callback records each optimizer step's dataset
indices without changing a batch (the losses equal a run without dstt, bit for bit; a
resumed run records the same); ``run.spikes()`` finds ``K``; ``run.replay(K, trainer=...)``
is bit-exact and ranks the planted samples worst; rolling back to ``K - 1`` without them and
resuming through the Trainer's own resume brings step ``K``'s loss back to the clean level,
with every other sample in its place and the old timeline intact; a skip set the Trainer
cannot honour raises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from hf_setup import PatternData, PatternStream, Recorder, default_args, tiny_gpt2
from transformers import Trainer

import dstt
from dstt.errors import ConfigError
from dstt.integrations.transformers import DsttCallback

STEPS, K = 16, 12  # 128 samples, 8 per optimizer step: one epoch; K mid-epoch


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # bit-exact CPU math needs a fixed reduction order
    yield
    torch.set_num_threads(n)


def _train(
    run: Path | None,
    out: Path,
    data: Any,
    *,
    resume: bool = False,
    steps: int = STEPS,
    stop_at: int | None = None,
) -> tuple[Recorder, Trainer, DsttCallback | None]:
    rec = Recorder(stop_at=stop_at)
    cb = DsttCallback(run=run, resume=resume) if run is not None else None
    tr = Trainer(
        model=tiny_gpt2(),
        args=default_args(str(out), max_steps=steps),
        train_dataset=data,
        callbacks=[rec] + ([cb] if cb else []),
    )
    try:
        tr.train(resume_from_checkpoint=cb.resume_from() if resume and cb else None)
    finally:
        if cb is not None:
            cb.close()
    return rec, tr, cb


@pytest.fixture(scope="module")
def story(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A clean run, the planted samples of step K, and the corrupted run (with and without
    dstt)."""
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("hf-story")
    clean, _, _ = _train(tmp / "clean", tmp / "out", PatternData())
    step_k = dstt.open(tmp / "clean").batches([K])[K]
    a, b = step_k[0].samples, step_k[1].samples  # K's two micro-batches
    planted = sorted([a[0], a[2], b[1]])
    data = PatternData(corrupt=tuple(planted))
    plain, _, _ = _train(None, tmp / "out", data)
    bad, trainer, _ = _train(tmp / "bad", tmp / "out", data)
    return {
        "tmp": tmp,
        "clean": clean.losses,
        "clean_batches": dstt.open(tmp / "clean").batches(),
        "planted": planted,
        "data": data,
        "plain": plain.losses,
        "bad": bad.losses,
        "trainer": trainer,
        "run": tmp / "bad",
    }


def test_every_step_records_its_samples_without_changing_a_batch(story: dict[str, Any]) -> None:
    assert story["bad"] == story["plain"]  # with dstt == without, loss by loss, bit for bit
    assert story["bad"][K] > 1.5 * story["clean"][K]  # the planted samples hurt
    run = dstt.open(story["run"])
    batches = run.batches()
    assert sorted(batches) == list(range(1, STEPS + 1))
    seen = [i for k in sorted(batches) for b in batches[k] for i in b.samples]
    assert all(len(batches[k]) == 2 for k in batches)  # 2 micro-batches per optimizer step
    assert sorted(seen) == list(range(STEPS * 8))  # one epoch: every sample once
    assert batches == story["clean_batches"]  # the sampler's order, whatever the data


def test_a_resumed_run_records_the_same_batches(tmp_path: Path, story: dict[str, Any]) -> None:
    data = story["data"]
    first, _, _ = _train(tmp_path / "run", tmp_path / "out", data, stop_at=5)
    second, _, _ = _train(tmp_path / "run", tmp_path / "out", data, resume=True)
    assert {**first.losses, **second.losses} == story["plain"]
    assert dstt.open(tmp_path / "run").batches() == story["clean_batches"]


def test_the_default_spike_rule_finds_the_corrupted_step(story: dict[str, Any]) -> None:
    spikes = dstt.open(story["run"]).spikes()
    assert K in [sp.start for sp in spikes], (spikes, story["bad"])


def test_replay_is_faithful_and_ranks_the_planted_samples_worst(story: dict[str, Any]) -> None:
    run = dstt.open(story["run"])
    replay = run.replay(K, trainer=story["trainer"])
    assert replay.faithful, replay.max_abs_diff  # clipping, accumulation, loss scaling
    assert sorted(replay.worst(3)) == story["planted"]
    assert len(replay.losses) == 2


def test_rollback_without_the_planted_samples_then_resume(
    tmp_path: Path, story: dict[str, Any]
) -> None:
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(story["run"], run_dir)
    run = dstt.open(run_dir)
    old = run.timeline
    old_batches, old_steps = run.batches(), run.steps
    name = run.rollback(K - 1, skip_samples=story["planted"])
    rec, _, _ = _train(run_dir, tmp_path / "out", story["data"], resume=True)
    assert rec.start == K - 1
    assert sorted(rec.losses) == list(range(K, STEPS + 1))
    assert rec.losses[K] < 1.5 * story["clean"][K] < story["bad"][K]  # back to the clean level
    run = dstt.open(run_dir)
    assert run.timeline == name
    new = run.batches()
    planted = set(story["planted"])
    for k in range(1, STEPS + 1):  # every other sample in its place, the planted ones gone
        want = [[i for i in b.samples if i not in planted] for b in old_batches[k]]
        assert [b.samples for b in new[k]] == want, k
    assert run.skips().samples == planted
    assert run.batches(timeline=old) == old_batches  # the old timeline is intact
    assert [h.step for h in run.commits(old)] == old_steps


def test_skips_the_trainer_cannot_honour_raise(tmp_path: Path, story: dict[str, Any]) -> None:
    data = story["data"]
    _train(tmp_path / "run", tmp_path / "out", data, steps=4)
    run = dstt.open(tmp_path / "run")
    run.rollback(2, skip_data=1)  # whole batches: the Trainer's resume counts them
    with pytest.raises(ConfigError, match="skip_samples"):
        _train(tmp_path / "run", tmp_path / "out", data, resume=True, steps=4)
    batch = run.batches([3], timeline="main")[3][0].samples
    run.rollback(2, skip_samples=batch, name="all-of-a-batch")  # nothing left of it
    with pytest.raises(ConfigError, match="every sample of a batch"):
        _train(tmp_path / "run", tmp_path / "out", data, resume=True, steps=4)
    run.switch("main")
    run.rollback(2, skip_samples=[batch[0]], name="stream")
    with pytest.raises(ConfigError, match="IterableDataset"):  # no sample indices to drop
        _train(tmp_path / "run", tmp_path / "out", PatternStream(), resume=True, steps=4)
    assert dstt.open(tmp_path / "run").steps == [1, 2]  # nothing trained on them
