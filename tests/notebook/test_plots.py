"""``dstt.plots``: the numbers (summaries or tensors, same values) and what is drawn."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from notebook_helpers import CAUSE_STEP, JUMPER, SPIKE_STEP, STEPS, arrays_at, loss_at

import dstt.plots as P

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

PARAMS = ["big.weight", "emb.weight", "layers.0.attn.bias", "layers.0.attn.weight", JUMPER]


def axes() -> Any:
    return Figure().add_subplot()


def expected_stats(steps: list[int]) -> tuple[np.ndarray, np.ndarray]:
    l2 = np.array(
        [
            [
                np.linalg.norm(arrays_at(s)[f"params/{n.replace('.', '/')}"].astype(np.float64))
                for n in PARAMS
            ]
            for s in steps
        ]
    )
    upd = np.full_like(l2, np.nan)
    for i in range(1, len(steps)):
        a, b = arrays_at(steps[i - 1]), arrays_at(steps[i])
        for j, n in enumerate(PARAMS):
            p = f"params/{n.replace('.', '/')}"
            upd[i, j] = np.linalg.norm(b[p].astype(np.float64) - a[p])
    return l2, upd


def test_import_needs_no_matplotlib() -> None:
    code = "import sys, dstt.plots, dstt.widgets; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("which", ["run", "summarized_run"])
def test_tensor_stats_from_summaries_equal_those_from_tensors(
    which: str, request: pytest.FixtureRequest
) -> None:
    run = request.getfixturevalue(which)
    ds = P.tensor_stats(run)
    assert ds.attrs["source"] == ("summaries" if which == "summarized_run" else "tensors")
    assert list(ds["tensor"].values) == PARAMS  # params only: no buffers, no optimizer states
    assert list(ds["step"].values) == STEPS
    l2, upd = expected_stats(STEPS)
    np.testing.assert_allclose(ds["l2"].values, l2, rtol=1e-6)
    np.testing.assert_allclose(ds["update_l2"].values, upd, rtol=1e-5)
    np.testing.assert_allclose(ds["update_ratio"].values, upd / l2, rtol=1e-5)


def test_tensor_stats_selector_and_steps(run: Any) -> None:
    ds = P.tensor_stats(run, slice(5, 9), selector="layers.0")
    assert list(ds["tensor"].values) == ["layers.0.attn.bias", "layers.0.attn.weight"]
    assert list(ds["step"].values) == [5, 6, 7, 8, 9]
    with pytest.raises(MemoryError, match="select fewer steps"):
        P.tensor_stats(run, max_bytes=1000)


def test_loss_marks_spikes_and_the_step(run: Any) -> None:
    ax = P.loss(run, window=10, step=7, ax=axes())
    (line,) = ax.get_lines()[:1]
    np.testing.assert_array_equal(line.get_xdata(), STEPS)
    np.testing.assert_allclose(line.get_ydata(), [loss_at(s) for s in STEPS])
    offsets = ax.collections[0].get_offsets()
    np.testing.assert_allclose(offsets, [[SPIKE_STEP, loss_at(SPIKE_STEP)]])
    (span,) = ax.patches  # the update that caused it, shaded: its loss shows one step later
    assert (span.get_x(), span.get_x() + span.get_width()) == (CAUSE_STEP - 1, CAUSE_STEP)
    assert any(list(ln.get_xdata()) == [7, 7] for ln in ax.get_lines())
    with pytest.raises(KeyError, match="never logged"):
        P.loss(run, "nope", ax=axes())


def test_loss_over_all_timelines(run: Any) -> None:
    new = run.rollback(to=10)
    ax = P.loss(run, timelines="all", spikes=False, ax=axes())
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert labels[:2] == [new, "main"]  # the current timeline first


def test_update_heatmap_draws_the_ratio_matrix(summarized_run: Any) -> None:
    ax = P.update_heatmap(summarized_run, ax=axes())
    mesh = ax.collections[0]
    _, upd = expected_stats(STEPS)
    l2, _ = expected_stats(STEPS)
    want = np.ma.masked_invalid((upd / l2).T)
    got = mesh.get_array()
    np.testing.assert_allclose(
        got.filled(np.nan).reshape(want.shape), want.filled(np.nan), rtol=1e-5
    )
    assert [t.get_text() for t in ax.get_yticklabels()] == PARAMS
    # the dashed line marks the update that caused the spike: the column whose weights
    # produced the bad loss, one step before the loss jumped
    assert [ln.get_xdata()[0] for ln in ax.get_lines()] == [CAUSE_STEP]
    assert "summaries" in ax.get_title()


def test_norms_and_layer_change(run: Any) -> None:
    ax = P.norms(run, "layers.0", relative=True, ax=axes())
    lines = ax.get_lines()
    assert [ln.get_label() for ln in lines] == ["layers.0.attn.bias", "layers.0.attn.weight"]
    assert lines[0].get_ydata()[0] == pytest.approx(1.0)
    ax = P.layer_change(run, CAUSE_STEP, ax=axes())
    assert ax.get_yticklabels()[0].get_text() == JUMPER
    ax = P.layer_change(run, 12, reference=3, ax=axes())
    assert "step 12 vs 3" in ax.get_title()


def test_step_change_previous_and_first(run: Any) -> None:
    first = P.step_change(run, 1)
    assert first.attrs["reference"] is None
    assert np.isnan(first["ratio"].values).all()
    ch = P.step_change(run, 5)
    assert ch.attrs["reference"] == 4
    assert ch.attrs["source"] == "tensors"
    exact = run.diff(4, 5)
    np.testing.assert_allclose(
        ch["ratio"].values, exact["ratio"].sel(tensor=list(ch["tensor"].values)).values
    )


def test_tensor_plot_kinds() -> None:
    ax = P.tensor(np.arange(12.0).reshape(3, 4), ax=axes())
    np.testing.assert_array_equal(ax.images[0].get_array(), np.arange(12.0).reshape(3, 4))
    ax = P.tensor(np.arange(10.0), ax=axes())
    assert sum(p.get_height() for p in ax.patches) == 10
    ax = P.tensor(np.float32(2.5), ax=axes())
    assert ax.texts[0].get_text() == "2.5"


def test_functions_make_their_own_figure_without_ax(run: Any) -> None:
    import matplotlib.pyplot as plt

    ax = P.loss(run, window=10)
    try:
        assert ax.figure in [plt.figure(n) for n in plt.get_fignums()]
    finally:
        plt.close("all")
