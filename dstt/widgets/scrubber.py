"""``dstt.widgets.scrubber(run)``: travel through a run's steps in JupyterLab.

A ``Play`` button jslinked to the step slider (playback runs in the browser), pickers, a
values/change toggle and reference pins over three views: the loss curve, the selected tensor
and per-tensor change versus the reference; with ``replay=`` a replay panel
(:mod:`dstt.widgets.replay_panel`). All state lives in
:class:`~dstt.widgets.model.ScrubberModel`; this class only mirrors it into widgets and back.
Rejected alternative: ``interactive_output`` over the slider — it re-runs one big function per
change, so moving the step would redraw (and re-read) everything, where here the model's
change set decides which views to redraw. Layout in full: docs/decisions.md.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from dstt._optional import require

from .model import Mode, ScrubberModel
from .replay_panel import ReplayPanel, ReplayWith, error_html
from .views import (
    FigureView,
    animate_change,
    animate_loss,
    animate_shown,
    draw_change,
    draw_loss,
    draw_shown,
    move_cursor,
    update_change,
    update_shown,
)

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["Scrubber", "scrubber"]

#: which views each model field invalidates
_REDRAW = {
    "timeline": {"loss", "tensor", "change"},
    "metrics": {"loss"},
    "steps": {"loss"},
    "step": {"loss", "tensor", "change"},
    "tensor": {"tensor", "change"},
    "mode": {"tensor"},
    "reference": {"loss", "tensor", "change"},
}


class Scrubber:
    """The scrubber widget over a :class:`ScrubberModel`; display it (last expression of a
    cell) or use ``.widget``. ``.model`` holds the state; ``.views`` the figures."""

    def __init__(
        self, model: ScrubberModel, *, play_interval: int = 700, replay: ReplayWith | None = None
    ) -> None:
        w = require("ipywidgets", "dstt.widgets.scrubber")
        self.model = model
        self.error: BaseException | None = None
        self._syncing = False
        m = model
        self.slider = w.SelectionSlider(
            options=m.steps,
            value=m.step,
            description="step",
            continuous_update=False,
            layout=w.Layout(width="55%"),
        )
        self.play = w.Play(
            min=0,
            max=len(m.steps) - 1,
            value=m.index,
            step=1,
            interval=play_interval,
            description="play",
        )
        self.link = w.jslink((self.play, "value"), (self.slider, "index"))

        def button(description: str, tooltip: str | None = None, width: str = "3em") -> Any:  # noqa: ANN401 - a Button
            return w.Button(description=description, tooltip=tooltip, layout=w.Layout(width=width))

        self.prev_button = button("◀", "previous step")
        self.next_button = button("▶", "next step")
        self.timeline_picker = w.Dropdown(
            options=m.timelines, value=m.timeline, description="timeline"
        )
        self.tensor_picker = w.Dropdown(
            options=m.tensors, value=m.tensor, description="tensor", layout=w.Layout(width="40%")
        )
        self.mode_picker = w.ToggleButtons(
            options=["values", "change"],
            value=m.mode,
            tooltips=["the tensor at this step", "this step minus the reference step"],
        )
        self.refresh_button = button("⟳", "re-read the run (new steps)")
        self.pin_button = button("pin step as reference", width="auto")
        self.unpin_button = button("reference: previous step", width="auto")
        self.label = w.HTML()
        self.label.add_class("dstt-scrubber-label")
        self.views = {
            "loss": FigureView((8, 2.6)),
            "tensor": FigureView((5, 3.8)),
            "change": FigureView((5, 3.8)),
        }
        self.images = {k: w.Image(format="png") for k in self.views}
        for k, img in self.images.items():
            img.add_class(f"dstt-view-{k}")  # for tests and user CSS
        #: one-click replay of the step under the cursor (``replay=``), else None
        self.replay = ReplayPanel(model, replay) if replay is not None else None
        self._wire()
        self.widget = w.VBox(
            [
                w.HBox([self.play, self.prev_button, self.slider, self.next_button]),
                w.HBox([self.timeline_picker, self.tensor_picker, self.refresh_button]),
                w.HBox([self.mode_picker, self.pin_button, self.unpin_button]),
                self.label,
                self.images["loss"],
                w.HBox([self.images["tensor"], self.images["change"]]),
                *([self.replay.widget] if self.replay is not None else []),
            ]
        )
        self.widget.add_class("dstt-scrubber")
        self._redraw(set(self.views))

    # -- display ----------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs: Any) -> Any:  # noqa: ANN401 - ipywidgets' bundle
        return self.widget._repr_mimebundle_(**kwargs)

    @property
    def figures(self) -> dict[str, Any]:
        """The matplotlib figures by view name (``loss``, ``tensor``, ``change``)."""
        return {k: v.fig for k, v in self.views.items()}

    # -- wiring -----------------------------------------------------------------------------
    def _wire(self) -> None:
        m = self.model

        def from_widget(field: str) -> Callable[[dict[str, Any]], None]:
            def handler(change: dict[str, Any]) -> None:  # the model's setter checks the value
                if not self._syncing:
                    self._guard(lambda: setattr(m, field, change["new"]))

            return handler

        self.slider.observe(from_widget("step"), "value")
        self.timeline_picker.observe(from_widget("timeline"), "value")
        self.tensor_picker.observe(from_widget("tensor"), "value")
        self.mode_picker.observe(from_widget("mode"), "value")
        self.prev_button.on_click(lambda _: self._guard(lambda: m.next(-1)))
        self.next_button.on_click(lambda _: self._guard(lambda: m.next(1)))
        self.pin_button.on_click(lambda _: self._guard(lambda: setattr(m, "reference", m.step)))
        self.unpin_button.on_click(lambda _: self._guard(lambda: setattr(m, "reference", None)))
        self.refresh_button.on_click(lambda _: self._guard(m.refresh))
        m.observe(self._on_model)

    def _guard(self, fn: Callable[[], object]) -> None:
        """Run a widget-triggered action; show an error in the label instead of losing it in
        the kernel log (``.error`` keeps it for tests)."""
        try:
            fn()
        except Exception as e:
            self.error = e
            self.label.value = error_html("error", e)

    def _on_model(self, changed: set[str]) -> None:
        m = self.model
        self._syncing = True
        try:
            if "steps" in changed:
                self.slider.options = m.steps
                self.play.max = len(m.steps) - 1
            if self.slider.value != m.step:
                self.slider.value = m.step
            if self.play.value != m.index:
                self.play.value = m.index
            if {"step", "timeline"} & changed:
                names = m.tensors
                if list(self.tensor_picker.options) != names:
                    self.tensor_picker.options = names
            if self.tensor_picker.value != m.tensor:
                self.tensor_picker.value = m.tensor
            if list(self.timeline_picker.options) != m.timelines:
                self.timeline_picker.options = m.timelines
            if self.timeline_picker.value != m.timeline:
                self.timeline_picker.value = m.timeline
            if self.mode_picker.value != m.mode:
                self.mode_picker.value = m.mode
        finally:
            self._syncing = False
        which = set().union(*(_REDRAW.get(c, set()) for c in changed))
        # a step change (its tensor may follow) moves only the loss view's cursor
        moved = changed <= {"step", "tensor"} and "step" in changed
        for name, fits, update in (
            ("loss", moved, move_cursor),
            ("tensor", changed == {"step"}, update_shown),  # the same tensor
            ("change", moved, update_change),  # as many bars: the same axes
        ):
            if fits and update(self.views[name], m):
                self.images[name].value = self.views[name].png()
                which.discard(name)
        self._redraw(which)

    def _redraw(self, which: set[str]) -> None:
        m = self.model
        for name, draw, animate in (
            ("loss", draw_loss, animate_loss),
            ("tensor", draw_shown, animate_shown),
            ("change", draw_change, animate_change),
        ):
            if name in which:
                view = self.views[name]
                view.redraw(lambda ax, f=draw: f(ax, m))  # type: ignore[misc]
                animate(view)
                self.images[name].value = view.png()
        if self.replay is not None:
            self.replay.update()
        spike = " spike" if m.spike is not None else ""
        self.label.value = (
            f"<span class='dstt-step{spike}' data-step='{m.step}'>{html.escape(m.label())}</span>"
        )
        self.error = None


def scrubber(
    run: Any,  # noqa: ANN401 - a dstt.Run, or what dstt.open takes
    *,
    timeline: str | None = None,
    step: int | None = None,
    tensor: str | None = None,
    metric: str | None = None,
    reference: int | None = None,
    mode: Mode = "values",
    cache_size: int = 16,
    spike_window: int | None = None,
    spike_z: float | None = None,
    max_side: int = 256,
    play_interval: int = 700,
    spike: Any = None,  # noqa: ANN401 - a Spike or a loss step
    replay: ReplayWith | None = None,
    prefetch: int = 1,
) -> Scrubber:
    """A step scrubber over ``run`` (a :class:`dstt.Run` or a path).

    Starts at ``step`` (default: the head) of ``timeline`` (default: current) showing
    ``tensor`` (default: the first parameter). ``reference`` pins the step that changes are
    measured against (default: the previous committed step). ``cache_size`` steps' data are
    kept in an LRU, and the ``prefetch`` committed steps on each side of the one shown are
    loaded into it in a background thread (0: none); tensors are subsampled to at most
    ``max_side`` rows/columns.
    Spikes of ``metric`` (default ``loss``) use :meth:`dstt.Run.spikes` with
    ``spike_window`` / ``spike_z`` (its ``window``/``z``; None: the rule's defaults).
    ``spike`` (a ``Spike`` from ``run.spikes()``, or the loss step of a detected one) opens
    on the update that caused it, *(k - 2) -> (k - 1)* (:meth:`ScrubberModel.open_spike`).
    ``replay`` (the keyword arguments of :meth:`dstt.Run.replay` — ``model``, ``optimizer``,
    ``loss_fn``, ``dataset``, … — or a callable step -> ``Replay``) adds a button that replays
    the spike or step under the cursor and shows its gradient norms and worst samples
    (:class:`~dstt.widgets.replay_panel.ReplayPanel`).
    """
    if not hasattr(run, "steps"):
        from dstt.run import open_run

        run = open_run(run)
    model = ScrubberModel(
        run,
        timeline=timeline,
        step=step,
        tensor=tensor,
        metric=metric,
        reference=reference,
        mode=mode,
        cache_size=cache_size,
        spike_window=spike_window,
        spike_z=spike_z,
        max_side=max_side,
        prefetch=prefetch,
    )
    if spike is not None:
        model.open_spike(spike)
    return Scrubber(model, play_interval=play_interval, replay=replay)
