"""Why a loss spiked: one pure check per mechanism the literature names, on plain numpy inputs.

Each check (:func:`bad_data`, :func:`update_too_large`, :func:`attention_logit_growth`,
:func:`adam_second_moment`, :func:`numerics`) takes what its mechanism leaves behind and
returns a :class:`Finding`: ``"likely"``, ``"unlikely"`` or ``"unknown"`` with what was
missing (never a guess), a ``score`` (>= 1 is ``likely``), the evidence arrays it judged (which
:mod:`dstt.plots.explain` draws), what it points at and a hint; :func:`rank` orders them.
Why numpy-only functions of arrays: each rule is unit-tested on synthetic arrays, and the run
layer decides what to read. Rejected alternative: checks that read the run themselves — every
test would need a run on disk, and the "what did it read" record would be spread over five
places. Each rule in detail: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

__all__ = [
    "ADAM_RHO",
    "BAD_DATA_Z",
    "LIKELY",
    "LOGIT_GROWTH",
    "LOGIT_LEVEL",
    "MECHANISMS",
    "UNKNOWN",
    "UNLIKELY",
    "UPDATE_JUMP",
    "UPDATE_SHARE",
    "UPDATE_Z",
    "Finding",
    "adam_second_moment",
    "attention_logit_growth",
    "bad_data",
    "g2_from_v",
    "logit_bound",
    "numerics",
    "rank",
    "update_too_large",
]

LIKELY, UNLIKELY, UNKNOWN = "likely", "unlikely", "unknown"
MECHANISMS = (
    "bad_data",
    "update_too_large",
    "attention_logit_growth",
    "adam_second_moment",
    "numerics",
)

BAD_DATA_Z = 6.0  #: robust z-score of a sample's loss against its batch's median
BAD_DATA_SHARE = 0.5  #: at most this share of the batch may be outliers (else: not "a few")
BAD_DATA_FLOOR = 0.05  #: the batch's spread is floored at this share of its median loss
UPDATE_Z = 4.0  #: robust z-score of a tensor's update ratio against its own baseline
UPDATE_JUMP = 2.0  #: ... and at least this many times its baseline median
UPDATE_SHARE = 0.5  #: the share of tensors that must jump at once
LOGIT_GROWTH = 2.0  #: growth of a layer's logit bound over the look-back window
LOGIT_LEVEL = 50.0  #: the logit bound (unit-RMS inputs) the layer must reach
ADAM_RHO = 100.0  #: mean(g²) / mean(v before it) of a tensor at or before the cause
ADAM_QUIET = 10.0  #: the median of that ratio over the earlier steps must stay below this
SCALE_DROP = 16.0  #: a loss scale falling by this factor in the window has collapsed

HINTS = {
    "bad_data": (
        "the batch may hold corrupted or out-of-distribution samples: consider rolling back "
        "before it and skipping them (run.rollback(k, skip_samples=...))"
    ),
    "update_too_large": (
        "the step size may have been too large for the weights: check the learning-rate "
        "schedule (warm-up, a restart) and consider a lower LR from that step"
    ),
    "attention_logit_growth": (
        "attention logits may be growing toward entropy collapse: consider QK-layernorm, "
        "a lower LR on the attention weights, or a z-loss"
    ),
    "adam_second_moment": (
        "Adam's second moment may have decayed during a quiet stretch: consider a larger "
        "Adam eps or a lower beta2 (or clipping the update)"
    ),
    "numerics": (
        "a non-finite value or an overflow may have appeared: consider bf16/fp32 for that "
        "tensor, gradient clipping, or rolling back before the first non-finite step"
    ),
}


@dataclass(frozen=True)
class Finding:
    """One mechanism checked: its ``verdict``, ``score`` (statistic / threshold; NaN when
    unknown), ``evidence`` (the numbers), what it ``points_at`` (tensors, layers or sample
    indices, most suspicious first), a ``hint`` and what it ``read``."""

    mechanism: str
    verdict: str
    score: float
    evidence: dict[str, Any] = field(default_factory=dict)
    points_at: tuple[Any, ...] = ()
    hint: str = ""
    read: tuple[str, ...] = ()

    @property
    def missing(self) -> str | None:
        """What an ``unknown`` verdict lacked (None otherwise)."""
        got = self.evidence.get("missing")
        return str(got) if got is not None else None

    def __str__(self) -> str:
        if self.verdict == UNKNOWN:
            return f"{self.mechanism}: unknown ({self.missing})"
        at = ", ".join(map(str, self.points_at[:3]))
        more = " ..." if len(self.points_at) > 3 else ""
        return f"{self.mechanism}: {self.verdict} (score {self.score:.3g})" + (
            f" at {at}{more}" if at else ""
        )


def _nan(fn: Callable[..., Any], a: np.ndarray, axis: int = 0) -> np.ndarray:
    """``np.nanmedian``/``np.nanmax`` along ``axis`` without the all-NaN warning (NaN there)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.asarray(fn(np.where(np.isfinite(a), a, np.nan), axis=axis), dtype=np.float64)


