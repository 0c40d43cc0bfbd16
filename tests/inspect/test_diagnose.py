"""Spike diagnosis (dstt.inspect.diagnose): baseline-relative ranking, the suspect update or
data, the first non-finite tensor, and gradual divergence, on small real training runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import xarray as xr

import dstt
from dstt.inspect.diagnose import find_divergence, rank_by_baseline


class Net(torch.nn.Module):
    """Two linear layers, and ``walk``: a tensor outside the forward pass that a random
    gradient moves a lot at every step (its update ratio is always large)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(8, 32)
        self.l2 = torch.nn.Linear(32, 4)
        self.walk = torch.nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))


def train(
    run: Path,
    steps: int,
    *,
    before_step: Callable[[Net, int], None] | None = None,
    lr_at: Callable[[int], float] | None = None,
) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 4, generator=g)
    m = Net()
    opt = torch.optim.SGD(
        [
            {"params": m.l1.parameters(), "lr": 0.01},
            {"params": m.l2.parameters(), "lr": 0.2},
            {"params": [m.walk], "lr": 0.1},
        ]
    )
    base = [gr["lr"] for gr in opt.param_groups]
    with dstt.session(m, opt, run=run, copy="sync") as s:
        for _ in range(steps):
            k = s.step + 1
            if lr_at is not None:
                for gr, lr in zip(opt.param_groups, base, strict=True):
                    gr["lr"] = lr * lr_at(k)
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            m.walk.grad = torch.randn(16, generator=g)
            if before_step is not None:
                before_step(m, k)
            opt.step()
            opt.zero_grad()
            s.log(loss=loss.item())


def test_ranking_is_relative_to_each_tensors_own_baseline(tmp_path: Path) -> None:
    def bad_update(m: Net, k: int) -> None:
        if k == 60:  # step 60's update of l1 goes uphill, 40x too far
            for p in m.l1.parameters():
                p.grad *= -40.0

    train(tmp_path / "run", 80, before_step=bad_update)
    run = dstt.open(tmp_path / "run")
    (sp,) = run.spikes(window=10, z=4.0)
    assert (sp.start, sp.parent, sp.cause) == (61, 59, 60)
    # the random walk always moves more than l1 did, even in its bad update ...
    sums = run.summaries([60])
    walk = float(sums["update_ratio"].sel(tensor="walk")[0])
    assert walk > 1.5 * sp.ratios["l1.weight"]
    ratios = sums["update_ratio"].isel(step=0)
    assert ratios.idxmax("tensor").item() == "walk"  # what an absolute ranking names
    # ... but only l1 left its own baseline
    assert {n for n, _ in sp.tensors[:2]} == {"l1.weight", "l1.bias"}
    assert sp.tensors[0][1] > 20
    assert dict(sp.tensors).get("walk", 0.0) < 4  # (listed only if above its baseline)
    assert sp.suspect == "update"
    assert sp.rollback_to == 59
    assert "most abnormal updates: l1." in str(sp)


def test_rank_by_baseline_rule() -> None:
    rng = np.random.default_rng(0)
    n = 30
    ratio = np.stack(
        [
            0.5 + 0.05 * rng.standard_normal(n),  # always large, noisy
            0.01 + 0.001 * rng.standard_normal(n),  # small and steady ...
            np.full(n, 0.02),
        ],
        axis=1,
    )  # never varies at all
    ratio[-1, 1] = 0.05  # ... until the last step
    ratio[-1, 2] = 0.0202
    ds = xr.Dataset(
        {"update_ratio": (("step", "tensor"), ratio)},
        coords={"step": np.arange(n), "tensor": ["big", "jump", "flat"]},
    )
    got = rank_by_baseline(ds, n - 1, window=20)
    assert [t[0] for t in got] == ["jump", "flat", "big"]
    assert got[0][1] > 20
    assert got[0][2] == pytest.approx(0.05)
    assert got[1][1] == pytest.approx(1.0)  # MAD floored at 1% of the median, not inf
    # without enough baseline, the absolute ratio orders them (score NaN)
    early = rank_by_baseline(ds, 1, window=20)
    assert [t[0] for t in early] == ["big", "flat", "jump"]
    assert np.isnan(early[0][1])


