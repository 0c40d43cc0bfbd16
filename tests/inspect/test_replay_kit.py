"""The replay seam: a framework's step replayed through the :class:`ReplayKit` registered for
its trainer type, and a plain loop's gradient clipping through ``before_step=``.

The "framework" is a tiny trainer defined here (a small real fake, not a mock): it owns the
model, optimizer, scheduler and dataset, collates its own batches, divides the loss by its
gradient accumulation and clips the gradient norm between the last backward and the
optimizer step — the things a replay must do as the framework did to be bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import dstt
import dstt.inspect.replay_kit as replay_mod
from dstt.errors import ConfigError, ReplayError
from dstt.inspect.replay import ReplayKit, register_replay_kit, replay_kit_for
from dstt.testing.models import TinyGPT, make_batch

ACCUM, MICRO, STEPS, SEQ, VOCAB = 2, 4, 5, 8, 32
MAX_NORM = 0.05  # far below the gradient norms of this model: every step is clipped


class Sequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.x, self.y = make_batch(0, batch_size=n, seq=SEQ, vocab=VOCAB)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class LoopTrainer:
    """A plain-loop "trainer": ``fit(run)`` trains under ``dstt.session`` with data
    attribution; the clipped gradient norms it saw are kept in ``norms``."""

    def __init__(self, ds: Dataset[Any], seed: int = 0, clip: bool = True) -> None:
        torch.manual_seed(seed)
        self.model = TinyGPT(vocab=VOCAB, d=16, layers=1, heads=2, seq=SEQ, dropout=0.1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda k: min(1.0, (k + 1) / 3)
        )
        self.ds, self.clip = ds, clip
        self.norms: list[float] = []

    def collate(self, indices: Sequence[int]) -> Any:
        return default_collate([self.ds[i] for i in indices])

    def backward(self, batch: Any) -> torch.Tensor:
        x, y = batch
        loss = self.model(x, y)[1] / ACCUM
        loss.backward()
        return loss.detach()

    def clip_grads(self) -> None:
        if self.clip:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
            self.norms.append(float(norm))

    def sample_loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        loss: torch.Tensor = self.model(x, y)[1]
        return loss

    def fit(self, run: Path, steps: int = STEPS) -> None:
        torch.manual_seed(1)
        loader = DataLoader(  # batches as ``collate`` builds them from their indices
            self.ds, batch_size=MICRO, shuffle=True, generator=torch.Generator().manual_seed(5)
        )
        with dstt.session(self.model, self.optimizer, run=run, scheduler=self.scheduler) as s:
            micro = 0
            while s.step < steps:
                for batch in s.data(loader):
                    self.backward(batch)
                    micro += 1
                    if micro % ACCUM:
                        continue
                    self.clip_grads()
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    s.log(step_done=1.0)
                    if s.step == steps:
                        break


def loop_kit(trainer: object, module: object | None) -> ReplayKit:
    assert isinstance(trainer, LoopTrainer)
    return ReplayKit(
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        make_batch=trainer.collate,
        backward=trainer.backward,
        before_step=trainer.clip_grads,
        sample_loss=trainer.sample_loss,
    )


@pytest.fixture
def kits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The LoopTrainer kit registered for one test (the registry as it was afterwards)."""
    monkeypatch.setattr(replay_mod, "_KITS", list(replay_mod._KITS))
    register_replay_kit(lambda t: isinstance(t, LoopTrainer), loop_kit)


@pytest.fixture(scope="module")
def clipped(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Sequences, list[float]]:
    run = tmp_path_factory.mktemp("kit") / "run"
    ds = Sequences(24)
    t = LoopTrainer(ds)
    t.fit(run)
    return run, ds, t.norms


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return model(x, y)[1] / ACCUM


