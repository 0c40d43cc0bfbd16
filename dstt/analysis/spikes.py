"""The loss-spike rule: a robust, causal one-step-ahead residual test on the log of the metric.

For step *i*, on ``y = log(value)``: the residual ``r_i = y_i - L_i`` against the local level
``L_i`` (median of the ``SPIKE_LEVEL`` values before *i*); the center and robust scale (median
and 1.4826 x MAD, floored at ``SPIKE_FLOOR``) of the residuals of up to ``window`` steps
before; *i* is flagged when ``(r_i - c_i) / s_i > z`` after ``min_periods`` residuals.
Consecutive flagged steps are one spike at its largest score; every quantity uses values up
to *i* only, so appending steps never changes an earlier verdict (~10 ms for 10,000 steps).

Rejected: a rolling or global z-score of the values (training's trend inflates the scale and
hides spikes); a fitted trend (extrapolation error becomes false alarms); a window sized from
the run's length (not causal). The rule in full: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import numpy as np

from dstt.errors import ConfigError

__all__ = [
    "SPIKE_FLOOR",
    "SPIKE_LEVEL",
    "SPIKE_MIN_PERIODS",
    "SPIKE_SMALL",
    "SPIKE_WINDOW",
    "SPIKE_Z",
    "find_spikes",
]

SPIKE_WINDOW = 100  #: residuals before a step that give its center and scale (at most)
SPIKE_Z = 6.0  #: robust z-score a value must exceed
SPIKE_LEVEL = 5  #: values before a step whose median is its local level
SPIKE_MIN_PERIODS = 10  #: residuals needed before a step is tested
SPIKE_FLOOR = 0.01  #: the scale's floor, relative to the level (1 %)
SPIKE_SMALL = 10.0  #: the scale is widened by sqrt(1 + SPIKE_SMALL / residuals behind it)
_MAD = 1.4826  # MAD -> standard deviation for normal noise
_BLOCK = 16384  # rows per vectorised block (memory: block x window floats, twice)

Spike = tuple[int, float, float, float, float, int]


def _lower_median(a: np.ndarray) -> np.ndarray:
    """Row medians of a 2-D array (the lower middle for an even count): a partition, not a
    sort, and without ``np.median``'s averaging pass."""
    h = (a.shape[1] - 1) // 2
    return np.partition(a, h, axis=1)[:, h]


