"""Spike diagnosis past "the loss jumped here": abnormal updates, suspect data, the first
NaN/Inf, gradual divergence — read from the small per-commit objects, never a tensor.

:func:`rank_by_baseline` ranks tensors by how far their update ratio left *their own* recent
baseline (a robust z-score, largest positive first); :func:`suspect` blames the batch
(``"data"``) when the update before the jump was ordinary, else the update (``"update"``);
:func:`first_nonfinite` finds the first commit whose summaries count a NaN or Inf;
:func:`find_divergence` flags a smoothed metric that rises and stays above its running minimum.

Rejected: ranking by absolute ratio (a tensor that always moves a lot hides the one that
changed) and by |z| (a tensor that froze would name itself the culprit). The rules' details
and limits: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence

    import xarray as xr

    from .indexed import SummaryColumns

__all__ = [
    "Divergence",
    "NonFinite",
    "find_divergence",
    "first_nonfinite",
    "grown_tensors",
    "rank_by_baseline",
    "suspect",
]


def rank_by_baseline(
    summaries: xr.Dataset | SummaryColumns,
    step: int,
    *,
    window: int = 20,
    min_periods: int = 3,
) -> list[tuple[str, float, float]]:
    """``(tensor, robust z, update ratio)`` of the update into ``step`` (a commit in
    ``summaries``), most abnormal first by the module's baseline rule: z >= 0 descending,
    then the tensors without a baseline (z NaN) by ratio, then z < 0 (moved less than
    usual) descending; tensors without a known ratio at ``step`` are left out.
    ``summaries`` must hold the commits before ``step`` that form the baseline (``window``
    of them)."""
    if summaries.sizes.get("tensor", 0) == 0:
        return []
    steps = summaries["step"].values
    rows = np.flatnonzero(steps == step)
    if rows.size == 0:
        return []
    i = int(rows[0])
    ratio = summaries["update_ratio"].values
    now = ratio[i]
    base = ratio[max(0, i - window) : i]
    names = summaries["tensor"].values
    out: list[tuple[str, float, float]] = []
    for j in range(len(names)):
        r = float(now[j])
        if not np.isfinite(r):
            continue
        past = base[:, j][np.isfinite(base[:, j])]
        if len(past) < min_periods:
            out.append((str(names[j]), float("nan"), r))
            continue
        med = float(np.median(past))
        mad = float(np.median(np.abs(past - med))) * 1.4826
        scale = max(mad, 0.01 * abs(med), 1e-12)
        out.append((str(names[j]), (r - med) / scale, r))
    above = sorted((t for t in out if np.isfinite(t[1]) and t[1] >= 0), key=lambda t: -t[1])
    without = sorted((t for t in out if not np.isfinite(t[1])), key=lambda t: -t[2])
    below = sorted((t for t in out if np.isfinite(t[1]) and t[1] < 0), key=lambda t: -t[1])
    return above + without + below


def suspect(ranked: Sequence[tuple[str, float, float]], z: float) -> str:
    """``"update"`` when any tensor of the cause update deviated more than ``z`` from its
    baseline, else ``"data"`` (the module's rule)."""
    return "update" if any(np.isfinite(t[1]) and t[1] > z for t in ranked) else "data"


@dataclass(frozen=True)
class NonFinite:
    """The first commit with a NaN or Inf in any tensor: ``step``, the commit before it
    (``parent``; the update ``parent -> step`` produced it), and ``tensors`` as
    ``(name, nan count, inf count)``, most non-finite elements first."""

    step: int
    parent: int | None
    tensors: list[tuple[str, int, int]]

    def __str__(self) -> str:
        names = ", ".join(f"{n} ({a} NaN, {b} Inf)" for n, a, b in self.tensors[:5])
        more = f" and {len(self.tensors) - 5} more" if len(self.tensors) > 5 else ""
        via = f" (update {self.parent} -> {self.step})" if self.parent is not None else ""
        return f"first non-finite values at step {self.step}{via}: {names}{more}"


def first_nonfinite(summaries: xr.Dataset) -> NonFinite | None:
    """The module's first-non-finite rule over ``summaries`` (a timeline's, ascending)."""
    if summaries.sizes.get("step", 0) == 0 or summaries.sizes.get("tensor", 0) == 0:
        return None
    nan = np.nan_to_num(summaries["nan"].values, nan=0.0)
    inf = np.nan_to_num(summaries["inf"].values, nan=0.0)
    bad = (nan + inf) > 0
    rows = np.flatnonzero(bad.any(axis=1))
    if rows.size == 0:
        return None
    i = int(rows[0])
    steps, names = summaries["step"].values, summaries["tensor"].values
    tensors = sorted(
        ((str(names[j]), int(nan[i, j]), int(inf[i, j])) for j in np.flatnonzero(bad[i])),
        key=lambda t: (-(t[1] + t[2]), t[0]),
    )
    return NonFinite(int(steps[i]), int(steps[i - 1]) if i > 0 else None, tensors)


@dataclass(frozen=True)
class Divergence:
    """A sustained rise of a metric (the module's divergence rule): it began at ``start``
    (the smoothed minimum ``minimum``), crossed ``rise`` x that at ``step`` and stayed above
    through ``end`` (smoothed ``value`` there). ``tensors``: ``(name, l2 at end / l2 at
    start)``, most grown first (empty without summaries)."""

    metric: str
    start: int
    step: int
    end: int
    minimum: float
    value: float
    tensors: list[tuple[str, float]] = field(default_factory=list)

    def __str__(self) -> str:
        top = ", ".join(f"{n} (x{g:.3g})" for n, g in self.tensors[:3]) or "no summaries"
        return (
            f"{self.metric} diverges from step {self.start} ({self.minimum:.4g}): above "
            f"x{self.value / self.minimum if self.minimum else float('inf'):.3g} by "
            f"{self.end}, first crossed at {self.step}; weight norms grew most: {top}"
        )


def find_divergence(
    steps: np.ndarray,
    values: np.ndarray,
    *,
    window: int = 20,
    rise: float = 1.5,
    sustain: int | None = None,
) -> list[tuple[int, int, int, float, float]]:
    """``(start, step, end, minimum, smoothed value at end)`` of each stretch by the module's
    divergence rule (``sustain`` defaults to ``window``)."""
    if window < 1 or rise <= 1:
        raise ValueError(f"need window >= 1 and rise > 1, got window={window}, rise={rise}")
    sustain = window if sustain is None else max(1, sustain)
    ok = np.isfinite(values)
    steps, values = np.asarray(steps)[ok], np.asarray(values, dtype=np.float64)[ok]
    if len(values) < window + sustain:
        return []
    smooth = np.array(
        [np.median(values[i - window + 1 : i + 1]) for i in range(window - 1, len(values))]
    )
    at = steps[window - 1 :]
    out: list[tuple[int, int, int, float, float]] = []
    best, best_i = smooth[0], 0
    i = 0
    while i < len(smooth):
        if smooth[i] <= rise * best or best <= 0:
            if smooth[i] < best:
                best, best_i = smooth[i], i
            i += 1
            continue
        j = i
        while j < len(smooth) and smooth[j] > rise * best:
            j += 1
        if j - i >= sustain:
            out.append(
                (int(at[best_i]), int(at[i]), int(at[j - 1]), float(best), float(smooth[j - 1]))
            )
        i = j
    return out


def grown_tensors(summaries: xr.Dataset, start: int, end: int) -> list[tuple[str, float]]:
    """``(tensor, l2 at the last commit <= end / l2 at the last commit <= start)``, most
    grown first; tensors with an unknown or zero norm are left out."""
    if summaries.sizes.get("step", 0) == 0 or summaries.sizes.get("tensor", 0) == 0:
        return []
    steps = summaries["step"].values
    a = np.flatnonzero(steps <= start)
    b = np.flatnonzero(steps <= end)
    if a.size == 0 or b.size == 0:
        return []
    l2 = summaries["l2"].values
    lo, hi = l2[a[-1]], l2[b[-1]]
    names = summaries["tensor"].values
    with np.errstate(divide="ignore", invalid="ignore"):
        g = hi / lo
    keep = [j for j in range(len(names)) if np.isfinite(g[j]) and lo[j] > 0]
    return sorted(((str(names[j]), float(g[j])) for j in keep), key=lambda t: -t[1])
