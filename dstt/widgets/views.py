"""Figures of the scrubber and compare widgets: matplotlib ``Figure`` objects rendered to PNG.

Each view owns one ``matplotlib.figure.Figure`` (not pyplot: no global figure registry, no
inline backend printing stray copies) and a dict of the artists of its last drawing, which
tests assert on. The widget shows ``view.png()`` in an ``ipywidgets.Image``.

Rejected alternative: ``Output`` + ``display(fig)`` — it needs a live kernel to route the
output (in plain pytest it prints a repr), flickers on ``clear_output``, and leaves nothing to
assert on but a MIME bundle.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt._lru import LRU
from dstt._optional import require
from dstt.plots.draw import (
    SPIKE_COLOR,
    as_matrix,
    draw_bars,
    draw_curves,
    draw_message,
    draw_tensor,
)
from dstt.plots.series import exactness_label, ranked

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from matplotlib.axes import Axes

    from .model import ScrubberModel

__all__ = [
    "FigureView",
    "NameStrip",
    "animate_change",
    "animate_loss",
    "animate_shown",
    "draw_change",
    "draw_loss",
    "draw_shown",
    "move_cursor",
    "update_change",
    "update_shown",
]

TOP_BARS = 24


class FigureView:
    """One figure, redrawn from scratch by a draw function; ``artists`` of the last draw.

    Margins are set by hand (``left`` grows with the longest tick label): constrained layout
    would double the cost of every frame (it draws the figure once more to measure it).

    A step change need not re-render what stays: :meth:`animate` names the artists that move
    (the loss cursor, the heatmap and its colorbar); :meth:`png` renders the rest once, keeps
    those pixels, and later frames paste them back and draw only the moving artists (blitting).
    Every frame goes through that same path, so a frame's bytes depend only on what is shown,
    not on how the view got there. :meth:`redraw` drops the kept pixels.
    """

    def __init__(self, figsize: tuple[float, float], dpi: int = 80) -> None:
        figure = require("matplotlib.figure", "dstt.widgets")
        agg = require("matplotlib.backends.backend_agg", "dstt.widgets")
        self.fig = figure.Figure(figsize=figsize, dpi=dpi)
        self.canvas = agg.FigureCanvasAgg(self.fig)
        self.artists: dict[str, Any] = {}
        #: full renders of the static part (a blitted frame does not count)
        self.full_renders = 0
        self._moving: list[Any] = []
        self._background: Any = None

    @property
    def ax(self) -> Axes | None:
        return self.fig.axes[0] if self.fig.axes else None

    def redraw(self, draw: Callable[[Any], dict[str, Any]], ncols: int = 1) -> None:
        """Clear the figure, call ``draw(axes)`` (``ncols`` > 1: a row of that many axes),
        keep the artists it returns."""
        self.fig.clear()
        self._moving, self._background = [], None
        self.artists = draw(self.fig.subplots(1, ncols))
        self.fit()

    def animate(self, *artists: Any) -> None:
        """Mark ``artists`` as the moving part: drawn over the kept static pixels each frame."""
        for a in artists:
            a.set_animated(True)
            if a not in self._moving:
                self._moving.append(a)
        self._background = None

    def fit(self, labels: Sequence[str] | None = None, fontsize: float = 8.0) -> None:
        """Left margin for the longest y tick label (0.6 em per character), at most 45%;
        ``labels`` (in ``fontsize`` points) stand for tick labels drawn another way."""
        dpi = self.fig.dpi
        width_px = self.fig.get_figwidth() * dpi
        sized = (
            [(fontsize, t) for t in labels]
            if labels is not None
            else [
                (t.get_fontsize(), t.get_text())
                for ax in self.fig.axes[:1]
                for t in ax.get_yticklabels()
            ]
        )
        longest = max(
            (0.6 * size * dpi / 72 * max(len(text), 4) for size, text in sized), default=30.0
        )
        left = min(0.45, (longest + 30) / width_px)
        if left != self.fig.subplotpars.left or self._background is None:
            self.fig.subplots_adjust(left=left, right=0.97, bottom=0.17, top=0.9, wspace=0.35)
            self._background = None

    def png(self) -> bytes:
        """The figure as PNG: the static part (rendered only when it changed) and the moving
        artists over it."""
        image = require("PIL.Image", "dstt.widgets")
        canvas = self.canvas
        if self._background is None:
            canvas.draw()  # animated artists are left out of a full draw
            self._background = canvas.copy_from_bbox(self.fig.bbox)
            self.full_renders += 1
        else:
            canvas.restore_region(self._background)
        for a in self._moving:
            if a.figure is self.fig and a.get_visible():
                self.fig.draw_artist(a)
        w, h = canvas.get_width_height(physical=True)
        frame = image.frombuffer("RGBA", (w, h), bytes(canvas.buffer_rgba()), "raw", "RGBA", 0, 1)
        buf = io.BytesIO()
        frame.save(buf, format="png", compress_level=1)
        return buf.getvalue()


def draw_loss(ax: Axes, model: ScrubberModel) -> dict[str, Any]:
    """The metric of the model's timeline, its spikes (▼ at the loss step, the update that
    caused each shaded: ``parent -> cause``), and the current step's cursor."""
    if model.metric is None:
        draw_message(ax, "no metrics logged (s.log(loss=...))")
        return {}
    ds = model.metrics
    curves = [(model.timeline, ds["step"].values, ds[model.metric].values)]
    spikes = [(s.step, s.value) for s in model.spikes]
    causes = [s.update for s in model.spikes if s.update is not None]
    out = draw_curves(
        ax, curves, spikes=spikes, causes=causes, cursor=model.step, ylabel=model.metric
    )
    if (ref := model.reference) is not None:
        out["reference"] = ax.axvline(ref, color="tab:green", ls=":", lw=1.2)
    ax.set_title(f"{model.metric} · step {model.step}", fontsize="medium")
    return out