def _trailing(x: np.ndarray, w: int, minp: int, spread: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(median, MAD)`` of ``x[max(0, i - w):i]`` for each ``i`` (NaN with fewer than
    ``minp`` values; the MAD only when ``spread``)."""
    n = len(x)
    med, mad = np.full((2, n), np.nan)
    for i in range(minp, min(n, w)):  # the first values: the window grows with the run
        prior = x[None, :i]
        m = _lower_median(prior)
        med[i] = m[0]
        if spread:
            mad[i] = _lower_median(np.abs(prior - m[:, None]))[0]
    if n > w:
        views = np.lib.stride_tricks.sliding_window_view(x, w)[: n - w]  # row j: x[j:j+w]
        for lo in range(0, n - w, _BLOCK):
            block = views[lo : lo + _BLOCK]
            m = _lower_median(block)
            med[w + lo : w + lo + len(block)] = m
            if spread:
                mad[w + lo : w + lo + len(block)] = _lower_median(np.abs(block - m[:, None]))
    return med, mad


def _scores(
    y: np.ndarray, window: int, minp: int, log: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(score, baseline, scale)`` of every value of ``y`` (the log of the metric when
    ``log``, else the metric); NaN where too few values precede it."""
    n = len(y)
    score, base, scale = np.full((3, n), np.nan)
    if n < 2:
        return score, base, scale
    level, _ = _trailing(y, SPIKE_LEVEL, 1, spread=False)
    resid = (y - level)[1:]  # resid[j]: the residual of value j + 1
    # float32 for the windows' order statistics: half the bytes to partition, and residuals
    # of a log are O(0.01..1), far above float32's resolution
    center, mad = _trailing(resid.astype(np.float32), window, minp, spread=True)
    # value i = j + 1 is tested against the residuals before it: center[j], mad[j]
    expected = level[1:] + center
    count = np.minimum(np.arange(n - 1), window)  # residuals behind each center and MAD
    widen = np.sqrt(1.0 + SPIKE_SMALL / np.maximum(count, 1))  # few residuals: a wider scale
    if log:
        s = np.maximum(_MAD * mad, SPIKE_FLOOR)
        base[1:] = np.exp(expected)
        scale[1:] = base[1:] * s
    else:
        s = np.maximum(_MAD * mad, SPIKE_FLOOR * np.abs(expected))
        s = np.where(s > 0, s, 1e-12)
        base[1:] = expected
        scale[1:] = s
    score[1:] = (resid - center) / (s * widen)
    return score, base, scale


def _check(window: object, z: object) -> None:
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 2:
        raise ConfigError(
            f"spike window must be an int >= 2 (the steps before a value it is compared "
            f"with), got {window!r}; None picks the default ({SPIKE_WINDOW})"
        )
    if isinstance(z, bool) or not isinstance(z, (int, float)) or not z > 0:
        raise ConfigError(
            f"spike z must be a positive number (robust z-scores above it are spikes), got "
            f"{z!r}; None picks the default ({SPIKE_Z})"
        )


def find_spikes(
    steps: np.ndarray,
    values: np.ndarray,
    *,
    window: int | None = None,
    z: float | None = None,
    min_periods: int | None = None,
) -> list[Spike]:
    """``(step, value, score, baseline, scale, start)`` of each spike of ``values`` (logged at
    ``steps``, ascending) by the module's rule: ``step`` where the score peaked, ``start`` the
    first flagged step, ``baseline`` the value expected there and ``scale`` the noise (both in
    the metric's units). ``window`` (default ``SPIKE_WINDOW``) caps the residuals the scale
    is taken over, ``z`` (default ``SPIKE_Z``) is the threshold, ``min_periods`` (default
    ``min(SPIKE_MIN_PERIODS, window)``) the residuals needed before a value is tested."""
    window = SPIKE_WINDOW if window is None else window
    z = SPIKE_Z if z is None else z
    _check(window, z)
    window = int(window)
    minp = min(SPIKE_MIN_PERIODS, window) if min_periods is None else min_periods
    if isinstance(minp, bool) or not isinstance(minp, (int, np.integer)) or minp < 2:
        raise ConfigError(f"min_periods must be an int >= 2 or None, got {min_periods!r}")
    minp = int(minp)
    v = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(v)
    st, v = np.asarray(steps)[ok], v[ok]
    n = len(v)
    if n == 0:
        return []
    bad = np.flatnonzero(v <= 0)
    first_bad = int(bad[0]) if bad.size else n  # the log holds for every value before it
    score, base, scale = np.full((3, n), np.nan)
    if first_bad:
        got = _scores(np.log(v[:first_bad]), window, minp, log=True)
        score[:first_bad], base[:first_bad], scale[:first_bad] = got
    if first_bad < n:
        got = _scores(v, window, minp, log=False)
        score[first_bad:], base[first_bad:], scale[first_bad:] = (a[first_bad:] for a in got)
    flagged = np.flatnonzero(score > z)  # NaN (too little history) compares False
    events: list[Spike] = []
    last = -2
    for i in flagged.tolist():
        row = (int(st[i]), float(v[i]), float(score[i]), float(base[i]), float(scale[i]))
        if i == last + 1:  # consecutive flagged values: one spike, kept at its peak score
            if row[2] > events[-1][2]:
                events[-1] = (*row, events[-1][5])
        else:
            events.append((*row, int(st[i])))
        last = i
    return events
