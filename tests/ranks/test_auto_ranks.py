"""``every="auto"`` with two real DDP ranks (spawned, gloo): every rank stores the same steps
(each optimizer step's decision is agreed across ranks), the run's steps are each stored or
light, and a light step of a run of several ranks refuses a one-process rebuild with a typed
error rather than a wrong state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dstt
from dstt.errors import ReplayError

from .conftest import launch, logs_of, wait

WORKER = Path(__file__).with_name("auto_worker.py")


def test_ddp_ranks_agree_which_steps_are_stored(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    for attempt in range(3):  # a fast machine may keep up now and then
        run_dir = tmp_path / f"run{attempt}"
        wait(launch(WORKER, [str(run_dir), str(tmp_path)], 2, tmp_path, "auto"))
        got = []
        for rank in (0, 1):
            f = tmp_path / f"auto.r{rank}.json"
            assert f.exists(), logs_of(tmp_path, "auto")
            got.append(json.loads(f.read_text())["stored"])
            f.unlink()
        assert got[0] == got[1]  # the same steps on both ranks
        run = dstt.open(run_dir)
        if run.light_steps():
            break
    assert run.light_steps(), "rank 1's slowed storage never made the engines busy"
    assert run.steps == got[0]
    assert sorted([*run.steps, *run.light_steps()]) == list(range(1, 17))
    assert all(bits is not None for bits in run.light_steps().values())
    k = min(run.light_steps())
    net = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    with pytest.raises(ReplayError, match=r"several ranks.*not supported yet"):
        run.rebuild(k, net, opt, batches=lambda ix: None)