@pytest.mark.parametrize("step", [2, STEPS])
def test_a_trainer_replays_bit_exact_through_its_registered_kit(
    clipped: Any, kits: None, step: int
) -> None:
    run_path, ds, norms = clipped
    assert len(norms) == STEPS
    assert min(norms) > 10 * MAX_NORM  # the clipping changed every step
    run = dstt.open(run_path)
    t = LoopTrainer(ds, seed=77)  # other weights: the replay restores step - 1
    r = run.replay(step, trainer=t)
    assert r.faithful, (r.differs, r.max_abs_diff)
    assert r.differs == []
    assert len(r.losses) == ACCUM
    assert len(t.norms) == 1  # the kit's before_step ran once, after the last backward
    after = run.at(step).state_dict()["model"]
    for name, p in t.model.named_parameters():
        assert torch.equal(p.detach(), after[name]), name
    # the step's samples, each alone through the kit's make_batch and sample_loss
    recorded = sorted(i for b in run.batches([step])[step] for i in b.indices)
    assert sorted(int(i) for i in r.per_sample["index"].values) == recorded
    worst = r.worst(1)[0]
    t.model.eval()
    with torch.no_grad():
        run.at(step - 1).load_into(t.model)
        alone = float(t.sample_loss(t.collate([worst])))
    assert float(r.per_sample["loss"].values[0]) == alone


def test_before_step_makes_a_clipped_plain_loop_replay_bit_exact(clipped: Any) -> None:
    run_path, ds, _ = clipped
    run = dstt.open(run_path)
    t = LoopTrainer(ds, seed=3, clip=False)
    m = t.model

    def clip() -> None:
        torch.nn.utils.clip_grad_norm_(m.parameters(), MAX_NORM)

    plain = run.replay(3, m, t.optimizer, scheduler=t.scheduler, dataset=ds, loss_fn=loss_fn)
    assert not plain.faithful  # the loop clipped; a replay that does not is not the step
    assert any(p.startswith("params/") for p in plain.differs)
    assert plain.max_abs_diff > 0
    r = run.replay(
        3,
        m,
        t.optimizer,
        scheduler=t.scheduler,
        dataset=ds,
        loss_fn=loss_fn,
        before_step=clip,
    )
    assert r.faithful, (r.differs, r.max_abs_diff)
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in r._grads.values()]))
    assert float(total) == pytest.approx(MAX_NORM, rel=1e-3)  # the gradients as clipped


class UnknownTrainer:
    pass


def test_a_trainer_without_a_kit_is_refused_naming_its_type(clipped: Any, kits: None) -> None:
    run = dstt.open(clipped[0])
    with pytest.raises(ConfigError, match=r"test_replay_kit\.UnknownTrainer") as e:
        run.replay(2, trainer=UnknownTrainer())
    assert "register_replay_kit" in str(e.value)
    with pytest.raises(ConfigError, match="UnknownTrainer"):
        replay_kit_for(UnknownTrainer())


def test_a_known_frameworks_trainer_names_the_import_that_registers_its_kit() -> None:
    fake = type("Trainer", (), {"__module__": "transformers.trainer"})()
    with pytest.raises(ConfigError, match=r"import dstt\.integrations\.transformers"):
        replay_kit_for(fake)


def test_trainer_and_model_together_are_refused(clipped: Any, kits: None) -> None:
    run_path, ds, _ = clipped
    t = LoopTrainer(ds)
    with pytest.raises(ConfigError, match="not both"):
        dstt.open(run_path).replay(2, t.model, t.optimizer, trainer=t)
    with pytest.raises(ConfigError, match="model= and optimizer="):
        dstt.open(run_path).replay(2)
    with pytest.raises(ConfigError, match="module= goes with trainer="):
        dstt.open(run_path).replay(2, t.model, t.optimizer, module=t.model)


def _plain(run: Any, ds: Sequences, step: int, before_step: Any = None, **kw: Any) -> Any:
    t = LoopTrainer(ds, seed=5, clip=False)
    return run.replay(
        step,
        t.model,
        t.optimizer,
        scheduler=t.scheduler,
        loss_fn=loss_fn,
        before_step=None if before_step is None else before_step(t),
        **({"dataset": ds} | kw),
    )


def _clip(t: LoopTrainer) -> Any:
    return lambda: torch.nn.utils.clip_grad_norm_(t.model.parameters(), MAX_NORM)