def move_cursor(view: FigureView, model: ScrubberModel) -> bool:
    """Move the loss view's cursor (line, point, title) to the model's step in place — the
    curves, spikes, axes and their ticks stay, so a step change neither rebuilds the axes nor
    lays out new ticks (most of a frame's cost). False: nothing to move, redraw the view."""
    a, ax = view.artists, view.ax
    cursor = a.get("cursor")
    if cursor is None or ax is None or model.metric is None:
        return False
    cursor.set_xdata([model.step, model.step])
    ds = model.metrics
    hit = np.flatnonzero(ds["step"].values == model.step)
    xy: tuple[list[float], list[float]] = ([], [])
    if hit.size:
        xy = ([model.step], [float(ds[model.metric].values[hit[0]])])
    point = a.get("point")
    if point is not None:
        point.set_data(*xy)
    elif hit.size:
        limits = ax.get_xlim(), ax.get_ylim()
        (a["point"],) = ax.plot(*xy, "o", color="0.1", ms=6, zorder=5)
        ax.set_xlim(*limits[0])
        ax.set_ylim(*limits[1])
        view.animate(a["point"])
    ax.set_title(f"{model.metric} · step {model.step}", fontsize="medium")
    return True


def animate_loss(view: FigureView) -> None:
    """The loss view's moving part: the cursor, its point, the legend (drawn over the
    cursor, and placed where it hides least of the curves and the cursor, as in a full draw)
    and the title."""
    ax = view.ax
    moving = [view.artists[k] for k in ("cursor", "point") if k in view.artists]
    if moving and ax is not None:
        legend = ax.get_legend()
        view.animate(*moving, *([legend] if legend is not None else []), ax.title)


def animate_shown(view: FigureView) -> None:
    """The heatmap's moving part: the image, its colorbar (whose ticks follow the colour
    limits), the frame drawn over the image, and the title; a histogram or a message has
    none."""
    ax, image, bar = view.ax, view.artists.get("image"), view.artists.get("colorbar")
    if ax is not None and image is not None and bar is not None:
        view.animate(image, *ax.spines.values(), bar.ax, ax.title)


