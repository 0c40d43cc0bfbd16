"""Update ratios from write-time summaries: exact where the engine held the parent's copy,
estimates elsewhere, and every view says which.

The update of a commit is relative to its parent commit (:mod:`dstt.engine.capture.summaries`). A
session's flat lane (every state under half the budget) compares each step with its parent's
whole copy: ``update_exact`` True for every tensor-step after the first, equal to what
``run.diff(parent, k)`` computes from the two stored steps — with ``every=1`` and ``every=2``
alike. The chunk lane (a state over half the budget) and the first step after a resume
estimate it from 16 probed elements per tensor; this measures that estimate against the true
ratio ``||w_k - w_{k-1}|| / ||w_k||``, pins the bound the labels promise
(``dstt.inspect.summaries.ESTIMATE_NOTE``), and checks that ``run.summaries()``,
``dstt show``, the plots and the scrubber label the numbers exact or estimates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import dstt
from dstt.cli import main
from dstt.plots.series import step_change, tensor_stats
from dstt.testing.models import TinyGPT, make_batch

STEPS = 10
CHUNK_BUDGET = 64 * 1024  # under twice the state (~0.4 MB with Adam): the chunk lane


def _model() -> tuple[TinyGPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, seq=16, dropout=0.0)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train(
    path: Path,
    model: TinyGPT,
    opt: torch.optim.Optimizer,
    steps: int,
    first: int = 0,
    **options: Any,
) -> None:
    with dstt.session(model, opt, run=path, **options) as s:
        for i in range(first, first + steps):
            x, y = make_batch(i, batch_size=4, seq=16, vocab=64)
            model(x, y)[1].backward()  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            s.log(loss=float(i))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A default session (the flat lane): exact updates."""
    path = tmp_path_factory.mktemp("exact") / "run"
    _train(path, *_model(), STEPS)
    return dstt.open(path)


