"""Issue 35, item 4, end to end: the reported run (100 steps of a still-falling loss that jumps
2.8x at step 70) has its spike found with the defaults by ``run.spikes()``, ``diagnose()`` and
``dstt log`` (whose ``--window``/``--z`` tune the rule), and ``dstt gc --spike-window`` and
``Retention(spike_window=...)`` — offline and in a live session — keep the spike's cause and
spike commits, so step 70 still replays bit for bit after gc; with sparser commits the window
reaches the commit before the spike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import dstt
from dstt.cli import EXIT_BAD_INPUT, EXIT_OK
from dstt.cli import main as cli_main

from ._helpers import MLP, mlp_batch

SPIKE = 70


def reported_loss() -> list[float]:
    """The loss the run logs at steps 1..100: falling (~4.9 -> 1.07 at 69), noisy, 3.01 at 70."""
    rng = np.random.default_rng(0)
    t = np.arange(1, 101, dtype=np.float64)
    loss = (0.9 + 4.0 * np.exp(-t / 22.0)) * np.exp(0.06 * rng.standard_normal(100))
    loss[68], loss[69] = 1.07, 3.01
    return [float(v) for v in loss]


def train(run: Path, retention: dstt.Retention | None = None) -> None:
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = mlp_batch(0)
    loss = reported_loss()
    with dstt.session(model, opt, run=run, copy="sync", retention=retention) as s:
        for _ in range(100):
            _, out = model(x, y)
            out.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            s.log(step=s.step, loss=loss[s.step - 1])


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("reported") / "run"
    train(run)
    return run


@pytest.fixture
def run(made: Path, tmp_path: Path) -> Path:
    """A fresh copy of the reported run (gc changes it)."""
    return Path(shutil.copytree(made, tmp_path / "run"))


def test_the_spike_is_found_with_the_defaults(run: Path) -> None:
    r = dstt.open(run)
    (sp,) = r.spikes()
    assert (sp.step, sp.start, sp.cause, sp.parent) == (SPIKE, SPIKE, SPIKE - 1, SPIKE - 2)
    assert sp.value == pytest.approx(3.01)
    assert [s.step for s in r.diagnose().spikes] == [SPIKE]


def test_dstt_log_window_and_z(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def marked(*extra: str) -> list[int]:
        assert cli_main(["log", str(run), "--json", *extra]) == EXIT_OK
        return [d["step"] for d in json.loads(capsys.readouterr().out) if d["spike"]]

    assert marked() == [SPIKE]
    assert marked("--z", "1000") == []  # the threshold reaches the rule
    assert marked("--window", "20", "--z", "5") == [SPIKE]
    assert cli_main(["log", str(run), "--window", "1"]) == EXIT_BAD_INPUT
    assert "spike window >= 2" in capsys.readouterr().err
    assert cli_main(["log", str(run), "--z", "-1"]) == EXIT_BAD_INPUT
    assert "number > 0" in capsys.readouterr().err


def replays_faithfully(run: Path) -> bool:
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    (sp,) = dstt.open(run).spikes()
    rep = dstt.open(run).replay(
        sp, model, opt, batches=[mlp_batch(0)], loss_fn=lambda m, b: m(*b)[1]
    )
    return bool(rep.faithful)


def test_dstt_gc_keeps_the_cause_and_the_spike(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["gc", str(run), "--keep-last", "5", "--spike-window", "5", "--json"]
    assert cli_main(argv) == EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert out["spike_windows"] == [{"timeline": "main", "first": 65, "last": 75}]
    r = dstt.open(run)
    assert r.steps == [*range(65, 76), *range(96, 101)]
    assert r.repo.verify().ok
    assert replays_faithfully(run)  # the cause (69) and the spike (70) both survived


def test_retention_keeps_the_cause_and_the_spike(run: Path) -> None:
    rep = dstt.open(run).gc(retention=dstt.Retention(keep_last=5, spike_window=1))
    assert rep.spike_windows == (("main", 69, 71),)
    assert dstt.open(run).steps == [69, 70, 71, *range(96, 101)]
    assert replays_faithfully(run)


def test_sparse_commits_keep_the_commit_before_the_spike(run: Path) -> None:
    dstt.open(run).gc(retention=dstt.Retention(keep_every=5))  # commits 5, 10, ..., 100 left
    rep = dstt.open(run).gc(retention=dstt.Retention(keep_every=10, spike_window=1))
    assert rep.spike_windows == (("main", 65, 71),)  # widened from 69 to the live 65
    steps = dstt.open(run).steps
    assert {65, 70} <= set(steps)
    assert 75 not in steps  # outside the window: pruned
    (sp,) = dstt.open(run).spikes()  # the metrics of pruned steps still find it
    assert (sp.step, sp.parent, sp.cause) == (SPIKE, 65, SPIKE)


def test_a_session_retention_keeps_the_spike_neighbourhood(tmp_path: Path) -> None:
    pol = dstt.Retention(keep_last=15, spike_window=5, every_commits=10)
    train(tmp_path / "run", retention=pol)
    steps = dstt.open(tmp_path / "run").steps
    assert set(range(65, 76)) <= set(steps)
    assert {30, 64, 80}.isdisjoint(steps)  # the policy did prune, around the window too
    assert replays_faithfully(tmp_path / "run")