def draw_shown(ax: Axes, model: ScrubberModel) -> dict[str, Any]:
    """The current tensor (or its change since the reference) as heatmap or histogram."""
    values, title = model.shown()
    if values is None:
        draw_message(ax, title, wrap=True)
        return {}
    return draw_tensor(ax, values, title=title, diverging=model.mode == "change")


def update_shown(view: FigureView, model: ScrubberModel) -> bool:
    """Put the model's current tensor into the heatmap already drawn (data, colour limits as
    ``draw_tensor`` sets them, title) when it has the same shape and colour map: no new axes,
    colorbar or ticks. False: draw the view anew."""
    image, ax = view.artists.get("image"), view.ax
    if image is None or ax is None:
        return False
    values, title = model.shown()
    if values is None or np.ndim(values) < 2 or np.size(values) == 1:
        return False
    m = as_matrix(np.asarray(values))
    diverging = model.mode == "change"
    if m.shape != image.get_array().shape or diverging != (image.get_cmap().name == "RdBu_r"):
        return False
    finite = m[np.isfinite(m)]
    if not finite.size:
        return False
    image.set_data(m)
    if diverging:
        lim = float(np.max(np.abs(finite)))
        image.set_clim(-lim or -1.0, lim or 1.0)
    else:
        image.set_clim(float(finite.min()), float(finite.max()))
    ax.set_title(title, fontsize="medium")
    return True


def _change_bars(model: ScrubberModel, top: int) -> tuple[list[str], np.ndarray, str, str] | str:
    """The change view's bars (names, ratios, x label, title), or the message to show."""
    ds = model.change()
    ref = ds.attrs.get("reference")
    if ref is None:
        return f"step {model.step}: no earlier step to compare with"
    names = [str(n) for n in ds["tensor"].values]
    ratio = ds["ratio"].values.astype(float)
    order = list(ranked(ratio)[:top])
    if model.tensor in names and names.index(model.tensor) not in order:
        order[-1] = names.index(model.tensor)
    kind = exactness_label(ds.attrs.get("exactness", ""))
    return (
        [names[i] for i in order],
        ratio[order],
        f"‖Δw‖ / ‖w‖ ({kind})",
        f"change {ref} → {model.step} ({kind})",
    )


def draw_change(ax: Axes, model: ScrubberModel, top: int = TOP_BARS) -> dict[str, Any]:
    """Per-parameter ``||Δw|| / ||w||`` versus the reference, largest ``top`` first, labelled
    an estimate where it comes from the summaries' probes (exact where they are); the
    selected tensor is highlighted (and always shown)."""
    bars = _change_bars(model, top)
    if isinstance(bars, str):
        draw_message(ax, bars)
        return {}
    names, ratios, xlabel, title = bars
    out = draw_bars(ax, names, ratios, xlabel=xlabel, highlight=model.tensor, title=title)
    return {**out, "names": names, "ratios": ratios}