def _unknown(mechanism: str, missing: str, read: Sequence[str] = ()) -> Finding:
    return Finding(mechanism, UNKNOWN, float("nan"), {"missing": missing}, (), "", tuple(read))


def _judged(
    mechanism: str, score: float, evidence: dict[str, Any], points: tuple[Any, ...]
) -> Finding:
    """The finding of a checked mechanism: ``likely`` (with its hint) when ``score >= 1``."""
    if score >= 1.0:
        return Finding(mechanism, LIKELY, score, evidence, points, HINTS[mechanism])
    return Finding(mechanism, UNLIKELY, score, evidence, points)


def _positive(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
    return float(value)


def bad_data(
    losses: np.ndarray | None,
    indices: Sequence[int] | np.ndarray | None = None,
    *,
    z: float = BAD_DATA_Z,
    max_share: float = BAD_DATA_SHARE,
) -> Finding:
    """A few samples far above their batch: per-sample ``losses`` of the step (``indices``
    their dataset indices; positions when None). Each sample's robust z-score is its loss
    minus the batch median over 1.4826 x the MAD (floored at ``BAD_DATA_FLOOR`` x the
    median); ``likely`` when between one sample and ``max_share`` of the batch exceed ``z``.
    """
    name = "bad_data"
    z = _positive("z", z)
    if losses is None:
        return _unknown(name, "per-sample losses: pass replay objects (replay=dict(model=...))")
    loss = np.asarray(losses, dtype=np.float64).ravel()
    idx = np.arange(len(loss)) if indices is None else np.asarray(indices).ravel()
    if len(idx) != len(loss):
        raise ConfigError(f"indices ({len(idx)}) and losses ({len(loss)}) differ in length")
    ok = np.isfinite(loss)
    if ok.sum() < 3:
        return _unknown(name, f"fewer than 3 finite per-sample losses ({int(ok.sum())})")
    med = float(np.median(loss[ok]))
    mad = 1.4826 * float(np.median(np.abs(loss[ok] - med)))
    scale = max(mad, BAD_DATA_FLOOR * abs(med), 1e-12)
    zs = np.where(ok, (loss - med) / scale, np.inf)  # a non-finite sample loss is an outlier
    out = np.flatnonzero(zs > z)
    out = out[np.argsort(-zs[out], kind="stable")]
    share = len(out) / len(loss)
    top = float(np.max(zs[ok]))
    score = top / z if len(out) > 0 and share <= max_share else min(top / z, 0.99)
    evidence = {
        "median_loss": med,
        "scale": scale,
        "samples": len(loss),
        "outliers": {int(idx[i]): float(loss[i]) for i in out[:20]},
        "outlier_share": share,
        "max_z": top,
        "threshold_z": z,
        "indices": [int(i) for i in idx],
        "losses": [float(x) for x in loss],
    }
    points = tuple(int(idx[i]) for i in out) if score >= 1.0 else ()
    return _judged(name, float(score), evidence, points)


def update_too_large(
    ratios: np.ndarray | None,
    names: Sequence[str],
    *,
    z: float = UPDATE_Z,
    jump: float = UPDATE_JUMP,
    share: float = UPDATE_SHARE,
    steps: Sequence[int] | np.ndarray | None = None,
) -> Finding:
    """Many tensors' updates jump at once: ``ratios`` (steps x tensors) of update ratios,
    the last row the update that caused the spike, the rows before it each tensor's
    baseline. A tensor jumps when its ratio is more than ``z`` robust standard deviations
    (floored at 10 % of the median) and ``jump`` times above its baseline median; ``likely``
    when at least ``share`` of the tensors with a baseline jump. ``steps`` (one per row;
    None: ``0..``) label the matrix kept in ``evidence["ratios"]`` (steps x tensors)."""
    name = "update_too_large"
    z, jump, share = _positive("z", z), _positive("jump", jump), _positive("share", share)
    if ratios is None:
        return _unknown(name, "update ratios: the run has no write-time summaries")
    r = np.asarray(ratios, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != len(names):
        raise ConfigError(f"ratios must be steps x tensors ({len(names)}), got {r.shape}")
    st = np.arange(r.shape[0]) if steps is None else np.asarray(steps)
    if len(st) != r.shape[0]:
        raise ConfigError(f"steps ({len(st)}) must label the rows of ratios ({r.shape[0]})")
    if r.shape[0] < 4:
        return _unknown(name, f"fewer than 3 updates before the cause ({r.shape[0] - 1})")
    cause, base = r[-1], r[:-1]
    enough = np.isfinite(base).sum(axis=0) >= 3
    valid = enough & np.isfinite(cause)
    if not valid.any():
        return _unknown(name, "no finite update ratio at the cause with a baseline behind it")
    with np.errstate(all="ignore"):
        med = _nan(np.nanmedian, base)
        mad = 1.4826 * _nan(np.nanmedian, np.abs(base - med))
        sd = np.maximum(mad, 0.1 * np.abs(med))
        zs = np.where(valid, (cause - med) / np.where(sd > 0, sd, 1e-30), np.nan)
        factor = np.where(valid, cause / np.where(med > 0, med, 1e-30), np.nan)
    hot = valid & (zs > z) & (factor >= jump)
    frac = float(hot.sum() / valid.sum())
    score = frac / share
    order = np.flatnonzero(hot)[np.argsort(-zs[hot], kind="stable")]
    evidence = {
        "jumped": int(hot.sum()),
        "tensors": int(valid.sum()),
        "share": frac,
        "median_factor": float(np.median(factor[valid])),
        "top": {
            names[i]: {"ratio": float(cause[i]), "baseline": float(med[i]), "z": float(zs[i])}
            for i in order[:10]
        },
        "steps": [int(x) for x in st],
        "names": list(names),
        "ratios": r.tolist(),
    }
    return _judged(name, score, evidence, tuple(names[i] for i in order))


def logit_bound(wq: np.ndarray, wk: np.ndarray, heads: int) -> float:
    """The largest attention logit a layer can produce for inputs of unit RMS:
    ``max_h ||W_q^h W_k^hᵀ||₂ d / sqrt(d_head)`` over heads (``wq``, ``wk``: torch
    ``Linear`` weights, out x in; with grouped-query attention ``wk`` has fewer rows and
    each of its heads serves ``heads / kv_heads`` query heads). The product's spectral norm
    comes from the small ``R_q R_kᵀ`` of the two QR factors, not the d x d matrix."""
    wq = np.asarray(wq, dtype=np.float64)
    wk = np.asarray(wk, dtype=np.float64)
    if wq.ndim != 2 or wk.ndim != 2 or wq.shape[1] != wk.shape[1]:
        raise ConfigError(f"wq and wk must be out x in matrices, got {wq.shape}, {wk.shape}")
    if heads < 1 or wq.shape[0] % heads:
        raise ConfigError(f"{heads} heads do not divide the {wq.shape[0]} query rows")
    dh = wq.shape[0] // heads
    if wk.shape[0] % dh:
        raise ConfigError(f"key rows {wk.shape[0]} are not a multiple of the head size {dh}")
    kv = wk.shape[0] // dh
    d = wq.shape[1]
    best = 0.0
    for h in range(heads):
        q = wq[h * dh : (h + 1) * dh].T  # d x dh
        g = h * kv // heads
        k = wk[g * dh : (g + 1) * dh].T
        rq = np.asarray(np.linalg.qr(q)[1])
        rk = np.asarray(np.linalg.qr(k)[1])
        best = max(best, float(np.linalg.norm(rq @ rk.T, 2)))
    return float(best * d / np.sqrt(dh))


def attention_logit_growth(
    bounds: np.ndarray | None,
    layers: Sequence[str],
    steps: Sequence[int] | np.ndarray,
    *,
    growth: float = LOGIT_GROWTH,
    level: float = LOGIT_LEVEL,
) -> Finding:
    """A layer's attention logits grow before the spike: ``bounds`` (steps x layers) of
    :func:`logit_bound` over the look-back window ending at the cause's *parent* (the
    weights before the bad update: growth, not one jump). ``likely`` when a layer's bound
    grew ``growth`` times over the window and reached ``level``; score: the smaller of the
    two ratios, of the layer where it is largest."""
    name = "attention_logit_growth"
    growth, level = _positive("growth", growth), _positive("level", level)
    if bounds is None or len(layers) == 0:
        return _unknown(name, "query/key weights: no attention projections recognised")
    b = np.asarray(bounds, dtype=np.float64)
    if b.ndim != 2 or b.shape[1] != len(layers) or b.shape[0] != len(steps):
        raise ConfigError(f"bounds must be steps ({len(steps)}) x layers ({len(layers)})")
    if b.shape[0] < 2:
        return _unknown(name, "fewer than 2 committed steps before the spike")
    first, last = b[0], b[-1]
    ok = np.isfinite(first) & np.isfinite(last) & (first > 0)
    if not ok.any():
        return _unknown(name, "no finite query/key weights in the window")
    with np.errstate(all="ignore"):
        g = np.where(ok, last / np.where(first > 0, first, 1.0), np.nan)
        per = np.where(ok, np.minimum(g / growth, last / level), np.nan)
    order = np.argsort(-np.nan_to_num(per, nan=-np.inf), kind="stable")
    score = float(per[order[0]])
    evidence = {
        "steps": [int(s) for s in steps],
        "bound": {layers[i]: [float(x) for x in b[:, i]] for i in range(len(layers))},
        "growth": {layers[i]: float(g[i]) for i in range(len(layers))},
        "level": level,
    }
    return _judged(name, score, evidence, tuple(layers[i] for i in order if per[i] >= 1.0))


def g2_from_v(v_prev: np.ndarray, v_now: np.ndarray, beta2: float) -> np.ndarray:
    """``g²`` of the step from Adam's stored second moments before and after it:
    ``v_t = β₂ v_{t-1} + (1 - β₂) g_t²`` solved for ``g_t²`` (clipped at 0: rounding)."""
    if not 0.0 <= beta2 < 1.0:
        raise ConfigError(f"beta2 must be in [0, 1), got {beta2!r}")
    prev = np.asarray(v_prev, dtype=np.float64)
    now = np.asarray(v_now, dtype=np.float64)
    return np.maximum((now - beta2 * prev) / (1.0 - beta2), 0.0)


def adam_second_moment(
    rho: np.ndarray | None,
    names: Sequence[str],
    steps: Sequence[int] | np.ndarray,
    *,
    recent: int = 3,
    source: str = "stored exp_avg_sq",
    level: float = ADAM_RHO,
    quiet: float = ADAM_QUIET,
) -> Finding:
    """``g²/v`` jumps after a quiet stretch: ``rho`` (steps x tensors) of ``mean(g_t²) /
    mean(v_{t-1})`` per tensor over the look-back window ending at the cause. ``likely``
    when a tensor's ratio over the last ``recent`` steps reaches ``level`` while its median
    over the steps before stayed below ``quiet``; ``source`` says where ``g`` came from."""
    name = "adam_second_moment"
    level, quiet = _positive("level", level), _positive("quiet", quiet)
    if rho is None:
        return _unknown(name, "Adam's exp_avg_sq: the run stores no second moment")
    r = np.asarray(rho, dtype=np.float64)
    if r.ndim != 2 or r.shape[1] != len(names) or r.shape[0] != len(steps):
        raise ConfigError(f"rho must be steps ({len(steps)}) x tensors ({len(names)})")
    if r.shape[0] <= recent:
        return _unknown(name, f"{recent + 1} or more steps with a second moment before them")
    late, early = r[-recent:], r[:-recent]
    peak = _nan(np.nanmax, late)
    base = _nan(np.nanmedian, early)
    ok = np.isfinite(peak) & np.isfinite(base)
    if not ok.any():
        return _unknown(name, "no finite g²/v in the window (non-finite state?)")
    quiet_ok = ok & (base < quiet)
    per = np.where(quiet_ok, peak / level, np.where(ok, np.minimum(peak / level, 0.99), np.nan))
    order = np.argsort(-np.nan_to_num(per, nan=-np.inf), kind="stable")
    score = float(per[order[0]])
    evidence = {
        "g_from": source,
        "steps": [int(s) for s in steps],
        "peak": {names[i]: float(peak[i]) for i in order[:10]},
        "quiet_median": {names[i]: float(base[i]) for i in order[:10]},
        "level": level,
        "recent": recent,
        "names": list(names),
        "rho": r.tolist(),
    }
    return _judged(name, score, evidence, tuple(names[i] for i in order if per[i] >= 1.0))


def numerics(
    steps: Sequence[int] | np.ndarray,
    loss: np.ndarray | None,
    nonfinite: np.ndarray | None,
    names: Sequence[str],
    *,
    loss_scale: np.ndarray | None = None,
    scale_drop: float = SCALE_DROP,
) -> Finding:
    """A non-finite value or an overflow in the window up to the spike: ``loss`` (per step),
    ``nonfinite`` (steps x tensors: NaN + Inf counts of the stored weights), ``loss_scale``
    (per step, a mixed-precision scaler's; None when not logged). ``likely`` when a tensor
    or the loss turns non-finite, or the scale falls ``scale_drop`` times; points at the
    first non-finite tensors."""
    name = "numerics"
    scale_drop = _positive("scale_drop", scale_drop)
    st = np.asarray(steps)
    if loss is None and nonfinite is None and loss_scale is None:
        return _unknown(name, "no logged loss, no summaries' NaN/Inf counts, no loss scale")
    evidence: dict[str, Any] = {}
    points: tuple[Any, ...] = ()
    hits = []
    if nonfinite is not None:
        nf = np.asarray(nonfinite, dtype=np.float64)
        if nf.ndim != 2 or nf.shape != (len(st), len(names)):
            raise ConfigError(f"nonfinite must be steps ({len(st)}) x tensors ({len(names)})")
        rows = np.flatnonzero((np.nan_to_num(nf, nan=1.0) > 0).any(axis=1))
        if rows.size:
            i = int(rows[0])
            bad = np.flatnonzero(np.nan_to_num(nf[i], nan=1.0) > 0)
            points = tuple(names[int(j)] for j in bad)
            evidence["first_nonfinite_step"] = int(st[i])
            evidence["tensors"] = {names[int(j)]: float(nf[i, j]) for j in bad[:10]}
            hits.append(int(st[i]))
    if loss is not None:
        lv = np.asarray(loss, dtype=np.float64)
        rows = np.flatnonzero(~np.isfinite(lv))
        if rows.size:
            evidence["nonfinite_loss_step"] = int(st[rows[0]])
            hits.append(int(st[rows[0]]))
    if loss_scale is not None:
        ls = np.asarray(loss_scale, dtype=np.float64)
        ok = np.isfinite(ls) & (ls > 0)
        if ok.sum() >= 2:
            peak = np.maximum.accumulate(np.where(ok, ls, 0.0))
            fall = np.where(ok, peak / np.where(ok, ls, 1.0), 1.0)  # the peak so far / now
            evidence["loss_scale_drop"] = float(fall.max())
            if fall.max() >= scale_drop:
                hits.append(int(st[int(np.argmax(fall))]))
    score = 10.0 if hits else 0.0  # a non-finite value is decisive, not a matter of degree
    if hits:
        evidence["first_step"] = min(hits)
    return _judged(name, score, evidence, points)


def rank(findings: Sequence[Finding]) -> list[Finding]:
    """``likely`` first (highest score first), then ``unknown``, then ``unlikely`` (highest
    score first): what to look at first, what could not be checked, what was ruled out."""
    order = {LIKELY: 0, UNKNOWN: 1, UNLIKELY: 2}

    def key(f: Finding) -> tuple[int, float]:
        s = f.score if np.isfinite(f.score) else 0.0
        return (order.get(f.verdict, 3), -s)

    return sorted(findings, key=key)