def test_nan_injected_into_one_tensor_is_reported_at_its_first_step(tmp_path: Path) -> None:
    def inject(m: Net, k: int) -> None:
        if k == 7:
            with torch.no_grad():
                m.l2.weight[0, 0] = float("nan")

    train(tmp_path / "run", 12, before_step=inject)
    run = dstt.open(tmp_path / "run")
    nf = run.first_nonfinite()
    assert nf is not None
    assert (nf.step, nf.parent) == (7, 6)
    assert nf.tensors == [("l2.weight", 1, 0)]  # step 8 spreads it to every tensor
    assert "first non-finite values at step 7 (update 6 -> 7): l2.weight (1 NaN" in str(nf)
    report = run.diagnose(window=5)
    assert report.nonfinite == nf
    assert not report.healthy
    healthy = tmp_path / "healthy"
    train(healthy, 12)
    assert dstt.open(healthy).first_nonfinite() is None


def test_divergence_rule_flags_a_sustained_rise_not_a_spike() -> None:
    steps = np.arange(120)
    loss = 2.0 * np.exp(-steps / 20.0) + 0.5 + 0.01 * np.sin(steps)
    spiky = loss.copy()
    spiky[60] += 5.0  # one bad step: the trailing median does not move
    assert find_divergence(steps, spiky, window=10) == []
    rising = loss.copy()
    rising[70:] *= np.exp((steps[70:] - 70) / 15.0)  # a slow, sustained rise
    ((start, step, end, lo, hi),) = find_divergence(steps, rising, window=10)
    assert 65 <= start <= 75
    assert start < step < 100
    assert end == 119
    assert hi > 1.5 * lo
    with pytest.raises(ValueError, match="rise > 1"):
        find_divergence(steps, loss, rise=1.0)


def test_run_divergence_names_the_growing_tensors(tmp_path: Path) -> None:
    # the learning rate grows 4% a step from step 40: past stability the loss climbs and
    # stays high (the weights' norms grew) instead of coming back down
    train(tmp_path / "run", 110, lr_at=lambda k: 1.0 if k < 40 else 1.04 ** (k - 40))
    run = dstt.open(tmp_path / "run")
    (d,) = run.divergence(window=5)
    assert 40 <= d.start < d.step < d.end == 110
    assert d.value > 1.5 * d.minimum
    assert d.tensors[0][0] != "walk"
    assert d.tensors[0][1] > 2.0
    assert f"loss diverges from step {d.start}" in str(d)


def test_most_abnormal_means_the_largest_positive_z() -> None:
    rng = np.random.default_rng(0)
    n = 30
    ratio = np.stack(
        [
            0.01 + 0.001 * rng.standard_normal(n),  # up 3x at the last step
            0.02 + 0.001 * rng.standard_normal(n),  # up a little
            0.03 + 0.001 * rng.standard_normal(n),  # froze: far *below* its baseline
            0.04 + 0.001 * rng.standard_normal(n),  # no baseline (NaN before the last step)
        ],
        axis=1,
    )
    ratio[-1, :3] = [0.03, 0.025, 0.0]
    ratio[:-1, 3] = np.nan
    ds = xr.Dataset(
        {"update_ratio": (("step", "tensor"), ratio)},
        coords={"step": np.arange(n), "tensor": ["up", "bit", "froze", "new"]},
    )
    got = rank_by_baseline(ds, n - 1, window=20)
    assert [t[0] for t in got] == ["up", "bit", "new", "froze"]
    assert got[0][1] > got[1][1] > 0
    assert np.isnan(got[2][1])
    assert got[3][1] < -20  # the largest |z| of all: still no suspect of a jump


def test_the_spike_report_lists_no_tensor_below_its_baseline(tmp_path: Path) -> None:
    def bad_update(m: Net, k: int) -> None:
        if k == 60:  # l1 overshoots 40x; l2 does not move at all
            for p in m.l1.parameters():
                p.grad *= -40.0
            for p in m.l2.parameters():
                p.grad = None

    train(tmp_path / "run", 80, before_step=bad_update)
    run = dstt.open(tmp_path / "run")
    (sp,) = run.spikes(window=10, z=4.0, around=0)
    assert sp.cause == 60
    ranked = dict((n, z) for n, z, _ in rank_by_baseline(run.summaries(), 60, window=20))
    assert ranked["l2.weight"] < 0  # froze at the cause: the most negative z there
    names = [n for n, _ in sp.tensors]
    assert names[:2] == ["l1.weight", "l1.bias"] or names[:2] == ["l1.bias", "l1.weight"]
    assert "l2.weight" not in names
    assert "l2.bias" not in names
    assert all(not np.isfinite(z) or z >= 0 for _, z in sp.tensors)
    assert "l2." not in str(sp).split("most abnormal updates:")[1]