class NameStrip:
    """The change view's bar names drawn as one image composed from a bitmap per name, each
    rendered once (cached by name): matplotlib lays out and rasterises text glyph by glyph in
    Python, so two dozen tick labels were most of a frame, and the names repeat from step to
    step in another order. The axes' own tick labels keep the names (hidden), so
    ``get_yticklabels`` and the margin still see them.

    Rejected alternative: a fixed bar order (static labels) — the view ranks the tensors by
    change, which is what it is for."""

    def __init__(self, view: FigureView) -> None:
        self.view = view
        self.bitmaps: LRU[tuple[str, int, int], np.ndarray] = LRU(4096)
        self._agg = require("matplotlib.backends.backend_agg", "dstt.widgets")
        self.image: Any = None

    def _bitmap(self, name: str, width: int, height: int, size: float, color: Any) -> np.ndarray:  # noqa: ANN401
        def render() -> np.ndarray:
            figure = require("matplotlib.figure", "dstt.widgets")
            dpi = self.view.fig.dpi
            fig = figure.Figure(figsize=(width / dpi, height / dpi), dpi=dpi)
            fig.patch.set_alpha(0.0)
            canvas = self._agg.FigureCanvasAgg(fig)
            fig.text(1.0, 0.5, name, ha="right", va="center_baseline", fontsize=size, color=color)
            canvas.draw()
            return np.asarray(canvas.buffer_rgba()).copy()

        return self.bitmaps.get_or_make((name, width, height), render)

    def attach(self, ax: Axes, names: Sequence[str]) -> None:
        """Blank ``ax``'s y tick labels (their font kept) and draw ``names`` instead."""
        labels = ax.get_yticklabels()
        self.fontsize = float(labels[0].get_fontsize()) if labels else 8.0
        self._color = labels[0].get_color() if labels else "black"
        ax.yaxis.set_ticklabels([""] * len(ax.get_yticks()))
        self.image = self.view.fig.figimage(np.zeros((1, 1, 4), np.uint8), origin="upper")
        self.update(ax, names)

    def update(self, ax: Axes, names: Sequence[str]) -> None:
        """Compose ``names`` at ``ax``'s y ticks, right-aligned where tick labels go."""
        fig = self.view.fig
        height = round(fig.bbox.height)
        ticks = ax.yaxis.get_major_ticks()
        # where the tick labels' right edges are (the axes' left, less tick and pad)
        right = round(ticks[0].label1.get_transform().transform((0, 0))[0]) if ticks else 0
        strip = np.zeros((height, max(right, 1), 4), np.uint8)
        line = int(self.fontsize * fig.dpi / 72 * 2.2) + 2
        ys = ax.transData.transform(np.c_[np.zeros(len(names)), np.arange(len(names))])[:, 1]
        for name, y in zip(names, ys, strict=True):
            if not name or right <= 0:
                continue
            bm = self._bitmap(name, right, line, self.fontsize, self._color)
            top = round(height - y) - line // 2
            lo, hi = max(top, 0), min(top + line, height)
            if lo < hi:
                src, dst = bm[lo - top : hi - top], strip[lo:hi]
                strip[lo:hi] = np.where(src[..., 3:] > dst[..., 3:], src, dst)
        self.image.set_data(strip)
        self.names = list(names)


def animate_change(view: FigureView) -> None:
    """The change view's moving part: the bars, the x axis (ticks, grid, label), the frame,
    the names (a :class:`NameStrip`) and the title; a message has none."""
    ax, bars, names = view.ax, view.artists.get("bars"), view.artists.get("names")
    if ax is None or bars is None or names is None:
        return
    strip = NameStrip(view)
    strip.attach(ax, names)
    view.fit(names, strip.fontsize)
    strip.update(ax, names)
    view.artists["strip"] = strip
    view.animate(*bars, ax.xaxis, *ax.spines.values(), strip.image, ax.title)


def update_change(view: FigureView, model: ScrubberModel, top: int = TOP_BARS) -> bool:
    """Put the model's per-tensor change into the bars already drawn (widths, colours, names,
    x range, titles) when there are as many: the axes stay. False: draw the view anew."""
    old, ax = view.artists.get("bars"), view.ax
    if old is None or ax is None:
        return False
    bars = _change_bars(model, top)
    if isinstance(bars, str) or len(bars[0]) != len(old):
        return False
    names, ratios, xlabel, title = bars
    widths = [float(v) if np.isfinite(v) else 0.0 for v in ratios]
    for patch, name, width in zip(old, names, widths, strict=True):
        patch.set_width(width)
        patch.set_facecolor(SPIKE_COLOR if name == model.tensor else "tab:blue")
    # the bars span 0..width: set the x data limits to that (as ``ax.relim()`` would find,
    # without transforming every patch's path, a third of a frame) and autoscale from there
    ax.dataLim.intervalx = (min(0.0, *widths), max(0.0, *widths))
    ax.autoscale_view()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize="medium")
    strip = view.artists.get("strip")
    if strip is None:
        ax.yaxis.set_ticklabels(names)
        view.fit()
    else:
        view.fit(names, strip.fontsize)
        strip.update(ax, names)
    view.artists["names"], view.artists["ratios"] = names, ratios
    return True