@pytest.fixture(scope="module")
def chunk_run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The chunk lane (no copy of the parent held): estimated updates."""
    path = tmp_path_factory.mktemp("estimates") / "run"
    _train(path, *_model(), STEPS, budget_bytes=CHUNK_BUDGET)
    return dstt.open(path)


def _params(ds: Any) -> list[int]:
    return [j for j, p in enumerate(ds["store_path"].values) if str(p).startswith("params/")]


def _assert_exact_against_diff(run: Any, k: int, parent: int) -> None:
    """Every parameter's update into ``k`` is flagged exact and equals the diff of the two
    stored steps (float32 weights: the float32 differences and sums are good to ~1e-6)."""
    ds = run.summaries([k])
    cols = _params(ds)
    assert len(cols) >= 10
    d = run.diff(parent, k, paths=[str(ds["store_path"].values[j]) for j in cols])
    for j in cols:
        name = str(ds["tensor"].values[j])
        where = f"step {k}, {name}"
        assert bool(ds["update_exact"].values[0, j]), where
        true = d.sel(tensor=name)
        assert float(true["delta_l2"]) > 0, where  # the optimizer moved it: a real test
        got_l2 = float(ds["update_l2"].values[0, j])
        got_ratio = float(ds["update_ratio"].values[0, j])
        assert got_l2 == pytest.approx(float(true["delta_l2"]), rel=1e-5), where
        want_ratio = float(true["delta_l2"]) / float(true["b_l2"])
        assert got_ratio == pytest.approx(want_ratio, rel=1e-5), where


def test_every_update_after_the_first_is_exact_on_an_every1_run(run: Any) -> None:
    ds = run.summaries()
    cols = _params(ds)
    assert run.steps == list(range(1, STEPS + 1))
    assert not ds["update_exact"].values[0, cols].any()  # the first step: no parent
    assert np.isnan(ds["update_ratio"].values[0, cols]).all()
    assert ds["update_exact"].values[1:, cols].all()
    assert ds.attrs["update_exactness"] == "exact"
    for var in ("update_l2", "update_ratio"):
        assert ds[var].attrs["exactness"] == "exact"
        assert "estimate" not in ds[var].attrs["note"]
    for k in run.steps[1:]:
        _assert_exact_against_diff(run, k, k - 1)


def test_with_every_2_the_update_is_exact_against_the_parent_commit(tmp_path: Path) -> None:
    path = tmp_path / "run"
    _train(path, *_model(), 8, every=2)
    run = dstt.open(path)
    assert run.steps == [2, 4, 6, 8]
    for k in (4, 6, 8):  # the update of commit k is ||w_k - w_{k-2}||: its parent's
        _assert_exact_against_diff(run, k, k - 2)


def test_the_first_step_after_a_resume_is_an_estimate_and_labelled_so(tmp_path: Path) -> None:
    path = tmp_path / "run"
    model, opt = _model()
    _train(path, model, opt, 4)
    _train(path, model, opt, 3, first=4, resume=True)
    run = dstt.open(path)
    assert run.steps == list(range(1, 8))
    ds = run.summaries()
    cols = _params(ds)
    # step 5's parent (4) was restored, not digested by this session: estimated from probes
    assert not ds["update_exact"].sel(step=5).values[cols].any()
    assert np.isfinite(ds["update_ratio"].sel(step=5).values[cols]).all()
    assert ds.attrs["update_exactness"] == "mixed"
    assert "estimate" in ds["update_ratio"].attrs["note"]
    for k in (2, 3, 4, 6, 7):
        _assert_exact_against_diff(run, k, k - 1)


def test_exact_updates_are_shown_without_the_estimate_mark(
    run: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    stats = tensor_stats(run, selector="layers.0")
    assert stats.attrs["update_exactness"] == "exact"
    assert step_change(run, STEPS).attrs["exactness"] == "exact"
    assert main(["show", str(run.path), "--select", "layers.0.qkv"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "layers.0.qkv.weight" in line)
    assert "~" not in row
    ratio = float(run.summaries([STEPS])["update_ratio"].sel(tensor="layers.0.qkv.weight")[0])
    assert f" {ratio:.3g} " in row
    assert "estimate" not in out


def test_the_estimate_is_within_its_documented_bound_of_the_true_ratio(chunk_run: Any) -> None:
    run = chunk_run
    ds = run.summaries()
    params = _params(ds)
    assert not ds["update_exact"].values.any()  # the chunk lane estimates: nothing exact
    errors = []
    for k in run.steps[1:]:
        before, after = run.at(k - 1), run.at(k)
        for j in params:
            name = str(ds["tensor"].values[j])
            est = float(ds["update_ratio"].sel(step=k).values[j])
            wa = before.to_numpy(name).astype(np.float64)
            wb = after.to_numpy(name).astype(np.float64)
            true = float(np.linalg.norm(wb - wa) / np.linalg.norm(wb))
            if wb.size <= 16:  # every element probed: the estimate is the exact value
                assert est == pytest.approx(true, rel=1e-6)
            elif true > 0:
                errors.append(abs(est - true) / true)
    errors_ = np.array(errors)
    assert len(errors_) >= 100
    # what ESTIMATE_NOTE says: typically within ~20 %, now and then off by 2x
    assert np.median(errors_) < 0.2, np.median(errors_)
    assert np.quantile(errors_, 0.9) < 0.5, np.quantile(errors_, 0.9)
    assert errors_.max() < 1.5, errors_.max()
    assert errors_.max() > 0.05  # an estimate indeed, not the exact value


def test_every_view_labels_estimates_as_estimates(
    chunk_run: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    run = chunk_run
    ds = run.summaries()
    assert ds.attrs["update_exactness"] == "estimate"
    for var in ("update_l2", "update_ratio"):
        assert ds[var].attrs["exactness"] == "estimate"
        assert "estimate" in ds[var].attrs["note"]
        assert "run.diff" in ds[var].attrs["note"]
    stats = tensor_stats(run, selector="layers.0")
    assert stats.attrs["update_exactness"] == "estimate"
    assert stats.attrs["source"] == "summaries"
    assert step_change(run, STEPS).attrs["exactness"] == "estimate"
    # an exact change (another reference: a diff of the tensors) says exact
    assert step_change(run, STEPS, STEPS - 2).attrs["exactness"] == "exact"
    assert main(["show", str(run.path), "--select", "layers.0.qkv"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "layers.0.qkv.weight" in line)
    assert " ~0." in row  # the ratio column marks the estimate
    assert "an estimate from 16 probed elements" in out


def test_plots_and_widgets_say_exact_or_estimate(run: Any, chunk_run: Any) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import dstt.plots
    from dstt.widgets.model import ScrubberModel
    from dstt.widgets.views import FigureView, draw_change

    for r, word in ((chunk_run, "estimate"), (run, "exact")):
        ax = dstt.plots.update_heatmap(r, spikes=None)
        assert word in ax.get_title()
        ax = dstt.plots.layer_change(r, STEPS)
        assert word in ax.get_xlabel()
        view = FigureView((4, 3))
        view.redraw(lambda a, r=r: draw_change(a, ScrubberModel(r)))
        assert word in view.ax.get_title()
    assert "estimate" not in dstt.plots.update_heatmap(run, spikes=None).get_title()
