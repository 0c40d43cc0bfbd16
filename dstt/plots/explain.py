"""A spike's explanation drawn: ``dstt.plots.explanation(ex)``, four panels from its evidence.

Per-sample losses (outliers red, median dashed); the update ratio over tensors x steps (log
colour, the cause dashed); the attention logit bound per layer (the ``likely`` level dashed);
peak ``g²/v`` per tensor (flagged red). A panel whose check was ``unknown`` says
``unknown: <what was missing>`` with no axes — never an empty plot that looks like a finding.
The artists are returned (:class:`ExplanationFigure`) so tests read the numbers back.

Rejected alternatives: the run-level plots per mechanism — they re-read the run, so the picture
could show other steps than the verdict judged; ``Explanation.plot()`` — the run layer sits
below the plots and may not import them, even lazily.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt._optional import require
from dstt.analysis.mechanisms import UNKNOWN

from .draw import SPIKE_COLOR, draw_bars, draw_heatmap, draw_message

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from dstt.analysis.mechanisms import Finding
    from dstt.run.explain import Explanation

__all__ = ["MAX_TENSORS", "NEEDS", "PANELS", "ExplanationFigure", "explanation", "peak_rho"]

#: panel title → the mechanism whose evidence it draws, in drawing order
PANELS = {
    "per-sample losses": "bad_data",
    "update ratio": "update_too_large",
    "attention logit bound": "attention_logit_growth",
    "g²/v": "adam_second_moment",
}
MAX_TENSORS = 40  #: the heat map and the g²/v bars show at most this many tensors (labels too)


@dataclass
class ExplanationFigure:
    """The figure, its ``axes`` by panel title (:data:`PANELS`), and per panel the artists
    drawn (only the ``text`` for a panel that says ``unknown``) and, in ``unknown``, what
    such a panel lacked. No rich repr: a new figure is pyplot's and shows inline once."""

    figure: Figure
    axes: dict[str, Axes]
    artists: dict[str, dict[str, Any]] = field(default_factory=dict)
    unknown: dict[str, str] = field(default_factory=dict)


def explanation(ex: Explanation, *, fig: Figure | None = None) -> ExplanationFigure:
    """Draw the evidence of ``ex`` (a :class:`dstt.run.explain.Explanation`) into ``fig``
    (None: a new pyplot figure, so it shows inline) as the four panels of :data:`PANELS`."""
    if fig is None:
        plt = require("matplotlib.pyplot", "dstt.plots")
        fig = plt.figure(figsize=(12, 7), layout="constrained")
    grid = fig.subplots(2, 2)
    axes = dict(zip(PANELS, grid.ravel(), strict=True))
    out = ExplanationFigure(fig, axes)
    draw = {
        "per-sample losses": _losses,
        "update ratio": _ratios,
        "attention logit bound": _logits,
        "g²/v": _adam,
    }
    for title, mechanism in PANELS.items():
        ax = axes[title]
        f = next((f for f in ex.findings if f.mechanism == mechanism), None)
        missing = _missing(f, title)
        if missing is not None:
            out.unknown[title] = missing
            ax.set_title(f"{title}: unknown", fontsize="medium")
            text = draw_message(
                ax, f"unknown: {missing}", wrap=True, fontsize="small", color="0.35"
            )
            out.artists[title] = {"text": text}
            continue
        assert f is not None  # _missing said so
        out.artists[title] = draw[title](ax, f, ex)
        ax.set_title(f"{title} — {mechanism}: {f.verdict}", fontsize="medium")
    fig.suptitle(
        f"spike at step {ex.step}: update {ex.parent} → {ex.cause} (timeline {ex.timeline!r})",
        fontsize="large",
    )
    return out


#: panel title → the evidence keys it draws
NEEDS = {
    "per-sample losses": ("losses", "indices"),
    "update ratio": ("ratios", "steps", "names"),
    "attention logit bound": ("bound", "steps"),
    "g²/v": ("rho", "steps", "names"),
}


def _missing(f: Finding | None, title: str) -> str | None:
    """Why the panel cannot be drawn (None: it can)."""
    if f is None:
        return f"{PANELS[title]} was not checked"
    if f.verdict == UNKNOWN:
        return f.missing or "the check had no input"
    lacks = [k for k in NEEDS[title] if k not in f.evidence]
    if lacks:
        return f"the finding keeps no {', '.join(lacks)}"
    return None


