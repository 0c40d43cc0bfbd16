"""Predictive coding: store a tensor as the XOR of its bytes and a *prediction* of them.

An Adam(W) step is deterministic given the gradient, which ``exp_avg`` carries: ``exp_avg_sq``
and the parameter are predicted from the update rule and only ``actual XOR predicted`` is
written (mostly zero bits: Blosc shrinks it 15-200x); SGD with momentum predicts the parameter
from its buffer. Lossless: predictors are fixed sequences of single float32 numpy ops (no FMA,
coefficients stored as exact float32), so any reader recomputes the same bits; a wrong
prediction only costs bytes, and every rebuilt chunk is checked against its raw crc32c.

Rejected alternatives: logging gradients and replaying the optimizer (bit-exact replay needs its
exact kernels on the reader's machine); replaying in torch (kernels differ across CPUs and
versions, e.g. FMA in ``lerp``). The rules in detail: docs/decisions.md, "Fewer bytes per step".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PREDICTORS", "Prediction", "adam_predictions", "predict", "sgd_predictions"]

PRED = "pred1"  # encoding name in the arrays table: a Blosc frame of actual XOR predicted

CUR, PREV = "cur", "prev"  # input roles: the same step, or the last committed step


@dataclass(frozen=True)
class Prediction:
    """How one array of one step is predicted (the engine builds these; the store applies).

    ``inputs`` are ``(role, array path)`` pairs: ``"cur"`` is that array in the same step (it
    must be written first), ``"prev"`` its last committed copy. ``group`` names every array
    the prediction ties together (they share keyframes: see ``flatdelta.py``).
    """

    fn: str
    inputs: tuple[tuple[str, str], ...]
    coeffs: tuple[float, ...]
    group: tuple[str, ...]

    def __post_init__(self) -> None:
        spec = PREDICTORS.get(self.fn)
        if spec is None:
            raise ValueError(f"unknown predictor {self.fn!r}; known: {sorted(PREDICTORS)}")
        roles, n_coeffs, _ = spec
        if tuple(r for r, _ in self.inputs) != roles:
            raise ValueError(f"predictor {self.fn!r} takes inputs {roles}, got {self.inputs}")
        if len(self.coeffs) != n_coeffs:
            raise ValueError(
                f"predictor {self.fn!r} takes {n_coeffs} coefficients, got {len(self.coeffs)}"
            )
        if not all(math.isfinite(c) for c in self.coeffs):
            raise ValueError(f"predictor coefficients must be finite, got {self.coeffs}")


def f32(x: float) -> float:
    """``x`` rounded to float32 (exact in JSON: a float32 is a double)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _adam_v(
    prev: np.ndarray,
    inputs: Sequence[np.ndarray],
    c: Sequence[float],
    out: np.ndarray,
    tmp: np.ndarray,
) -> None:
    """exp_avg_sq: g ≈ (m - β1·m_prev) / (1-β1); v ≈ β2·v_prev + (1-β2)·g²."""
    m, m_prev = inputs
    b1, one_minus_b1, b2, one_minus_b2 = (np.float32(x) for x in c)
    with np.errstate(all="ignore"):
        g = np.multiply(m_prev, b1, out=tmp)
        np.subtract(m, g, out=g)
        np.divide(g, one_minus_b1, out=g)
        np.multiply(g, g, out=g)
        np.multiply(g, one_minus_b2, out=g)
        np.multiply(prev, b2, out=out)
        np.add(out, g, out=out)


def _adam_p(
    prev: np.ndarray,
    inputs: Sequence[np.ndarray],
    c: Sequence[float],
    out: np.ndarray,
    tmp: np.ndarray,
) -> None:
    """param: p ≈ p_prev·decay - step_size · m / (sqrt(v)/sqrt(1-β2^t) + eps)."""
    m, v = inputs
    decay, bias2_sqrt, eps, step_size = (np.float32(x) for x in c)
    with np.errstate(all="ignore"):
        d = np.sqrt(v, out=tmp)
        np.divide(d, bias2_sqrt, out=d)
        np.add(d, eps, out=d)
        np.divide(m, d, out=d)
        np.multiply(d, step_size, out=d)
        np.multiply(prev, decay, out=out)
        np.subtract(out, d, out=out)


