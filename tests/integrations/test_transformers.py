"""``DsttCallback`` in a real ``transformers.Trainer`` (tiny GPT-2 from a config, CPU).

Proves: every optimizer step is committed with the Trainer's logged values; the last step
equals the model; gradient accumulation commits once per optimizer step; a run stopped and
resumed through ``trainer.train(resume_from_checkpoint=cb.resume_from())`` continues at the
right step with the same losses and bit-exact model and optimizer state (mid-epoch: the
Trainer skips the consumed batches; at an epoch boundary); a SIGKILLed run resumes the same
way in a fresh process.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from children import kill_then_resume
from hf_setup import Recorder, state_hash, tiny_gpt2, trainer
from transformers import TrainerCallback

from dstt.errors import ConfigError, TimelineError
from dstt.integrations.transformers import DsttCallback
from dstt.store import Repository

HERE = Path(__file__).parent
STEPS = 10  # 24 samples / batch 4: 6 optimizer steps per epoch, so 10 steps cross one


pytestmark = pytest.mark.usefixtures("one_thread")


def _heads(run: Path) -> list:
    return Repository.open(run).reader().lineage()


def _train(
    run: Path | None,
    tmp: Path,
    *,
    steps: int = STEPS,
    stop_at: int | None = None,
    resume: bool = False,
    **kw: object,
) -> tuple[Recorder, object, DsttCallback | None]:
    model = tiny_gpt2()
    rec = Recorder(stop_at=stop_at)
    cb = DsttCallback(run=run, resume=resume) if run is not None else None
    tr = trainer(model, str(tmp / "out"), [rec] + ([cb] if cb else []), max_steps=steps, **kw)
    tr.train(resume_from_checkpoint=cb.resume_from() if resume and cb else None)
    return rec, tr, cb


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], str]:
    """An uninterrupted run without dstt: losses per step and the final state's hash."""
    torch.set_num_threads(1)
    rec, tr, _ = _train(None, tmp_path_factory.mktemp("ref"))
    return rec.losses, state_hash(tr.model, tr.optimizer.optimizer)


def test_every_step_is_committed_with_its_logged_values(tmp_path: Path, reference) -> None:
    run = tmp_path / "run"
    rec, tr, _ = _train(run, tmp_path)
    heads = _heads(run)
    assert [h.step for h in heads] == list(range(1, STEPS + 1))
    assert {h.step: h.metrics["loss"] for h in heads} == rec.losses == reference[0]
    for h in heads:  # the Trainer's own values, under the step they belong to
        assert {"learning_rate", "grad_norm", "epoch"} <= set(h.metrics)
    # the rate each update used (2 warmup steps, then linear decay), as the Trainer logs it
    assert [h.metrics["learning_rate"] for h in heads[:4]] == pytest.approx(
        [0.0, 1.5e-3, 3e-3, 3e-3 * 7 / 8]
    )
    assert state_hash(tr.model, tr.optimizer.optimizer) == reference[1]  # capture perturbs nothing
    reader = Repository.open(run).reader()
    head = reader.head()
    for name, p in tr.model.named_parameters():  # the last step is the model
        stored = reader.read_array(head, "params/" + name.replace(".", "/"))
        np.testing.assert_array_equal(stored, p.detach().numpy())


def test_gradient_accumulation_commits_once_per_optimizer_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rec, tr, _ = _train(run, tmp_path, steps=4, accum=3, batch=2)
    heads = _heads(run)
    assert [h.step for h in heads] == [1, 2, 3, 4] == sorted(rec.losses)
    assert tr.state.global_step == 4
    assert {h.step: h.metrics["loss"] for h in heads} == rec.losses
    opt = tr.optimizer.optimizer
    assert all(int(st["step"]) == 4 for st in opt.state.values())  # 4 updates, 12 batches


@pytest.mark.parametrize("stop", [4, 6], ids=["mid-epoch", "epoch-end"])
def test_stop_and_resume_matches_an_uninterrupted_run(tmp_path: Path, reference, stop: int) -> None:
    ref_losses, ref_final = reference
    run = tmp_path / "run"
    first, _, _ = _train(run, tmp_path, stop_at=stop)
    assert _heads(run)[-1].step == stop
    second, tr, cb = _train(run, tmp_path, resume=True)
    assert second.start == stop
    assert sorted(second.losses) == list(range(stop + 1, STEPS + 1))
    assert {**first.losses, **second.losses} == ref_losses  # bit-exact, loss by loss
    assert state_hash(tr.model, tr.optimizer.optimizer) == ref_final
    assert [h.step for h in _heads(run)] == list(range(1, STEPS + 1))
    assert cb is not None
    assert cb._pad is None  # the resume directory is gone


def test_resume_without_the_trainer_resuming_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _train(run, tmp_path, steps=2)
    model = tiny_gpt2()
    cb = DsttCallback(run=run, resume=True)
    tr = trainer(model, str(tmp_path / "out"), [cb], max_steps=4)
    with pytest.raises(ConfigError, match=r"resume_from_checkpoint=cb\.resume_from"):
        tr.train()
    assert cb.session is None  # closed, the run's lock released
    with pytest.raises(TimelineError, match="resume=True"):  # and no silent overwrite
        _train(run, tmp_path, steps=2)


class _Boom(Exception):
    pass


class _RaiseAt(TrainerCallback):  # type: ignore[misc]
    def __init__(self, step: int, where: str) -> None:
        self.step, self.where = step, where

    def on_step_begin(self, args: object, state: object, control: object, **kw: object) -> None:
        if self.where == "forward" and state.global_step == self.step:  # type: ignore[attr-defined]
            raise _Boom  # in the next iteration: step `step` had finished

    def on_optimizer_step(self, args: object, state: object, control: object, **kw: object) -> None:
        if self.where == "update" and state.global_step + 1 == self.step:  # type: ignore[attr-defined]
            raise _Boom  # after the optimizer step, before the scheduler stepped


@pytest.mark.parametrize(("where", "head"), [("forward", 3), ("update", 2)])
def test_an_exception_commits_only_finished_steps(tmp_path: Path, where: str, head: int) -> None:
    run = tmp_path / "run"
    cb = DsttCallback(run=run)
    tr = trainer(tiny_gpt2(), str(tmp_path / "out"), [_RaiseAt(3, where), cb], max_steps=6)
    try:
        with pytest.raises(_Boom):
            tr.train()
        assert cb.session is not None  # the Trainer has no exception hook
    finally:
        cb.close()
    assert cb.session is None
    assert [h.step for h in _heads(run)] == list(range(1, head + 1))
    cb2 = DsttCallback(run=run, resume=True)  # the run is released and resumes
    second = trainer(tiny_gpt2(), str(tmp_path / "out"), [cb2], max_steps=6)
    second.train(resume_from_checkpoint=cb2.resume_from())
    assert [h.step for h in _heads(run)] == list(range(1, 7))


def test_resume_from_on_a_new_run_starts_fresh(tmp_path: Path) -> None:
    cb = DsttCallback(run=tmp_path / "new", resume=True)
    with pytest.raises(ConfigError, match="callbacks"):
        cb.resume_from()
    trainer(tiny_gpt2(), str(tmp_path / "out"), [cb], max_steps=1)
    assert cb.resume_from() is None
    with pytest.raises(ConfigError, match="resume=True"):
        DsttCallback(run=tmp_path / "x").resume_from()


def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path: Path, reference) -> None:
    ref_losses, ref_final = reference
    args = [str(tmp_path / "out"), str(STEPS)]
    final = kill_then_resume("hf_child.py", tmp_path / "run", args, 8, ref_losses, STEPS)
    assert final == ref_final
