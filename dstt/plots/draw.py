"""Draw already-computed numbers onto a matplotlib ``Axes``; no run access, no pyplot.

Each ``draw_*`` function takes plain arrays, draws onto the given axes and returns a dict of
the artists it made (``"cursor"``, ``"image"``, ``"bars"``...), so the run-level functions of
:mod:`dstt.plots`, the widgets (which redraw on every step) and the tests (which assert on
``artist.get_xdata()`` / ``image.get_array()``) share one drawing code path.

Rejected alternative: widgets calling the run-level functions — they re-read metrics and
summaries on every redraw; here the widget's model caches the numbers and only drawing repeats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike

if TYPE_CHECKING:
    from collections.abc import Sequence

    from matplotlib.axes import Axes

__all__ = [
    "as_matrix",
    "draw_bars",
    "draw_curves",
    "draw_heatmap",
    "draw_message",
    "draw_tensor",
    "image_strides",
]

Curve = tuple[str, ArrayLike, ArrayLike]
SPIKE_COLOR = "tab:red"
MAX_TICK_LABELS = 48


def image_strides(shape: Sequence[int], max_side: int = 256) -> tuple[int, int]:
    """(row, column) strides that keep a tensor's matrix view within ``max_side`` a side."""
    rows, cols = (1, 1) if not shape else as_matrix_shape(shape)
    return max(1, -(-rows // max_side)), max(1, -(-cols // max_side))


def as_matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """Shape of the 2-D view of a tensor: ``(shape[0], prod(shape[1:]))``; 1-D is one row."""
    if len(shape) == 1:
        return 1, int(shape[0])
    return int(shape[0]), int(np.prod(shape[1:], dtype=np.int64))


def as_matrix(values: np.ndarray) -> np.ndarray:
    """A tensor of any rank >= 2 as a matrix (leading axis kept, the rest flattened)."""
    return values.reshape(as_matrix_shape(values.shape)) if values.ndim > 2 else values


def draw_curves(
    ax: Axes,
    curves: Sequence[Curve],
    *,
    spikes: Sequence[tuple[float, float]] = (),
    causes: Sequence[tuple[float, float]] = (),
    cursor: float | None = None,
    ylabel: str = "",
    logy: bool = False,
) -> dict[str, Any]:
    """Metric curves (label, steps, values), spike markers, the updates that caused them
    (``causes``: ``(parent, cause)`` steps, shaded) and a vertical step cursor.

    Artists: ``lines`` (list), ``spikes`` (``PathCollection``, offsets = (step, value)),
    ``causes`` (list of shaded spans), ``cursor`` (vertical ``Line2D`` at the step) and
    ``point`` (marker on the first curve).
    """
    out: dict[str, Any] = {"lines": [], "causes": []}
    for i, (a, b) in enumerate(causes):
        out["causes"].append(
            ax.axvspan(
                a,
                b,
                color=SPIKE_COLOR,
                alpha=0.18,
                lw=0,
                zorder=1,
                label="update that caused it" if i == 0 else None,
            )
        )
    for label, x, y in curves:
        (line,) = ax.plot(np.asarray(x), np.asarray(y, dtype=float), lw=1.2, label=label)
        out["lines"].append(line)
    sx = np.array([s for s, _ in spikes], dtype=float)
    sy = np.array([v for _, v in spikes], dtype=float)
    out["spikes"] = ax.scatter(
        sx, sy, marker="v", s=60, color=SPIKE_COLOR, zorder=4, label="spike" if len(sx) else None
    )
    if cursor is not None:
        out["cursor"] = ax.axvline(cursor, color="0.2", ls="--", lw=0.9, zorder=3)
        if curves:
            xs, ys = np.asarray(curves[0][1]), np.asarray(curves[0][2], dtype=float)
            hit = np.flatnonzero(xs == cursor)
            if hit.size:
                (out["point"],) = ax.plot([cursor], [ys[hit[0]]], "o", color="0.1", ms=6, zorder=5)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if len(curves) > 1 or len(sx) or out["causes"]:
        ax.legend(loc="best", fontsize="small")
    return out


def draw_message(ax: Axes, text: str, **kw: Any) -> Any:  # noqa: ANN401 - a Text
    """``text`` centred on ``ax`` with its axes hidden: what a view draws instead of a plot."""
    ax.set_axis_off()
    return ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, **kw)


def draw_tensor(
    ax: Axes, values: np.ndarray, *, title: str = "", diverging: bool = False, bins: int = 50
) -> dict[str, Any]:
    """A tensor: heatmap (``image``) for rank >= 2, histogram (``hist``) for 1-D, ``text``
    for a scalar. ``diverging`` centres a red/blue colour map on zero (for differences)."""
    v = np.asarray(values)
    out: dict[str, Any] = {}
    if v.ndim == 0 or v.size == 1:
        out["text"] = draw_message(
            ax, f"{v.reshape(-1)[0]:.6g}" if v.size else "(empty)", fontsize=20
        )
    elif v.ndim == 1:
        finite = v[np.isfinite(v)].astype(np.float64)
        out["hist"] = ax.hist(finite, bins=bins, color="tab:blue", alpha=0.8)[2]
        ax.set_xlabel("value")
        ax.set_ylabel("count")
    else:
        m = as_matrix(v)
        kw: dict[str, Any] = {"cmap": "viridis"}
        if diverging:
            lim = float(np.nanmax(np.abs(m))) if np.isfinite(m).any() else 1.0
            kw = {"cmap": "RdBu_r", "vmin": -lim or -1.0, "vmax": lim or 1.0}
        out["image"] = ax.imshow(m, aspect="auto", interpolation="nearest", **kw)
        out["colorbar"] = ax.figure.colorbar(out["image"], ax=ax)
        ax.set_xlabel("column" if v.ndim == 2 else "flattened trailing axes")
        ax.set_ylabel("row")
    ax.set_title(title, fontsize="medium")
    return out


def draw_bars(
    ax: Axes,
    names: Sequence[str],
    values: ArrayLike,
    *,
    xlabel: str = "",
    highlight: str | None = None,
    log: bool = False,
    title: str = "",
) -> dict[str, Any]:
    """Horizontal bars, one per name (top to bottom in the given order); ``highlight`` one."""
    vals = np.asarray(values, dtype=float)
    y = np.arange(len(names))
    colors = [SPIKE_COLOR if n == highlight else "tab:blue" for n in names]
    bars = ax.barh(y, np.where(np.isfinite(vals), vals, 0.0), color=colors)
    ax.set_yticks(y, labels=list(names), fontsize="x-small")
    ax.invert_yaxis()
    if log and np.any(vals > 0):
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize="medium")
    ax.grid(axis="x", alpha=0.3)
    return {"bars": bars}