def _sgd_p(
    prev: np.ndarray,
    inputs: Sequence[np.ndarray],
    c: Sequence[float],
    out: np.ndarray,
    tmp: np.ndarray,
) -> None:
    """param after SGD with momentum: p ≈ p_prev + c·buf (c = -lr; weight decay is in buf)."""
    (buf,) = inputs
    with np.errstate(all="ignore"):
        np.multiply(buf, np.float32(c[0]), out=tmp)
        np.add(prev, tmp, out=out)


Predictor = Callable[
    [np.ndarray, Sequence[np.ndarray], Sequence[float], np.ndarray, np.ndarray], None
]

#: name → (input roles, number of coefficients, function on float32 arrays)
PREDICTORS: dict[str, tuple[tuple[str, ...], int, Predictor]] = {
    "adam_v": ((CUR, PREV), 4, _adam_v),
    "adam_p": ((CUR, CUR), 4, _adam_p),
    "sgd_p": ((CUR,), 1, _sgd_p),
}


def predict(
    fn: str,
    prev: np.ndarray,
    inputs: Sequence[np.ndarray],
    coeffs: Sequence[float],
    out: np.ndarray | None = None,
    tmp: np.ndarray | None = None,
) -> np.ndarray:
    """The predicted raw bytes (uint8) of a chunk from raw uint8 ``prev`` and ``inputs``
    (``out``, ``tmp``: optional uint8 work arrays of the chunk's size; ``out`` is returned)."""
    spec = PREDICTORS.get(fn)
    if spec is None:
        raise ValueError(f"unknown predictor {fn!r}")
    n = prev.nbytes
    if n % 4 or any(x.nbytes != n for x in inputs):
        raise ValueError(
            f"predictor {fn!r}: inputs of {[x.nbytes for x in inputs]} bytes "
            f"do not match the chunk's {n} float32 bytes"
        )
    as32 = [np.frombuffer(x, dtype="<f4") for x in (prev, *inputs)]
    out = np.empty(n, dtype=np.uint8) if out is None else out
    tmp = np.empty(n, dtype=np.uint8) if tmp is None else tmp
    spec[2](as32[0], as32[1:], coeffs, out.view("<f4"), tmp.view("<f4"))
    return out


@functools.lru_cache(maxsize=64)
def _adam_coeffs(
    lr: float,
    b1: float,
    b2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    step: float,
) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The float32 coefficients of ``adam_v`` and ``adam_p`` (cached: every parameter of a
    group shares them, and this runs on the training thread each step)."""
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0 and step >= 1 and math.isfinite(lr)):
        return None
    bias1 = 1.0 - b1**step
    bias2 = 1.0 - b2**step
    if bias1 <= 0.0 or bias2 <= 0.0:
        return None
    decay = 1.0 - lr * weight_decay if decoupled else 1.0
    v = (f32(b1), f32(1.0 - b1), f32(b2), f32(1.0 - b2))
    p = (f32(decay), f32(math.sqrt(bias2)), f32(eps), f32(lr / bias1))
    if not all(math.isfinite(c) for c in (*v, *p)):
        return None
    return v, p


def adam_predictions(
    *,
    param: str,
    exp_avg: str,
    exp_avg_sq: str,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled: bool,
    step: float,
) -> Mapping[str, Prediction]:
    """Predictions of ``exp_avg_sq`` and ``param`` after Adam(W) step number ``step``
    (``lr`` the learning rate that step used). Empty when the hyperparameters are unusable."""
    try:
        coeffs = _adam_coeffs(
            float(lr),
            float(betas[0]),
            float(betas[1]),
            float(eps),
            float(weight_decay),
            bool(decoupled),
            float(step),
        )
    except OverflowError:
        return {}
    if coeffs is None:
        return {}
    group = (exp_avg, exp_avg_sq, param)
    return {
        exp_avg_sq: Prediction("adam_v", ((CUR, exp_avg), (PREV, exp_avg)), coeffs[0], group),
        param: Prediction("adam_p", ((CUR, exp_avg), (CUR, exp_avg_sq)), coeffs[1], group),
    }


def sgd_predictions(*, param: str, momentum_buffer: str, lr: float) -> Mapping[str, Prediction]:
    """Prediction of ``param`` after a step of SGD with momentum (not Nesterov): the update
    is ``p -= lr * buf`` with weight decay and dampening already inside ``buf``."""
    if not math.isfinite(lr):
        return {}
    try:
        return {
            param: Prediction(
                "sgd_p", ((CUR, momentum_buffer),), (f32(-lr),), (momentum_buffer, param)
            )
        }
    except ValueError:
        return {}
