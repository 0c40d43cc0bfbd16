"""Replay of a past step: bit-exact against its commit, its gradients equal those the
original step computed, the culprit sample of a batch ranked first, clear errors otherwise.

The run: TinyGPT (dropout: the RNG matters), AdamW, a warm-up LambdaLR, gradient accumulation
over two micro-batches, a shuffling DataLoader (with its own generator) over a map-style
dataset, through ``s.data(loader)`` so each step's sample indices are recorded. The training
loop keeps the gradients of one step, as an instrumented run would have stored them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import dstt
from dstt.errors import ReplayError
from dstt.testing.models import TinyGPT, make_batch

ACCUM, MICRO, STEPS, KEPT = 2, 4, 8, 6  # KEPT: the step whose gradients the loop keeps
SEQ, VOCAB = 16, 64


class Sequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Learnable arithmetic sequences; ``bad`` samples get random targets (a data bug)."""

    def __init__(self, n: int, bad: tuple[int, ...] = ()) -> None:
        x, y = make_batch(0, batch_size=n, seq=SEQ, vocab=VOCAB)
        g = torch.Generator().manual_seed(99)
        for i in bad:
            y[i] = torch.randint(0, VOCAB, (SEQ,), generator=g)
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def build(seed: int = 0) -> tuple[TinyGPT, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    m = TinyGPT(vocab=VOCAB, d=32, layers=2, heads=4, seq=SEQ, dropout=0.1)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))
    return m, opt, sched


def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return model(x, y)[1] / ACCUM  # what the loop back-propagates


def train(
    run: Path,
    ds: Dataset[Any],
    *,
    attribution: bool = True,
    steps: int = STEPS,
    micro_batch: int = MICRO,
    spike_at: int | None = None,
) -> dict[str, torch.Tensor]:
    """``steps`` optimizer steps; returns the gradients the optimizer saw at step KEPT. The
    loss is logged each step (x50 at ``spike_at``: a spike planted in the metric)."""
    torch.manual_seed(1)
    m, opt, sched = build()
    loader = DataLoader(
        ds, batch_size=micro_batch, shuffle=True, generator=torch.Generator().manual_seed(5)
    )
    kept: dict[str, torch.Tensor] = {}
    with dstt.session(m, opt, run=run, scheduler=sched) as s:
        micro = 0
        while s.step < steps:
            for batch in s.data(loader) if attribution else loader:
                loss = loss_fn(m, batch)
                loss.backward()
                micro += 1
                if micro % ACCUM:
                    continue
                if s.step + 1 == KEPT:
                    kept = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                s.log(loss=loss.item() * (50.0 if s.step == spike_at else 1.0))
                if s.step == steps:
                    break
    return kept


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Dataset[Any], Any]:
    run = tmp_path_factory.mktemp("replay") / "run"
    ds = Sequences(32)
    return run, ds, train(run, ds)


@pytest.mark.parametrize("step", [2, KEPT, STEPS])
def test_a_replayed_step_is_bit_exact_against_its_commit(recorded: Any, step: int) -> None:
    run_path, ds, _ = recorded
    run = dstt.open(run_path)
    m, opt, sched = build(seed=123)  # other weights: the replay restores step - 1
    r = run.replay(step, m, opt, scheduler=sched, dataset=ds, loss_fn=loss_fn)
    assert r.faithful, (r.differs, r.max_abs_diff)
    assert r.max_abs_diff == 0.0
    assert r.differs == []
    assert len(r.losses) == ACCUM  # both micro-batches of the accumulated step
    after = run.at(step).state_dict()["model"]
    for name, p in m.named_parameters():  # the live model ends at the replayed step
        assert torch.equal(p.detach(), after[name]), name


def test_the_replayed_gradients_equal_the_original_steps(recorded: Any) -> None:
    run_path, ds, kept = recorded
    m, opt, sched = build(seed=7)
    r = dstt.open(run_path).replay(KEPT, m, opt, scheduler=sched, dataset=ds, loss_fn=loss_fn)
    assert kept
    assert set(kept) >= {
        n for n, _ in TinyGPT(layers=2).named_parameters() if not n.startswith("head.")
    }
    for name, g in kept.items():
        if name == "head.weight":  # tied to tok.weight: one tensor, one name
            continue
        assert torch.equal(r.grad(name), g), name
    grads = r.layer("layers.0.mlp")
    np.testing.assert_array_equal(
        grads["layers/0/mlp/0"]["weight"].values, kept["layers.0.mlp.0.weight"].numpy()
    )
    top = r.top(3)
    assert len(top) == 3
    assert top[0][1] >= top[1][1] >= top[2][1] > 0
    ratio = float(r.norms["update_ratio"].sel(tensor="layers.0.qkv.weight"))
    before = dstt.open(run_path).at(KEPT - 1).to_numpy("layers.0.qkv.weight").astype(float)
    now = dstt.open(run_path).at(KEPT).to_numpy("layers.0.qkv.weight").astype(float)
    assert ratio == pytest.approx(np.linalg.norm(now - before) / np.linalg.norm(before), rel=1e-9)


