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

STEPS, K = 32, 28  # 256 samples, 8 per optimizer step: one epoch; K mid-epoch, late enough
# for a spike rule to have a baseline (the loss falls fast at first)


pytestmark = pytest.mark.usefixtures("one_thread")


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
    fresh = Trainer(  # built the same way, never trained: optimizer and scheduler as train()'s
        model=tiny_gpt2(seed=1),
        args=default_args(str(story["tmp"] / "out"), max_steps=STEPS),
        train_dataset=story["data"],
    )
    again = run.replay(K, trainer=fresh)
    assert again.faithful, again.max_abs_diff
    assert again.losses == replay.losses


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


# -- the same under DDP: 2 gloo ranks (torchrun's environment) ---------------------------------
def _ranks(mode: str, run: Path, out: Path, steps: int, corrupt: list[int]) -> list[dict[str, Any]]:
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    here = Path(__file__).resolve().parent
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "DSTT_TEST_HANG_S": "240",
            "PYTHONPATH": os.pathsep.join([str(here.parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [sys.executable, str(here / "hf_ddp_child.py"), mode, str(run), str(out), str(steps)]
        with open(out / f"{mode}.r{rank}.log", "wb") as log:  # the child keeps its fd
            procs.append(
                subprocess.Popen(
                    [*cmd, ",".join(map(str, corrupt))], env=env, stdout=log, stderr=log
                )
            )
    for p in procs:
        p.wait(300)
    got = []
    for rank in range(2):
        f = out / f"{mode}.r{rank}.json"
        log = (out / f"{mode}.r{rank}.log").read_text(errors="replace")[-3000:]
        assert f.exists(), log
        res = json.loads(f.read_text())
        assert res["ok"], f"rank {rank}: {res['error']}\n{res['trace']}"
        got.append(res)
    return got


@pytest.mark.slow
def test_under_ddp_every_rank_is_recorded_and_the_skip_set_honoured(tmp_path: Path) -> None:
    steps, k = 12, 9
    out = tmp_path / "out"
    out.mkdir()
    clean = _ranks("fresh", tmp_path / "clean", out, steps, [])
    assert clean[0]["world"] == 2
    batches = dstt.open(tmp_path / "clean").batches()
    assert sorted(batches) == list(range(1, steps + 1))
    assert all(len(batches[s]) == 4 for s in batches)  # 2 ranks x 2 micro-batches, every rank's
    seen = sorted(i for s in batches for b in batches[s] for i in b.samples)
    assert seen == list(range(steps * 16))  # one epoch over both ranks: every sample once
    mb = [b.samples for b in batches[k]]  # rank 0's two micro-batches, then rank 1's
    planted = sorted([mb[0][1], mb[1][3], mb[2][2], mb[3][0]])  # one of each micro-batch
    bad_out = tmp_path / "bad-out"
    bad_out.mkdir()
    bad = _ranks("fresh", tmp_path / "bad", bad_out, steps, planted)
    losses = {int(s): v for s, v in bad[0]["losses"].items()}
    clean_losses = {int(s): v for s, v in clean[0]["losses"].items()}
    assert losses[k] > 1.2 * clean_losses[k]
    run = dstt.open(tmp_path / "bad")
    assert run.batches() == batches  # the same sampler order, whatever the data
    one = Trainer(  # replay on one process: every rank's micro-batches of step k
        model=tiny_gpt2(),
        args=default_args(str(tmp_path / "one"), max_steps=steps),
        train_dataset=PatternData(steps * 16, corrupt=tuple(planted)),
    )
    replay = run.replay(k, trainer=one)
    assert len(replay.losses) == 4
    assert sorted(replay.worst(4)) == planted  # not bit-exact: each rank's dropout, all-reduce
    old = run.timeline
    run.rollback(k - 1, skip_samples=planted)
    again = _ranks("resume", tmp_path / "bad", bad_out, steps, planted)
    assert again[0]["start"] == again[1]["start"] == k - 1
    after = {int(s): v for s, v in again[0]["losses"].items()}
    assert sorted(after) == list(range(k, steps + 1))
    assert after[k] < 1.1 * clean_losses[k]  # back to the clean level
    run = dstt.open(tmp_path / "bad")
    for s in range(1, steps + 1):  # on every rank: the planted samples gone, the rest in place
        want = [[i for i in b.samples if i not in planted] for b in batches[s]]
        assert [b.samples for b in run.batches()[s]] == want, s
    assert run.batches(timeline=old) == batches  # the old timeline intact


def test_the_trainer_time_travel_block_in_the_docs_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/integrations.md's Trainer loop, run as written; each line it prints is True."""
    import contextlib
    import io
    import re

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    code = re.search(r"### Time travel through the Trainer.*?```python\n(.*?)```", text, re.S)
    assert code is not None
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.group(1), "docs/integrations.md", "exec"), {"__name__": "__doc__"})
    printed = [ln for ln in out.getvalue().splitlines() if not ln.startswith("{")]
    assert [ln.split()[0] for ln in printed] == ["True", "True", "True"], out.getvalue()[-2000:]
    assert printed[1] == "True True"
