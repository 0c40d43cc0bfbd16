"""Widget logic in plain pytest: observers fire synchronously, so setting a widget's value
updates the model and redraws at once; assertions are on the model and the figures' artists."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from notebook_helpers import (
    CAUSE_STEP,
    JUMPER,
    REACTOR,
    SPIKE_STEP,
    STEPS,
    arrays_at,
    loss_at,
    smooth_loss,
    write_run,
)

import dstt
import dstt.plots
import dstt.widgets as W
from dstt.errors import StepNotFoundError, TensorNotFoundError, TimelineError
from dstt.widgets.model import LRU, ScrubberModel

pytest.importorskip("ipywidgets")
pytest.importorskip("matplotlib")

WINDOW = 10  # the fixture run has 30 steps: the default 50-step spike window is too long


def values(run: Any, step: int, name: str, timeline: str | None = None) -> np.ndarray:
    return run.at(step, timeline).tensor(name).values


def scrub(run: Any, **kw: Any) -> W.Scrubber:
    s = W.scrubber(run, spike_window=WINDOW, **kw)
    assert s.error is None
    return s


def test_initial_state_is_the_head(run: Any) -> None:
    s = scrub(run)
    m = s.model
    assert m.steps == STEPS
    assert m.step == STEPS[-1]
    assert m.index == len(STEPS) - 1
    assert m.timeline == "main"
    assert m.metric == "loss"
    assert m.tensor == "big.weight"  # the first matrix-shaped parameter
    assert m.tensors == [
        "big.weight",
        "emb.weight",
        "layers.0.attn.bias",
        "layers.0.attn.weight",
        "layers.1.mlp.weight",
    ]
    assert list(s.slider.options) == STEPS
    assert s.slider.value == STEPS[-1]
    assert s.slider.continuous_update is False
    assert (s.play.min, s.play.max, s.play.value) == (0, len(STEPS) - 1, len(STEPS) - 1)
    assert [sp.step for sp in m.spikes] == [SPIKE_STEP]
    assert all(bytes(img.value).startswith(b"\x89PNG") for img in s.images.values())


def test_moving_the_slider_updates_model_label_and_views(run: Any) -> None:
    s = scrub(run, tensor="layers.0.attn.weight")
    s.slider.value = 5
    m = s.model
    assert (m.step, m.index, s.play.value) == (5, 4, 4)
    assert "step 5 ·" in s.label.value
    assert "data-step='5'" in s.label.value
    art = s.views["loss"].artists
    assert list(art["cursor"].get_xdata()) == [5, 5]
    assert art["point"].get_xdata()[0] == 5
    assert art["point"].get_ydata()[0] == pytest.approx(loss_at(5))
    np.testing.assert_array_equal(
        s.views["tensor"].artists["image"].get_array(), arrays_at(5)["params/layers/0/attn/weight"]
    )
    np.testing.assert_array_equal(
        s.views["tensor"].artists["image"].get_array(), values(run, 5, "layers.0.attn.weight")
    )


def test_a_step_change_moves_the_loss_cursor_in_place(run: Any) -> None:
    """A step change keeps the loss view's axes (its curves and ticks) and moves only the
    cursor, the point and the title; pinning a reference draws the view anew."""
    s = scrub(run)
    view = s.views["loss"]
    ax, lines, limits = view.ax, view.artists["lines"], (view.ax.get_xlim(), view.ax.get_ylim())
    before = bytes(s.images["loss"].value)
    for step in (5, 12, 7):
        s.slider.value = step
        assert view.ax is ax
        assert view.artists["lines"] is lines
        assert list(view.artists["cursor"].get_xdata()) == [step, step]
        points = [ln for ln in ax.lines if ln.get_marker() == "o" and len(ln.get_xdata()) == 1]
        assert points == [view.artists["point"]]  # the old point is gone
        assert view.artists["point"].get_ydata()[0] == pytest.approx(loss_at(step))
        assert ax.get_title() == f"loss · step {step}"
        assert (ax.get_xlim(), ax.get_ylim()) == limits
    assert bytes(s.images["loss"].value) != before  # the shown PNG follows
    s.pin_button.click()
    assert view.ax is not ax  # a reference line: drawn anew
    assert view.artists["reference"].get_xdata()[0] == 7


@pytest.mark.parametrize("mode", ["values", "change"])
def test_a_step_change_updates_the_heatmap_in_place(run: Any, mode: str) -> None:
    """The same tensor at another step: the heatmap's data and colour limits change, its axes
    and colorbar stay (no new ticks to lay out); another tensor draws the view anew."""
    s = scrub(run, tensor="layers.0.attn.weight", mode=mode)
    view = s.views["tensor"]
    ax, image, bar = view.ax, view.artists["image"], view.artists["colorbar"]
    for step in (5, 12):
        s.slider.value = step
        assert view.ax is ax
        assert view.artists["image"] is image
        assert view.artists["colorbar"] is bar
        want = values(run, step, "layers.0.attn.weight").astype(np.float64)
        if mode == "change":
            want = want - values(run, s.model.steps[s.model.index - 1], "layers.0.attn.weight")
        np.testing.assert_allclose(image.get_array(), want, rtol=1e-6)
        lo, hi = image.get_clim()
        if mode == "change":
            assert (lo, hi) == pytest.approx((-np.abs(want).max(), np.abs(want).max()))
        else:
            assert (lo, hi) == pytest.approx((want.min(), want.max()))
        assert ax.get_title() == s.model.shown()[1]  # the step's own title
    s.tensor_picker.value = "emb.weight"
    assert view.ax is not ax


def test_spike_is_marked_and_labelled(run: Any) -> None:
    s = scrub(run)
    offsets = s.views["loss"].artists["spikes"].get_offsets()
    np.testing.assert_allclose(offsets, [[SPIKE_STEP, loss_at(SPIKE_STEP)]])
    assert "SPIKE" not in s.label.value
    (span,) = s.views["loss"].artists["causes"]  # the update that caused it, shaded
    assert (span.get_x(), span.get_x() + span.get_width()) == (CAUSE_STEP - 1, CAUSE_STEP)
    s.slider.value = SPIKE_STEP
    assert "SPIKE z=" in s.label.value
    assert "spike" in s.label.value
    assert f"caused by the update {CAUSE_STEP - 1} → {CAUSE_STEP}" in s.label.value
    assert s.model.spike is not None
    assert s.model.spike.step == SPIKE_STEP


def test_play_index_and_buttons_step_through(run: Any) -> None:
    s = scrub(run)
    s.slider.index = 2  # what the jslinked Play does in the browser
    assert s.model.step == 3
    s.next_button.click()
    assert s.model.step == 4
    assert s.slider.value == 4
    assert s.play.value == 3
    s.prev_button.click()
    s.prev_button.click()
    assert s.model.step == 2
    s.model.index = 0
    s.prev_button.click()  # clamped at the first step
    assert s.model.step == 1
    assert s.slider.value == 1


def test_one_dimensional_tensor_is_a_histogram(run: Any) -> None:
    s = scrub(run)
    s.tensor_picker.value = "layers.0.attn.bias"
    patches = s.views["tensor"].artists["hist"]
    assert sum(p.get_height() for p in patches) == 8
    assert "image" not in s.views["tensor"].artists


def test_big_tensor_is_subsampled_lazily(run: Any) -> None:
    s = scrub(run, tensor="big.weight", max_side=256)
    assert s.model.strides() == (3, 1)
    img = s.views["tensor"].artists["image"].get_array()
    np.testing.assert_array_equal(img, arrays_at(30)["params/big/weight"][::3])
    assert "every 3x1" in s.views["tensor"].fig.axes[0].get_title()


def test_three_dimensional_tensor_is_shown_as_a_matrix(run: Any) -> None:
    s = scrub(run, tensor=JUMPER)
    img = s.views["tensor"].artists["image"].get_array()
    np.testing.assert_array_equal(img, arrays_at(30)["params/layers/1/mlp/weight"].reshape(4, 6))


def test_change_mode_against_previous_and_pinned_reference(run: Any) -> None:
    s = scrub(run, tensor="emb.weight")
    m = s.model
    s.slider.value = 10
    s.mode_picker.value = "change"
    assert m.reference is None
    assert m.reference_step == 9
    np.testing.assert_allclose(
        s.views["tensor"].artists["image"].get_array(),
        values(run, 10, "emb.weight").astype(np.float64) - values(run, 9, "emb.weight"),
    )
    s.slider.value = 3
    s.pin_button.click()
    s.slider.value = 12
    assert m.reference == 3
    assert "reference 3 (pinned)" in s.label.value
    np.testing.assert_allclose(
        s.views["tensor"].artists["image"].get_array(),
        values(run, 12, "emb.weight").astype(np.float64) - values(run, 3, "emb.weight"),
    )
    assert s.views["loss"].artists["reference"].get_xdata()[0] == 3
    ratios = dict(
        zip(s.views["change"].artists["names"], s.views["change"].artists["ratios"], strict=True)
    )
    exact = run.diff(3, 12)
    for name, r in ratios.items():
        assert r == pytest.approx(float(exact["ratio"].sel(tensor=name)))
    s.unpin_button.click()
    assert m.reference is None
    assert m.reference_step == 11


def test_first_step_has_no_previous_reference(run: Any) -> None:
    s = scrub(run, step=1, mode="change")
    assert s.model.reference_step is None
    assert s.views["tensor"].artists == {}
    assert s.views["change"].artists == {}
    assert s.error is None


def test_change_view_ranks_the_jumping_layer_first_at_its_update(
    run: Any, summarized_run: Any
) -> None:
    for r in (run, summarized_run):
        s = scrub(r, step=CAUSE_STEP)
        change = s.model.change()
        assert change.attrs["source"] == ("summaries" if r is summarized_run else "tensors")
        assert s.views["change"].artists["names"][0] == JUMPER
        prev = arrays_at(CAUSE_STEP - 1)["params/layers/1/mlp/weight"].astype(np.float64)
        cur = arrays_at(CAUSE_STEP)["params/layers/1/mlp/weight"].astype(np.float64)
        delta = float(np.linalg.norm(cur - prev))
        assert float(change["delta_l2"].sel(tensor=JUMPER)) == pytest.approx(delta, rel=1e-5)
        s.slider.value = SPIKE_STEP  # one update later: the reaction, another tensor
        assert s.views["change"].artists["names"][0] == REACTOR


def test_widgets_opened_from_a_spike_show_the_update_that_caused_it(
    run: Any, summarized_run: Any
) -> None:
    jumper = "params/layers/1/mlp/weight"
    for r in (run, summarized_run):
        (sp,) = r.spikes(window=WINDOW)
        # the loss jumped at SPIKE_STEP; it was computed on the weights of CAUSE_STEP
        assert (sp.step, sp.parent, sp.cause) == (SPIKE_STEP, CAUSE_STEP - 1, CAUSE_STEP)
        assert [n for n, _ in sp.tensors[:1]] == ([JUMPER] if r is summarized_run else [])
        for opened in (scrub(r, spike=sp), scrub(r, spike=SPIKE_STEP)):
            m = opened.model
            assert (m.step, m.reference_step, m.mode) == (CAUSE_STEP, CAUSE_STEP - 1, "change")
            assert m.tensor == JUMPER  # the tensor that moved most in that update
            change = opened.views["change"]
            assert change.artists["names"][0] == JUMPER
            assert (
                change.fig.axes[0].get_title().startswith(f"change {CAUSE_STEP - 1} → {CAUSE_STEP}")
            )
            np.testing.assert_allclose(
                opened.views["tensor"].artists["image"].get_array(),
                (
                    arrays_at(CAUSE_STEP)[jumper].astype(np.float64)
                    - arrays_at(CAUSE_STEP - 1)[jumper]
                ).reshape(4, 6),
            )
            assert f"cause of the spike at {SPIKE_STEP}" in opened.label.value
    c = W.compare(run, spike=sp)
    assert (c.model.a.step, c.model.b.step) == (CAUSE_STEP - 1, CAUSE_STEP)
    assert c.model.tensor == JUMPER
    assert c.model.ranking()[0][0] == JUMPER
    s = scrub(run)
    with pytest.raises(KeyError, match="no spike at step 7"):
        s.model.open_spike(7)


def test_images_show_the_step(run: Any) -> None:
    """The PNG bytes the browser gets follow the step: every view's image changes when the
    step does, equals its figure rendered now, and comes back when the step does."""
    s = scrub(run, tensor="layers.0.attn.weight")
    png = {k: bytes(img.value) for k, img in s.images.items()}
    s.slider.value = 5
    moved = {k: bytes(img.value) for k, img in s.images.items()}
    for k in ("loss", "tensor", "change"):
        assert moved[k] != png[k], k
        assert moved[k] == s.views[k].png(), k
    s.mode_picker.value = "change"
    assert bytes(s.images["tensor"].value) not in (png["tensor"], moved["tensor"])
    s.mode_picker.value = "values"
    s.slider.value = STEPS[-1]
    assert {k: bytes(img.value) for k, img in s.images.items()} == png


def test_compare_images_follow_the_tensor(run: Any) -> None:
    c = W.compare(run, 10, 25)
    before = bytes(c.images["tensors"].value)
    c.tensor_picker.value = "emb.weight"
    after = bytes(c.images["tensors"].value)
    assert after != before
    assert after == c.views["tensors"].png()


def test_lru_caches_loaded_steps(run: Any) -> None:
    s = scrub(run, cache_size=6, prefetch=0)  # counts misses: no background loads
    cache = s.model.cache
    s.slider.value = 5
    s.slider.value = 6
    misses = cache.misses
    s.slider.value = 5
    assert cache.misses == misses
    assert cache.hits > 0
    for step in range(7, 14):
        s.slider.value = step
    assert len(cache) <= 6


def test_lru() -> None:
    c: LRU[str, int] = LRU(2)
    assert c.get_or_make("a", lambda: 1) == 1
    assert c.get_or_make("b", lambda: 2) == 2
    assert c.get_or_make("a", lambda: 0) == 1  # hit: "a" becomes most recent
    c.get_or_make("c", lambda: 3)
    assert "a" in c
    assert "b" not in c
    assert len(c) == 2
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        LRU(0)


def test_timeline_picker_follows_a_rollback(tmp_path: Path) -> None:
    path = tmp_path / "run"
    write_run(path, STEPS)
    run = dstt.open(path)
    new = run.rollback(to=15, skip_data=2)
    write_run(path, list(range(16, 26)), shift=1.0, loss=smooth_loss)
    run.refresh()
    assert run.timeline == new
    s = W.scrubber(run, timeline="main", step=28, spike_window=WINDOW)
    assert s.model.timeline == "main"
    assert s.timeline_picker.options[0] == new
    s.timeline_picker.value = new
    m = s.model
    assert m.steps == list(range(1, 26))
    assert m.step == 25  # snapped to the new head
    assert list(s.slider.options) == m.steps
    assert s.play.max == 24
    assert m.spikes == []  # the rollback timeline skipped the spike
    np.testing.assert_array_equal(
        s.views["tensor"].artists["image"].get_array(), arrays_at(25, 1.0)["params/big/weight"][::3]
    )
    s.slider.value = 20
    assert m.metric_value == pytest.approx(smooth_loss(20))
    s.timeline_picker.value = "main"
    assert m.step == 20
    assert m.metric_value == pytest.approx(loss_at(20))
    assert s.error is None


def test_model_rejects_unknown_steps_and_widget_shows_errors(run: Any) -> None:
    m = ScrubberModel(run, spike_window=WINDOW)
    with pytest.raises(StepNotFoundError):  # dstt's errors, still KeyErrors
        m.step = 999
    with pytest.raises(TensorNotFoundError, match="no tensor named 'nope' at step"):
        m.tensor = "nope"
    with pytest.raises(TimelineError, match="no timeline 'nope'"):
        m.timeline = "nope"
    with pytest.raises(ValueError, match="mode must be 'values' or 'change'"):
        m.mode = "bogus"  # type: ignore[assignment]
    s = scrub(run)
    s._guard(lambda: setattr(s.model, "step", 999))
    assert isinstance(s.error, KeyError)
    assert "error" in s.label.value


def test_observers_get_the_changed_fields(run: Any) -> None:
    m = ScrubberModel(run, spike_window=WINDOW)
    seen: list[set[str]] = []
    m.observe(seen.append)
    m.step = 4
    m.step = 4  # no change, no call
    m.tensor = "emb.weight"
    m.reference = 2
    m.mode = "change"
    assert seen == [{"step"}, {"tensor"}, {"reference"}, {"mode"}]


def test_compare_two_steps_and_two_timelines(tmp_path: Path) -> None:
    path = tmp_path / "run"
    write_run(path, STEPS)
    run = dstt.open(path)
    c = W.compare(run, 10, 25)
    m = c.model
    assert m.tensor == JUMPER  # the parameter that changed most
    exact = run.diff(10, 25)
    assert dict(m.ranking())[JUMPER] == pytest.approx(float(exact["ratio"].sel(tensor=JUMPER)))
    c.tensor_picker.value = "emb.weight"
    art = c.views["tensors"].artists
    np.testing.assert_array_equal(art["a"]["image"].get_array(), arrays_at(10)["params/emb/weight"])
    np.testing.assert_allclose(
        art["delta"]["image"].get_array(),
        arrays_at(25)["params/emb/weight"].astype(np.float64) - arrays_at(10)["params/emb/weight"],
    )
    assert c.views["loss"].artists["cursor_b"].get_xdata()[0] == 25

    new = run.rollback(to=15)
    write_run(path, list(range(16, 21)), shift=1.0)
    run.refresh()
    c2 = W.compare(run, timeline_a="main", timeline_b=new, tensor="emb.weight")
    assert (c2.model.a.step, c2.model.b.step) == (30, 20)
    assert (c2.model.a.timeline, c2.model.b.timeline) == ("main", new)
    assert len(c2.views["loss"].artists["lines"]) == 2
    assert f"B {new}@20" in c2.label.value


def test_missing_ipywidgets_gives_the_install_hint(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # makes `import ipywidgets` fail
    with pytest.raises(ImportError, match=r"pip install 'dstt\[notebook\]'"):
        W.scrubber(run)
    with pytest.raises(ImportError, match=r"pip install 'dstt\[notebook\]'"):
        W.compare(run, 1, 2)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"needs matplotlib"):
        W.views.FigureView((1, 1))


def test_scrubber_accepts_a_path(run_path: Path) -> None:
    s = W.scrubber(run_path, spike_window=WINDOW)
    assert s.model.steps == STEPS
    bundle = s._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_refresh_picks_up_new_steps_of_a_live_run(tmp_path: Path) -> None:
    path = tmp_path / "run"
    write_run(path, STEPS[:10])
    s = W.scrubber(dstt.open(path), spike_window=WINDOW)
    seen: list[set[str]] = []
    s.model.observe(seen.append)
    write_run(path, STEPS[10:15])  # training went on
    s.refresh_button.click()
    assert s.error is None
    assert s.model.steps == STEPS[:15]
    assert list(s.slider.options) == STEPS[:15]
    assert s.play.max == 14
    assert s.model.step == 10  # stays where the user was
    assert "steps" in seen[-1]
    assert "step" not in seen[-1]
    s.slider.value = 15
    assert "step 15 ·" in s.label.value


def test_a_run_without_metrics_and_a_single_step(tmp_path: Path) -> None:
    from dstt.store import LocalStorage, save

    storage = LocalStorage(tmp_path / "run", create=True, durability="none")
    save(storage, 7, {"params/w": np.arange(6, dtype=np.float32).reshape(2, 3)})
    s = W.scrubber(dstt.open(tmp_path / "run"))
    assert s.error is None
    assert s.model.metric is None
    assert s.model.spikes == []
    assert s.model.steps == [7]
    assert s.play.max == 0
    assert "step 7 ·" in s.label.value
    assert "loss" not in s.label.value
    assert s.views["loss"].artists == {}
    assert s.views["change"].artists == {}
    np.testing.assert_array_equal(
        s.views["tensor"].artists["image"].get_array(), np.arange(6).reshape(2, 3)
    )
    s.next_button.click()
    assert s.model.step == 7
    assert s.error is None


def test_change_views_work_after_the_timeline_they_were_written_on_is_renamed(
    tmp_path: Path,
) -> None:
    """Commits keep the timeline name they were written under; the views must read along
    the timeline the user is looking at, not that (renamed) name."""
    path = tmp_path / "run"
    write_run(path, list(range(1, 9)))
    run = dstt.open(path)
    run.rename_timeline("main", "base")
    run.refresh()
    change = dstt.plots.step_change(run, 5)  # from the summaries
    exact = dstt.plots.step_change(run, 5, reference=3)  # both commits diffed
    assert change.attrs["reference"] == 4
    assert exact.attrs["timeline"] == "base"
    assert np.isfinite(exact["delta_l2"].values).all()
    cmp = W.compare(run, 3, 6)
    assert cmp.model.diff.attrs["timeline"] == "base"