def _losses(ax: Axes, f: Finding, ex: Explanation) -> dict[str, Any]:
    ev = f.evidence
    loss = np.asarray(ev["losses"], dtype=float)
    idx = [int(i) for i in ev["indices"]]
    bad = set(ev.get("outliers", {}))
    colors = [SPIKE_COLOR if i in bad else "tab:blue" for i in idx]
    x = np.arange(len(loss))
    bars = ax.bar(x, np.where(np.isfinite(loss), loss, 0.0), color=colors)
    median = ax.axhline(float(ev["median_loss"]), color="0.3", ls="--", lw=0.9, label="median")
    if len(idx) <= MAX_TENSORS:
        ax.set_xticks(x, labels=[str(i) for i in idx], rotation=90, fontsize="x-small")
    ax.set_xlabel(f"sample (dataset index) of step {ex.step}'s batch; red: outliers")
    ax.set_ylabel("loss")
    ax.legend(loc="best", fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return {"bars": bars, "median": median, "outliers": [i for i in idx if i in bad]}


def _top_tensors(names: list[str], score: np.ndarray, first: tuple[Any, ...]) -> list[int]:
    """Column indices of at most ``MAX_TENSORS`` tensors: the ones a finding points at,
    then the highest ``score``."""
    at = [names.index(n) for n in first if n in names]
    rest = [int(i) for i in np.argsort(-np.nan_to_num(score, nan=-np.inf), kind="stable")]
    return sorted(list(dict.fromkeys(at + rest))[:MAX_TENSORS])


def _ratios(ax: Axes, f: Finding, ex: Explanation) -> dict[str, Any]:
    ev = f.evidence
    r = np.asarray(ev["ratios"], dtype=float)  # steps x tensors
    names = [str(n) for n in ev["names"]]
    cols = _top_tensors(names, r[-1] if r.size else np.array([]), f.points_at)
    shown = [names[i] for i in cols]
    marks = [ex.cause] if ex.cause is not None else []
    art = draw_heatmap(ax, ev["steps"], shown, r[:, cols].T, label="update ratio", marks=marks)
    art["tensors"] = shown
    return art


def _logits(ax: Axes, f: Finding, ex: Explanation) -> dict[str, Any]:
    ev = f.evidence
    steps = np.asarray(ev["steps"], dtype=float)
    lines = {}
    for layer, ys in ev["bound"].items():
        (lines[layer],) = ax.plot(steps, np.asarray(ys, dtype=float), marker="o", ms=3, label=layer)
    level = ax.axhline(float(ev.get("level", np.nan)), color=SPIKE_COLOR, ls="--", lw=0.9)
    ax.set_xlabel("step (up to the cause's parent)")
    ax.set_ylabel(f"largest logit ({_heads_label(ev.get('heads'))})")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if 0 < len(lines) <= 12:
        ax.legend(loc="best", fontsize="x-small")
    return {"lines": lines, "level": level}


def _heads_label(heads: object) -> str:
    """How the layers were split into heads: ``"4 heads"``, ``"heads per layer"`` or
    ``"projection as one head"`` (head counts unknown)."""
    counts = set(heads.values()) if isinstance(heads, dict) else set()
    if not counts or None in counts:
        return "projection as one head" if counts <= {None} else "heads per layer, some unknown"
    return f"{counts.pop()} heads" if len(counts) == 1 else "heads per layer"


def _adam(ax: Axes, f: Finding, ex: Explanation) -> dict[str, Any]:
    ev = f.evidence
    rho = np.asarray(ev["rho"], dtype=float)  # steps x tensors
    names = [str(n) for n in ev["names"]]
    peak = peak_rho(rho, int(ev.get("recent", 3)))
    cols = _top_tensors(names, peak, f.points_at)
    cols.sort(key=lambda i: -np.nan_to_num(peak[i], nan=-np.inf))
    shown = [names[i] for i in cols]
    art = draw_bars(
        ax,
        shown,
        peak[cols],
        xlabel=f"peak g²/v over the last {ev.get('recent', 3)} steps up to the cause",
        log=True,
    )
    for bar, n in zip(art["bars"], shown, strict=True):
        if n in f.points_at:
            bar.set_color(SPIKE_COLOR)
    art["level"] = ax.axvline(float(ev.get("level", np.nan)), color=SPIKE_COLOR, ls="--", lw=0.9)
    art["tensors"] = shown
    return art


def peak_rho(rho: np.ndarray, recent: int) -> np.ndarray:
    """Per tensor, the largest finite ``g²/v`` of the last ``recent`` rows (NaN: none)."""
    late = np.asarray(rho, dtype=float)[-recent:]
    finite = np.where(np.isfinite(late), late, -np.inf)
    top = finite.max(axis=0) if late.size else np.full(late.shape[1:], -np.inf)
    return np.where(np.isfinite(top), top, np.nan)
