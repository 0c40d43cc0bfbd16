"""xarray conventions: ``step`` a unique ascending index along a timeline (``.sel`` works after
a rollback), ``slot``/``timeline``/``time`` plain coordinates along it, ``time`` datetime64."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from inspect_helpers import new_repo, small_model, write_steps

import dstt
from dstt.run import open_run
from dstt.run.metrics import Metrics
from dstt.store._internal import RowSet


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.fc = torch.nn.Linear(4, 3)
        self.ln = torch.nn.LayerNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc(self.emb(x))).pow(2).mean()


def _train(
    model: Tiny, opt: torch.optim.Optimizer, run: Path, n: int, *, resume: bool = False
) -> None:
    with dstt.session(model, opt, run=run, every=2, resume=resume) as s:
        for _ in range(n):
            loss = model(torch.arange(5))
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.log(loss=loss.item())


def test_step_is_a_unique_index_along_a_rolled_back_timeline(tmp_path: Path) -> None:
    torch.manual_seed(0)
    path = tmp_path / "run"
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, path, 6)  # commits 2 4 6, steps 1 3 5 ride along as history
    branch = open_run(path).rollback(to=4)
    _train(model, opt, path, 4, resume=True)  # steps 5..8 on the branch: commits 6 8
    run = open_run(path)
    assert run.steps == [2, 4, 6, 8]
    assert run.timeline == branch

    m = run.metrics()
    assert m["step"].values.tolist() == list(range(1, 9))
    assert m.indexes["step"].is_unique
    assert m.indexes["step"].is_monotonic_increasing
    assert m["timeline"].values.tolist() == ["main"] * 4 + [branch] * 4
    assert set(m.coords) == {"step", "slot", "timeline", "time", "pruned"}  # pruned: gc (#14)
    assert m.xindexes.keys() == {"step"}
    assert str(m["timeline"].sel(step=3).values) == "main"
    assert str(m["timeline"].sel(step=5).values) == branch
    assert int(m["slot"].sel(step=5)) == -1  # not committed: carried by the branch's step 6
    assert int(m["slot"].sel(step=6)) == run.at(6).slot

    s = run.summaries()
    assert s["step"].values.tolist() == [2, 4, 6, 8]
    assert s["timeline"].values.tolist() == ["main", "main", branch, branch]
    assert float(s["l2"].sel(step=6, tensor="fc.weight")) > 0

    traj = run.trajectory("fc.weight")
    assert traj["timeline"].values.tolist() == ["main", "main", branch, branch]
    np.testing.assert_array_equal(traj.sel(step=6).values, run.at(6).to_numpy("fc.weight"))
    # steps asked for out of order and twice: still one ascending index
    picked = run.trajectory("fc.weight", steps=[8, 2, 2])
    assert picked["step"].values.tolist() == [2, 8]
    assert run.summaries(steps=[8, 4, 8])["step"].values.tolist() == [4, 8]


def test_time_is_datetime64_utc(tmp_path: Path) -> None:
    path = tmp_path / "run"
    write_steps(new_repo(path), [1, 2, 3], small_model)
    run = open_run(path)
    headers = run.commits()
    m = run.metrics()
    assert m["time"].dtype == np.dtype("datetime64[ns]")
    secs = (m["time"].values - np.datetime64(0, "ns")) / np.timedelta64(1, "s")
    np.testing.assert_allclose(secs, [h.time for h in headers], atol=1e-6)  # epoch = UTC
    assert run.trajectory("layers.1.mlp.weight")["time"].dtype == np.dtype("datetime64[ns]")


def test_a_step_met_twice_along_the_lineage_keeps_the_newer_row() -> None:
    history = {
        "steps": [3, 4],
        "time": [1.7e9 + 3, 1.7e9 + 4.5],
        "metrics": [{"loss": 3.0}, {"loss": 40.0}],
    }
    rows = RowSet(  # the index's rows of commits 4 and 5; 5 carries steps 3 and 4 again
        slot=np.array([0, 1]),
        step=np.array([4, 5]),
        parent=np.array([-1, 0]),
        timeline=np.array([0, 0]),
        pruned=np.zeros(2, bool),
        time=np.array([1.7e9 + 4, 1.7e9 + 5]),
        timelines=["main"],
        headers=[b"", b""],
        m_names=["loss"],
        m_num=np.array([[4.0], [5.0]]),
        m_text=[None, None],
        m_hist=[None, history],
    )
    m = Metrics(rows)
    assert m["step"].values.tolist() == [3, 4, 5]
    assert float(m["loss"].sel(step=4)) == 40.0
    assert int(m["slot"].sel(step=4)) == -1
