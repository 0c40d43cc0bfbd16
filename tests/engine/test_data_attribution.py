"""Data attribution: ``s.data`` records each step's samples, a spike is traced to them, and a
rollback that skips exactly them continues without the spike (dstt.training.data)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import dstt
from dstt.cli import main
from dstt.errors import ConfigError, StepNotFoundError

N, BS, BAD_STEP = 160, 8, 12  # one epoch: 20 steps; the batch of step 12 is poisoned


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """y = x @ W, with the labels of ``bad`` samples scaled x30; counts fetches."""

    def __init__(self, bad: Iterable[int] = ()) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N, 8, generator=g)
        self.y = self.x @ torch.randn(8, 4, generator=g)
        for i in bad:
            self.y[i] *= 30.0
        self.fetched: list[int] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched.append(int(i))
        return self.x[i], self.y[i]


def order(cls: type = DataLoader) -> list[list[int]]:
    """The sample indices of the batches :func:`loader` draws in its first epoch."""
    return [b.tolist() for b in loader(range(N), cls)]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(8, 16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def train(
    run: Path, loader: Any, *, resume: bool = False, steps: int | None = None, every: int = 1
) -> list[float]:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    losses = []
    with dstt.session(model, opt, run=run, resume=resume, every=every) as s:
        for x, y in s.data(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.log(loss=loss.item())
            losses.append(loss.item())
            if steps is not None and s.step >= steps:
                break
    return losses


def loader(ds: Any, cls: type = DataLoader) -> Any:
    return cls(ds, batch_size=BS, shuffle=True, generator=torch.Generator().manual_seed(3))


BAD = order()[BAD_STEP - 1]


def test_a_spike_is_traced_to_the_poisoned_samples_and_skipping_them_removes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    train(run_dir, loader(Regression(BAD)))
    run = dstt.open(run_dir)
    # every step's batch is recorded as its sample indices
    assert [b.samples for k in sorted(run.batches()) for b in run.batches()[k]] == order()
    assert [b.samples for b in run.at(BAD_STEP).batch()] == [BAD]
    (sp,) = run.spikes(window=8, z=4.0)
    assert sp.start == BAD_STEP
    assert sp.cause == BAD_STEP - 1
    # the update into the cause was ordinary: the jump comes from the batch itself
    assert sp.suspect == "data"
    assert sp.samples == sorted(BAD)
    assert sp.rollback_to == BAD_STEP - 1
    assert "suspect: data (samples [" in str(sp)
    # dstt log --batches shows each step's samples
    assert main(["log", str(run_dir), "--batches", "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[BAD_STEP]["batches"] == [{"indices": BAD}]
    assert main(["log", str(run_dir), "--batches", "-n", "20"]) == 0
    assert f"samples [{', '.join(map(str, BAD[:8]))}]" in capsys.readouterr().out

    name = run.rollback(sp.rollback_to, skip_samples=sp.samples)
    assert run.skips().samples == frozenset(BAD)
    ds = Regression(BAD)
    train(run_dir, loader(ds), resume=True)
    assert not set(ds.fetched) & set(BAD)  # no poisoned sample was ever loaded again
    run.refresh()
    assert run.timeline == name
    assert run.steps[-1] == N // BS - 1  # one batch fewer
    assert run.spikes(window=8, z=4.0) == []
    # the continued timeline trained on the original's next batches, the bad one left out
    new = run.batches(slice(BAD_STEP, None))
    assert [b.samples for k in sorted(new) for b in new[k]] == order()[BAD_STEP:]
    loss = run.metrics()["loss"]
    assert float(loss.sel(step=BAD_STEP)) < 3 * float(loss.sel(step=BAD_STEP - 1))


def test_stateful_loader_resumes_from_its_state_not_by_rereading(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(run_dir, loader(Regression(), StatefulDataLoader), steps=6)
    run = dstt.open(run_dir)
    assert "loader" in run.at(6).object("data")
    ds = Regression()
    train(run_dir, loader(ds, StatefulDataLoader), resume=True, steps=9)
    # only the three new batches were loaded (a re-reading resume fetches 6 more first) ...
    assert ds.fetched == [i for b in order(StatefulDataLoader)[6:9] for i in b]
    run.refresh()
    # ... and they are the ones the uninterrupted epoch draws next
    assert [run.batches()[k][0].samples for k in range(1, 10)] == order(StatefulDataLoader)[:9]


def test_stateful_loader_with_skipped_samples(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    bad = order(StatefulDataLoader)[BAD_STEP - 1]
    train(run_dir, loader(Regression(bad), StatefulDataLoader))
    run = dstt.open(run_dir)
    (sp,) = run.spikes(window=8, z=4.0)
    assert sp.samples == sorted(bad)
    run.rollback(sp.rollback_to, skip_samples=sp.samples[:5])  # part of the batch
    ds = Regression(bad)
    train(run_dir, loader(ds, StatefulDataLoader), resume=True, steps=BAD_STEP)
    kept = [i for i in bad if i not in sorted(bad)[:5]]
    assert ds.fetched == kept  # restored from the loader's state, then the rest of the batch
    run.refresh()
    assert run.at(BAD_STEP).batch()[0].samples == kept


def test_hashed_batches_skip_exactly_the_named_batch(tmp_path: Path) -> None:
    # a plain list of tensors exposes no indices: batches are fingerprinted by a hash
    ds = Regression(BAD)
    batches = [(ds.x[b], ds.y[b]) for b in order()]
    run_dir = tmp_path / "run"
    train(run_dir, batches)
    run = dstt.open(run_dir)
    fps = run.batches()
    assert all(b.indices is None and len(str(b.hash)) == 32 for v in fps.values() for b in v)
    assert len({v[0].hash for v in fps.values()}) == len(batches)  # distinct per batch
    (sp,) = run.spikes(window=8, z=4.0)
    assert sp.samples == []
    assert sp.batches[BAD_STEP] == fps[BAD_STEP]
    with pytest.raises(StepNotFoundError, match="no batch was recorded"):
        run.rollback(sp.rollback_to, skip_batches=[999])
    with pytest.raises(ConfigError, match="skip_batches"):
        run.rollback(sp.rollback_to, skip_samples=[1], name="t")
        train(run_dir, batches, resume=True)
    run.switch("main")
    run.rollback(sp.rollback_to, skip_batches=[BAD_STEP], name="clean")
    train(run_dir, batches, resume=True)
    run.refresh()
    assert run.timeline == "clean"
    assert run.spikes(window=8, z=4.0) == []
    assert run.steps[-1] == len(batches) - 1
    assert run.at(BAD_STEP).batch() == fps[BAD_STEP + 1]


def test_fingerprints_of_steps_every_skipped_ride_with_the_next_commit(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(run_dir, loader(Regression()), every=4, steps=10)
    run = dstt.open(run_dir)
    assert run.steps == [4, 8, 10]
    assert [run.batches()[k][0].samples for k in range(1, 11)] == order()[:10]
    assert run.batches([5, 6]) == {k: run.batches()[k] for k in (5, 6)}
