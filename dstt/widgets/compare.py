"""``dstt.widgets.compare(run, a, b)``: two steps side by side, on one timeline or two.

Typical use after a rollback: ``compare(run, timeline_a="main", timeline_b="main-from-25")``
compares the two heads, or ``compare(run, 40, 40, timeline_a=..., timeline_b=...)`` the same
step on both. Shows both timelines' loss curves with the two steps marked, the per-parameter
change ``||w_b - w_a|| / ||w_a||`` (exact, streamed by :mod:`dstt.inspect.compare`) ranked, and
the selected tensor at A, at B and B - A.

:class:`CompareModel` holds the state (plain Python, tested without widgets); :class:`Compare`
mirrors it. Rejected alternative: a second scrubber per timeline — two sliders that must be
kept in step by hand; a comparison is about two fixed points, so the pickers choose tensors.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt._optional import require
from dstt.errors import StepNotFoundError, TensorNotFoundError
from dstt.plots.draw import draw_bars, draw_curves, draw_tensor
from dstt.plots.series import diff_headers, ranked
from dstt.schema import user_name

from .model import default_metric, subsample
from .views import TOP_BARS, FigureView

if TYPE_CHECKING:
    from collections.abc import Sequence

    import xarray as xr
    from matplotlib.axes import Axes

    from dstt.run.run import Run
    from dstt.run.snapshot import Snapshot

__all__ = ["Compare", "CompareModel", "compare"]


class CompareModel:
    """Two snapshots (``a``, ``b``), their per-parameter diff, and the selected tensor."""

    def __init__(
        self,
        run: Run,
        step_a: int | None = None,
        step_b: int | None = None,
        *,
        timeline_a: str | None = None,
        timeline_b: str | None = None,
        tensor: str | None = None,
        metric: str | None = None,
        max_side: int = 256,
    ) -> None:
        self.run, self.max_side = run, max_side
        ta = timeline_a or run.timeline
        tb = timeline_b or ta
        self.a, self.b = run.at(step_a, ta), run.at(step_b, tb)
        self.timeline_a, self.timeline_b = ta, tb
        self.diff: xr.Dataset = diff_headers(
            run, self.a.header, self.b.header, timeline=tb, reference_timeline=ta
        )
        pa = {p for p in self.a.arrays if p.startswith("params/")}
        pb = {p for p in self.b.arrays if p.startswith("params/")}
        self.tensors = [user_name(p) for p in sorted(pa & pb)]
        self.metrics = {t: run.metrics(t).to_xarray() for t in dict.fromkeys((ta, tb))}
        self.metric = metric or default_metric(self.metrics[ta])
        self._tensor = self._param(tensor) if tensor is not None else self.ranking()[0][0]

    def _param(self, name: str) -> str:
        """The full name ``name`` means at B (exact, short or tied), if a parameter at both
        steps; ``TensorNotFoundError`` with the closest names otherwise."""
        path = self.b.path(name)
        path = self.b.catalog.tied.get(path, path)  # a tied name shows its tensor
        if user_name(path) not in self.tensors:
            raise TensorNotFoundError(f"{name!r} is not a parameter at both steps")
        return user_name(path)

    @property
    def tensor(self) -> str:
        return self._tensor

    @tensor.setter
    def tensor(self, name: str) -> None:
        self._tensor = self._param(name)

    def ranking(self) -> list[tuple[str, float]]:
        """``(tensor, ratio)`` of the parameters in both, largest relative change first."""
        names = [str(n) for n in self.diff["tensor"].values]
        ratio = self.diff["ratio"].values.astype(float)
        return [(names[i], float(ratio[i])) for i in ranked(ratio) if names[i] in self.tensors]

    def values(self) -> tuple[np.ndarray, np.ndarray]:
        """The selected tensor at A and at B (subsampled like the scrubber's)."""
        a, b = (subsample(s.tensor(self._tensor), self.max_side) for s in (self.a, self.b))
        return a, b

    def label(self) -> str:
        def side(s: Snapshot) -> str:
            v = s.metrics.get(self.metric) if self.metric else None
            m = f" {self.metric} {v:.4g}" if isinstance(v, int | float) else ""
            return f"{s.timeline}@{s.step}{m}"

        r = dict(self.ranking()).get(self._tensor, float("nan"))
        return f"A {side(self.a)} · B {side(self.b)} · {self._tensor}: ‖Δ‖/‖A‖ = {r:.3g}"

    # -- drawing ----------------------------------------------------------------------------
    def draw_loss(self, ax: Axes) -> dict[str, Any]:
        if self.metric is None:
            ax.set_axis_off()
            return {}
        curves = [
            (t, ds["step"].values, ds[self.metric].values)
            for t, ds in self.metrics.items()
            if self.metric in ds
        ]
        out = draw_curves(ax, curves, ylabel=self.metric)
        out["cursor_a"] = ax.axvline(self.a.step, color="tab:blue", ls="--", lw=1)
        out["cursor_b"] = ax.axvline(self.b.step, color="tab:orange", ls="--", lw=1)
        ax.set_title(
            f"A = {self.a.timeline}@{self.a.step}, B = {self.b.timeline}@{self.b.step}",
            fontsize="medium",
        )
        return out

    def draw_ranking(self, ax: Axes) -> dict[str, Any]:
        rows = self.ranking()[:TOP_BARS]
        if self._tensor not in [n for n, _ in rows]:
            rows[-1:] = [(self._tensor, dict(self.ranking())[self._tensor])]
        return draw_bars(
            ax,
            [n for n, _ in rows],
            [r for _, r in rows],
            xlabel="‖B - A‖ / ‖A‖",
            highlight=self._tensor,
            title="relative change per parameter",
        )

    def draw_tensors(self, axes: Sequence[Axes]) -> dict[str, Any]:
        va, vb = self.values()
        out = {
            "a": draw_tensor(axes[0], va, title=f"A: {self.a.step}"),
            "b": draw_tensor(axes[1], vb, title=f"B: {self.b.step}"),
        }
        if va.shape == vb.shape:
            out["delta"] = draw_tensor(
                axes[2], vb.astype(np.float64) - va, title="B - A", diverging=True
            )
        else:
            axes[2].set_axis_off()
        return out


class Compare:
    """The compare widget; ``.model`` holds the state, ``.views`` the figures."""

    def __init__(self, model: CompareModel) -> None:
        w = require("ipywidgets", "dstt.widgets.compare")
        self.model = model
        self.tensor_picker = w.Dropdown(
            options=model.tensors,
            value=model.tensor,
            description="tensor",
            layout=w.Layout(width="50%"),
        )
        self.label = w.HTML()
        self.views = {
            "loss": FigureView((8, 2.6)),
            "ranking": FigureView((8, 3.6)),
            "tensors": FigureView((10, 3.2)),
        }
        self.images = {k: w.Image(format="png") for k in self.views}
        self.tensor_picker.observe(self._on_tensor, "value")
        self.widget = w.VBox([self.tensor_picker, self.label, *self.images.values()])
        self._redraw(set(self.views))

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:  # noqa: ANN401 - ipywidgets' bundle
        return self.widget._repr_mimebundle_(**kwargs)

    def _on_tensor(self, change: dict[str, Any]) -> None:
        self.model.tensor = change["new"]
        self._redraw({"ranking", "tensors"})

    def _redraw(self, which: set[str]) -> None:
        m = self.model
        for name, draw, ncols in (
            ("loss", m.draw_loss, 1),
            ("ranking", m.draw_ranking, 1),
            ("tensors", m.draw_tensors, 3),
        ):
            if name in which:
                self.views[name].redraw(draw, ncols)
                self.images[name].value = self.views[name].png()
        self.label.value = html.escape(m.label())


def compare(
    run: Any,  # noqa: ANN401 - a dstt.Run, or what dstt.open takes
    step_a: int | None = None,
    step_b: int | None = None,
    *,
    timeline_a: str | None = None,
    timeline_b: str | None = None,
    tensor: str | None = None,
    metric: str | None = None,
    max_side: int = 256,
    spike: Any = None,  # noqa: ANN401 - a Spike or a loss step
) -> Compare:
    """Compare step ``step_a`` of ``timeline_a`` with ``step_b`` of ``timeline_b``.

    Timelines default to the run's current one (``timeline_b`` to ``timeline_a``); a step of
    None is that timeline's head. ``tensor`` defaults to the parameter that changed most.
    ``spike`` (a ``Spike`` from ``run.spikes()``) compares the update that caused it:
    ``spike.parent`` -> ``spike.cause`` on its timeline (the loss of step *k* was computed on
    the weights of step *k - 1*, so that is *(k - 2) -> (k - 1)*).
    """
    if not hasattr(run, "steps"):
        from dstt.run import open_run

        run = open_run(run)
    if spike is not None:
        if spike.update is None:
            raise StepNotFoundError(
                f"the update that caused the spike at step {spike.step} was not captured "
                f"(cause {spike.cause}, parent {spike.parent}); compare two steps instead"
            )
        if step_a is not None or step_b is not None:
            raise TypeError("compare(): pass either spike= or the two steps, not both")
        step_a, step_b = spike.update
        timeline_a = timeline_b = spike.timeline or timeline_a
    return Compare(
        CompareModel(
            run,
            step_a,
            step_b,
            timeline_a=timeline_a,
            timeline_b=timeline_b,
            tensor=tensor,
            metric=metric,
            max_side=max_side,
        )
    )