def test_a_planted_bad_sample_is_ranked_first(tmp_path: Path) -> None:
    """16 samples per step (2 x 8); once the model has learned the sequences, the one sample
    with random targets stands out in the last step that trained on it."""
    bad = 13
    ds = Sequences(32, bad=(bad,))
    run_path = tmp_path / "run"
    train(run_path, ds, steps=40, micro_batch=8)
    run = dstt.open(run_path)
    step = max(k for k, bs in run.batches().items() if any(bad in b.indices for b in bs))
    m, opt, sched = build()
    r = run.replay(
        step,
        m,
        opt,
        scheduler=sched,
        dataset=ds,
        loss_fn=loss_fn,
        activations=["layers.1"],
        per_sample_grads=True,
    )
    assert r.faithful
    assert r.worst(1) == [bad]
    assert len(r.per_sample["index"]) == 16
    assert np.all(np.diff(r.per_sample["loss"].values) <= 0)  # worst first
    assert r.per_sample["grad_norm"].values[0] > 0
    acts = r.activations["layers.1"]
    assert len(acts) == ACCUM
    assert tuple(acts[0].shape) == (8, SEQ, 32)
    new = run.rollback(step - 1, skip_samples=r.worst(1))  # and roll back without it
    assert dstt.open(run_path).timeline == new


def test_a_run_without_data_attribution_says_what_to_do(tmp_path: Path) -> None:
    ds = Sequences(32)
    train(tmp_path / "run", ds, attribution=False)
    m, opt, sched = build()
    with pytest.raises(ReplayError, match=r"s\.data\(loader\)"):
        dstt.open(tmp_path / "run").replay(3, m, opt, scheduler=sched, dataset=ds, loss_fn=loss_fn)
    # the batches themselves still replay it
    x, y = ds[0]
    r = dstt.open(tmp_path / "run").replay(
        3, m, opt, scheduler=sched, loss_fn=loss_fn, batches=[(x[None], y[None])]
    )
    assert r.faithful is False
    assert r.differs  # not the step's data: not faithful, and said


def test_a_step_whose_predecessor_is_not_committed_is_refused(recorded: Any) -> None:
    run_path, ds, _ = recorded
    m, opt, sched = build()
    with pytest.raises(ReplayError, match="step 0 is not committed"):
        dstt.open(run_path).replay(1, m, opt, scheduler=sched, dataset=ds, loss_fn=loss_fn)


SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_replay import Sequences, build, loss_fn


def make():
    model, opt, sched = build(seed=3)
    return {{"model": model, "optimizer": opt, "scheduler": sched, "dataset": Sequences(32),
            "loss_fn": loss_fn}}


if __name__ == "__main__":
    raise SystemExit("not run as a script by dstt replay")
"""


def test_dstt_replay_runs_a_users_script(recorded: Any, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    run_path, _, _ = recorded
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).parent)))
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dstt.cli",
            "replay",
            str(run_path),
            "--step",
            "5",
            "--script",
            f"{script}:make",
            "--top",
            "3",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)
    assert doc["faithful"] is True
    assert doc["step"] == 5
    assert len(doc["top_grad_norm"]) == 3
    assert len(doc["worst_samples"]) == 3
    text = subprocess.run(
        [
            sys.executable,
            "-m",
            "dstt.cli",
            "replay",
            str(run_path),
            "--step",
            "5",
            "--script",
            f"{script}:make",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert text.returncode == 0
    assert "step 5: faithful" in text.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "dstt.cli",
            "replay",
            str(run_path),
            "--step",
            "5",
            "--script",
            f"{script}:nothere",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert bad.returncode == 2
    assert "has no function 'nothere'" in bad.stderr


def test_the_scrubber_replays_the_spike_under_the_cursor_in_one_click(tmp_path: Path) -> None:
    from dstt.widgets import scrubber

    ds, spike_at = Sequences(32), 10
    train(tmp_path / "run", ds, steps=14, spike_at=spike_at)
    run = dstt.open(tmp_path / "run")
    m, opt, sched = build(seed=4)
    w = scrubber(
        run,
        step=spike_at,
        spike_window=4,
        spike_z=3.0,
        replay={
            "model": m,
            "optimizer": opt,
            "scheduler": sched,
            "dataset": ds,
            "loss_fn": loss_fn,
        },
    )
    panel = w.replay
    assert panel is not None
    assert w.model.spike is not None
    assert panel.button.description == f"replay the spike at step {spike_at}"
    panel.button.click()  # what the user's click does
    r = panel.result
    assert panel.error is None
    assert r is not None
    assert r.step == spike_at
    assert r.faithful
    assert "faithful: bit-exact" in panel.status.value
    assert panel.view.artists["names"] == [n for n, _ in r.top(panel.top)]
    assert len(panel.view.artists["bars"]) == min(panel.top, r.norms.sizes["tensor"])
    assert bytes(panel.image.value)[:4] == b"\x89PNG"
    worst = r.worst(panel.samples)
    assert panel.table.value.count("<tr>") == len(worst) + 1  # header + worst samples
    assert f"<td>{worst[0]}</td>" in panel.table.value
    w.model.step = spike_at - 3  # no spike there: the button replays the plain step
    assert panel.button.description == f"replay step {spike_at - 3}"
    assert panel.run().step == spike_at - 3


def test_the_scrubbers_replay_shows_why_it_cannot_replay(tmp_path: Path) -> None:
    from dstt.widgets import scrubber

    ds = Sequences(32)
    train(tmp_path / "run", ds, attribution=False, steps=4)
    m, opt, _ = build()
    w = scrubber(
        dstt.open(tmp_path / "run"),
        replay={"model": m, "optimizer": opt, "loss_fn": loss_fn, "dataset": ds},
    )
    assert w.replay is not None
    assert w.replay.run() is None
    assert isinstance(w.replay.error, ReplayError)
    assert "s.data(loader)" in w.replay.status.value
    with pytest.raises(TypeError, match="model= and optimizer="):
        scrubber(dstt.open(tmp_path / "run"), replay={"loss_fn": loss_fn})