def draw_heatmap(
    ax: Axes,
    steps: ArrayLike,
    names: Sequence[str],
    matrix: ArrayLike,
    *,
    label: str = "",
    log: bool = True,
    marks: Sequence[int] = (),
) -> dict[str, Any]:
    """``matrix[tensor, step]`` as a step-aligned heatmap (uneven step spacing is kept), with
    dashed vertical ``marks`` (spikes). Log colour scale over the positive values if ``log``."""
    from matplotlib.colors import LogNorm

    m = np.ma.masked_invalid(np.asarray(matrix, dtype=float))
    x = np.asarray(steps, dtype=float)
    if len(x) > 1:
        mid = (x[1:] + x[:-1]) / 2
        edges = np.concatenate([[x[0] - (mid[0] - x[0])], mid, [x[-1] + (x[-1] - mid[-1])]])
    else:
        edges = np.array([x[0] - 0.5, x[0] + 0.5]) if len(x) else np.array([0.0, 1.0])
    yedges = np.arange(len(names) + 1) - 0.5
    norm = None
    pos = m.compressed()[m.compressed() > 0] if m.count() else np.array([])
    if log and pos.size:
        norm = LogNorm(vmin=float(pos.min()), vmax=float(pos.max()))
        m = np.ma.masked_where(m <= 0, m)
    mesh = ax.pcolormesh(edges, yedges, m, norm=norm, cmap="magma", shading="flat")
    ax.set_ylim(len(names) - 0.5, -0.5)
    if len(names) <= MAX_TICK_LABELS:
        ax.set_yticks(np.arange(len(names)), labels=list(names), fontsize="x-small")
    out: dict[str, Any] = {"mesh": mesh, "marks": []}
    for s in marks:
        out["marks"].append(ax.axvline(s, color="tab:cyan", ls="--", lw=0.9))
    out["colorbar"] = ax.figure.colorbar(mesh, ax=ax, label=label)
    ax.set_xlabel("step")
    return out
