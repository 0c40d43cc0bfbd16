"""``DsttCallback`` in a real ``lightning.Trainer`` (a tiny GPT, CPU, synthetic data).

Proves: every optimizer step is committed with its ``self.log`` values; the last step equals
the module; gradient accumulation commits once per optimizer step; ``resume=True`` continues
Lightning's global step with bit-exact model and optimizer state — with the loss sequence of an
uninterrupted run at an epoch boundary and mid-epoch, with a stateful loader (what
Lightning's own checkpoints need) or a plain one; a SIGKILLed run resumes the same way in a new
process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("lightning")

from children import kill_then_resume
from pl_setup import (
    Recorder,
    ResumableLoader,
    loader,
    make_trainer,
    model,
    state_hash,
)

from dstt.errors import ConfigError
from dstt.integrations.lightning import DsttCallback
from dstt.store import Repository

HERE = Path(__file__).parent
STEPS = 10  # 6 batches per epoch


pytestmark = pytest.mark.usefixtures("one_thread")


def _fit(
    run: Path | None,
    *,
    steps: int = STEPS,
    stop_at: int | None = None,
    resume: bool = False,
    stateful: bool = False,
    accum: int = 1,
    hashes: bool = False,
) -> tuple[Recorder, object, object]:
    m = model()
    rec = Recorder(stop_at=stop_at, hashes=hashes)
    cbs = [rec] + ([DsttCallback(run=run, resume=resume)] if run is not None else [])
    tr = make_trainer(cbs, steps=steps, accum=accum)
    tr.fit(m, ResumableLoader(loader()) if stateful else loader())
    return rec, tr, m


@pytest.fixture(scope="module")
def reference() -> tuple[dict[int, float], dict[int, str], str]:
    torch.set_num_threads(1)
    rec, tr, m = _fit(None, hashes=True)
    assert rec.hashes is not None
    return rec.losses, rec.hashes, state_hash(m, tr.optimizers[0])


def _heads(run: Path) -> list:
    return Repository.open(run).reader().lineage()


def test_every_step_is_committed_with_its_logged_values(tmp_path: Path, reference) -> None:
    run = tmp_path / "run"
    rec, tr, m = _fit(run)
    heads = _heads(run)
    assert [h.step for h in heads] == list(range(1, STEPS + 1))
    assert {h.step: h.metrics["train_loss"] for h in heads} == rec.losses == reference[0]
    assert state_hash(m, tr.optimizers[0]) == reference[2]
    reader = Repository.open(run).reader()
    head = reader.head()
    for name, p in m.named_parameters():
        stored = reader.read_array(head, "params/" + name.replace(".", "/"))
        np.testing.assert_array_equal(stored, p.detach().numpy())


def test_gradient_accumulation_commits_once_per_optimizer_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _, tr, _ = _fit(run, steps=3, accum=2)
    assert [h.step for h in _heads(run)] == [1, 2, 3]
    assert tr.global_step == 3
    assert all(int(st["step"]) == 3 for st in tr.optimizers[0].state.values())


def test_manual_optimization_commits_each_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    m = model(manual=True)
    rec = Recorder()
    make_trainer([rec, DsttCallback(run=run)], steps=3).fit(m, loader())
    heads = _heads(run)
    assert [h.step for h in heads] == [1, 2, 3]
    assert {h.step: h.metrics["train_loss"] for h in heads} == rec.losses


@pytest.mark.parametrize(
    ("stop", "stateful"),
    [(6, False), (6, True), (4, True)],
    ids=["epoch-end", "epoch-end-stateful-loader", "mid-epoch-stateful-loader"],
)
def test_stop_and_resume_matches_an_uninterrupted_run(
    tmp_path: Path, reference, stop: int, stateful: bool
) -> None:
    ref_losses, _, ref_final = reference
    run = tmp_path / "run"
    first, _, _ = _fit(run, stop_at=stop, stateful=stateful)
    assert _heads(run)[-1].step == stop
    second, tr, m = _fit(run, resume=True, stateful=stateful)
    assert second.start == stop
    assert sorted(second.losses) == list(range(stop + 1, STEPS + 1))
    assert {**first.losses, **second.losses} == ref_losses
    assert state_hash(m, tr.optimizers[0]) == ref_final
    assert [h.step for h in _heads(run)] == list(range(1, STEPS + 1))


def test_mid_epoch_with_a_plain_loader_resumes_on_the_next_batch(tmp_path: Path, reference) -> None:
    """Where Lightning's own checkpoint would restart the epoch (and warn), the callback
    draws the consumed batches' index lists unfetched: the next batch is the right one."""
    ref_losses, ref_hashes, _ = reference
    run = tmp_path / "run"
    _fit(run, stop_at=4)
    second, _, _ = _fit(run, resume=True, steps=6, hashes=True)
    assert second.start == 4
    assert second.hashes is not None
    assert second.hashes[4] == ref_hashes[4]  # restored bit-exactly before training resumes
    assert second.losses == {k: ref_losses[k] for k in (5, 6)}


def test_resume_and_ckpt_path_together_are_refused(tmp_path: Path) -> None:
    _, tr, _ = _fit(None, steps=1)
    ckpt = str(tmp_path / "x.ckpt")
    tr.save_checkpoint(ckpt)  # a real Lightning checkpoint
    cb = DsttCallback(run=tmp_path / "run", resume=True)
    with pytest.raises(ConfigError, match="ckpt_path"):
        make_trainer([cb], steps=2).fit(model(), loader(), ckpt_path=ckpt)
    assert cb.session is None
    assert not (tmp_path / "run").exists()


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path: Path, reference) -> None:
    ref_losses, _, ref_final = reference
    args = [str(STEPS)]
    final = kill_then_resume("pl_child.py", tmp_path / "run", args, 8, ref_losses, STEPS)
    assert final == ref_final
