"""Matplotlib plots of a run, usable in any notebook or script (``import dstt.plots``):
:func:`loss` (a metric per timeline, spikes and causes marked), :func:`update_heatmap`
(per-tensor update ratio over steps), :func:`norms` (weight-norm trajectories),
:func:`layer_change` (per-tensor change versus a reference step), :func:`tensor` (one tensor
as a heatmap or histogram).

Each takes ``ax=`` (or makes a figure through pyplot, so it shows inline) and returns the
``Axes``. The numbers come from ``series`` (write-time summaries when the run has them), the
drawing from ``draw``; :func:`explanation` (``explain``) draws ``run.explain``'s evidence;
matplotlib is imported on first use.

Rejected alternative: ``xarray``'s own ``.plot()`` — it knows nothing of spikes or timelines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dstt._optional import require
from dstt.errors import MetricNotFoundError

from .draw import draw_bars, draw_curves, draw_heatmap, draw_tensor
from .explain import explanation
from .series import exactness_label, param_names, ranked, step_change, tensor_stats

if TYPE_CHECKING:
    from collections.abc import Iterable

    from matplotlib.axes import Axes

    from dstt.run.run import Run

__all__ = [
    "explanation",
    "layer_change",
    "loss",
    "norms",
    "param_names",
    "step_change",
    "tensor",
    "tensor_stats",
    "update_heatmap",
]


def _axes(ax: Axes | None, figsize: tuple[float, float]) -> Axes:
    if ax is not None:
        return ax
    plt = require("matplotlib.pyplot", "dstt.plots")
    _, new = plt.subplots(figsize=figsize, layout="constrained")
    axes: Axes = new
    return axes


def _timelines(run: Run, timelines: str | Iterable[str] | None) -> list[str]:
    if timelines is None:
        return [run.timeline]
    if timelines == "all":
        return sorted(run.timelines, key=lambda t: (t != run.timeline, t))
    return [timelines] if isinstance(timelines, str) else list(timelines)


def _spikes(
    run: Run, metric: str, timeline: str | None, window: int | None, z: float | None
) -> list[Any]:
    if metric not in run.metrics(timeline):
        return []
    return list(run.spikes(metric, window=window, z=z, top=0, timeline=timeline))


def loss(
    run: Run,
    metric: str = "loss",
    *,
    timelines: str | Iterable[str] | None = None,
    spikes: bool = True,
    step: int | None = None,
    window: int | None = None,
    z: float | None = None,
    logy: bool = False,
    ax: Axes | None = None,
) -> Axes:
    """``metric`` over steps for the current timeline (or ``timelines``: names or ``"all"``),
    spikes (:meth:`dstt.Run.spikes` with ``window``/``z``; None: its defaults) marked at
    their loss step and the update that caused each (``parent -> cause``) shaded, ``step``
    as a cursor."""
    ax = _axes(ax, (8, 3.5))
    curves, found = [], []
    for tl in _timelines(run, timelines):
        ds = run.metrics(tl)
        if metric not in ds:
            continue
        curves.append((tl, ds["step"].values, ds[metric].values))
        if spikes:
            found += _spikes(run, metric, tl, window, z)
    if not curves:
        raise MetricNotFoundError(
            f"metric {metric!r} was never logged on {_timelines(run, timelines)}"
        )
    points = sorted({(s.step, s.value) for s in found})
    causes = sorted({s.update for s in found if s.update is not None})
    draw_curves(ax, curves, spikes=points, causes=causes, cursor=step, ylabel=metric, logy=logy)
    return ax


def update_heatmap(
    run: Run,
    steps: slice | int | Iterable[int] | None = None,
    *,
    timeline: str | None = None,
    selector: str | None = None,
    field: str = "update_ratio",
    log: bool = True,
    spikes: str | None = "loss",
    window: int | None = None,
    z: float | None = None,
    ax: Axes | None = None,
) -> Axes:
    """Per-parameter ``field`` (``update_ratio``, ``update_l2`` or ``l2``) over steps as a
    heatmap, labelled ``estimate from probes`` where the update numbers are the summaries'
    estimates (``exact`` where the summaries' are exact or computed from the tensors);
    ``selector`` as in :func:`dstt.plots.series.tensor_stats` (one that picks nothing
    raises); the updates that caused the spikes of metric ``spikes`` (None: none;
    ``window``/``z`` as in :func:`loss`) as dashed lines at ``Spike.cause``: the column whose
    weights produced the bad loss, one step before the loss jumped."""
    ds = tensor_stats(run, steps, timeline=timeline, selector=selector)
    names = [str(n) for n in ds["tensor"].values]
    ax = _axes(ax, (9, max(2.5, 0.18 * len(names) + 1)))
    marks: list[int] = []
    if spikes:
        lo, hi = (int(ds["step"].min()), int(ds["step"].max())) if ds.sizes["step"] else (0, -1)
        found = _spikes(run, spikes, timeline, window, z)
        marks = sorted({int(s.cause) for s in found if s.cause is not None and lo <= s.cause <= hi})
    label = field if field == "l2" else f"{field} ({exactness_label(ds.attrs['update_exactness'])})"
    draw_heatmap(
        ax, ds["step"].values, names, ds[field].values.T, label=label, log=log, marks=marks
    )
    ax.set_title(f"{label} per tensor (from the {ds.attrs.get('source')})", fontsize="medium")
    return ax


def norms(
    run: Run,
    selector: str | None = None,
    steps: slice | int | Iterable[int] | None = None,
    *,
    timeline: str | None = None,
    relative: bool = False,
    legend_max: int = 12,
    ax: Axes | None = None,
) -> Axes:
    """L2 norm of each selected parameter over steps (``relative``: divided by the first)."""
    ds = tensor_stats(run, steps, timeline=timeline, selector=selector)
    ax = _axes(ax, (8, 3.5))
    x = ds["step"].values
    for j, name in enumerate(ds["tensor"].values):
        y = ds["l2"].values[:, j]
        if relative and y.size and np.isfinite(y[0]) and y[0] != 0:
            y = y / y[0]
        ax.plot(x, y, lw=1, label=str(name))
    ax.set_xlabel("step")
    ax.set_ylabel("‖w‖ / ‖w₀‖" if relative else "‖w‖₂")
    ax.grid(alpha=0.3)
    if 0 < ds.sizes["tensor"] <= legend_max:
        ax.legend(fontsize="x-small", loc="best")
    return ax


def layer_change(
    run: Run,
    step: int,
    reference: int | None = None,
    *,
    timeline: str | None = None,
    top: int | None = 30,
    ax: Axes | None = None,
) -> Axes:
    """Bars of ``||w_step - w_ref|| / ||w||`` per parameter (default reference: the previous
    commit: the summaries' number, exact or an estimate, labelled so; another reference:
    exact), largest first, at most ``top`` of them."""
    ds = step_change(run, step, reference, timeline=timeline)
    ratio = ds["ratio"].values
    order = ranked(ratio)[:top]
    ax = _axes(ax, (7, max(2.5, 0.2 * len(order) + 1)))
    ref = ds.attrs.get("reference")
    draw_bars(
        ax,
        [str(ds["tensor"].values[i]) for i in order],
        ratio[order],
        xlabel=f"‖Δw‖ / ‖w‖ ({exactness_label(ds.attrs.get('exactness', ''))})",
        title=f"step {step} vs {ref if ref is not None else '—'}",
    )
    return ax


def tensor(
    values: Any,  # noqa: ANN401 - a DataArray, an array or a tensor
    *,
    title: str | None = None,
    diverging: bool = False,
    ax: Axes | None = None,
) -> Axes:
    """One tensor (numpy array or DataArray): heatmap for rank >= 2, histogram for 1-D."""
    ax = _axes(ax, (6, 4))
    name = title if title is not None else str(getattr(values, "name", "") or "")
    draw_tensor(ax, np.asarray(values), title=name, diverging=diverging)
    return ax