def test_a_replay_that_missed_the_clipping_says_which_tensors_differ_and_why(
    clipped: Any,
) -> None:
    run_path, ds, _ = clipped
    r = _plain(dstt.open(run_path), ds, 3)
    m = r.mismatch
    assert m is not None
    assert [d.path for d in m.tensors] != []
    assert sorted(d.path for d in m.tensors) == r.differs
    diffs = [d.max_abs_diff for d in m.tensors]
    assert diffs == sorted(diffs, reverse=True)  # largest first
    assert diffs[0] == r.max_abs_diff > 0
    assert m.compared >= len(m.tensors)
    assert "clipped" in m.reason
    assert "before_step=" in m.reason
    text = r.explain()
    assert "NOT faithful" in text
    assert m.tensors[0].path in text
    assert "likely: gradients were clipped" in text
    assert "likely: gradients were clipped" in repr(r)
    assert m.tensors[0].path in repr(r)


def test_a_faithful_replay_explains_itself_in_one_line(clipped: Any) -> None:
    run_path, ds, _ = clipped
    r = _plain(dstt.open(run_path), ds, 3, before_step=_clip)
    assert r.mismatch is None
    assert r.explain() == "step 3: faithful: bit-exact against its commit"


def test_a_replay_with_another_learning_rate_is_told_so(clipped: Any) -> None:
    run_path, ds, _ = clipped

    def clip_then_double_lr(t: LoopTrainer) -> Any:
        def run() -> None:
            _clip(t)()
            for g in t.optimizer.param_groups:
                g["lr"] *= 2

        return run

    r = _plain(dstt.open(run_path), ds, 3, before_step=clip_then_double_lr)
    assert r.mismatch is not None
    assert all(p.startswith("params/") for p in r.differs)
    assert "learning rate" in r.mismatch.reason


def test_tiny_differences_point_to_nondeterministic_kernels(clipped: Any) -> None:
    run_path, ds, _ = clipped

    def clip_then_jitter(t: LoopTrainer) -> Any:
        def run() -> None:
            _clip(t)()
            g = torch.Generator().manual_seed(0)
            for p in t.model.parameters():
                if p.grad is not None:  # what a nondeterministic reduction leaves
                    p.grad.mul_(1 + 1e-6 * torch.randn(p.grad.shape, generator=g))

        return run

    r = _plain(dstt.open(run_path), ds, 3, before_step=clip_then_jitter)
    assert r.mismatch is not None
    assert r.max_abs_diff > 0
    assert "nondeterministic" in r.mismatch.reason


def test_other_data_is_named_as_the_likely_reason(clipped: Any) -> None:
    run_path, ds, _ = clipped
    run = dstt.open(run_path)
    step = 3
    other = [default_collate([ds[i] for i in range(2 * MICRO)])]  # one batch, not the two
    r = _plain(run, ds, step, before_step=_clip, batches=other)
    assert r.mismatch is not None
    assert "other data" in r.mismatch.reason
    assert list(r.per_sample["index"].values) == [-1] * 2 * MICRO  # not the step's batches
    assert sorted(r.per_sample["position"].values) == list(range(2 * MICRO))
    with pytest.raises(ReplayError, match="indices of step 3's samples are unknown"):
        r.worst(2)


def test_given_batches_that_are_the_steps_keep_their_dataset_indices(clipped: Any) -> None:
    run_path, ds, _ = clipped
    run = dstt.open(run_path)
    recorded = [list(b.indices) for b in run.batches([4])[4]]
    given = [default_collate([ds[i] for i in ix]) for ix in recorded]
    r = _plain(run, ds, 4, before_step=_clip, batches=given)
    assert r.faithful
    assert sorted(int(i) for i in r.per_sample["index"].values) == sorted(
        i for ix in recorded for i in ix
    )
    by_dataset = _plain(run, ds, 4, before_step=_clip)
    assert r.worst(3) == by_dataset.worst(3)
    assert all(i in {j for ix in recorded for j in ix} for i in r.worst(3))
