"""Predictions of a whole flat step at once (``flatdelta.py``): which chunks each prediction
ties together, and one predictor run per predictor and set of coefficients.

The targets of one predictor with one set of coefficients (every ``exp_avg_sq`` of a parameter
group, say) and their inputs are gathered into contiguous float32 arrays and predicted in one
run: the ops are elementwise IEEE-754 float32, so every element's bits are those of the
per-chunk prediction. The grouping is cached per layout while the predictions' structure
repeats (every step of a steady run); a step only regroups by coefficients.

Rejected alternative: predicting chunk by chunk (seven numpy calls per chunk, as the tests'
reference does) or each target array in place (seven per tensor, no gathers).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .predict import CUR, PREDICTORS, Prediction

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .buffers import Scratch
    from .layout_state import LayoutState

__all__ = ["Group", "groups", "predict_residuals"]


@dataclass
class Group:
    """Targets of one predictor with one set of coefficients, in one round."""

    fn: str
    coeffs: tuple[float, ...]
    targets: list[int]
    inputs: list[list[int]]  # per input role: the chunk of each target's input
    roles: tuple[str, ...]
    srcs: list[tuple[str, ...]]  # per target: its input paths
    members: list[list[int]]
    #: the predicted arrays, each with its range in the lists above
    arrays: list[tuple[str, int, int]] = field(default_factory=list)

    def part(self, keep: set[str], coeffs: tuple[float, ...]) -> Group:
        """The targets of the arrays in ``keep``, with ``coeffs``."""
        out = Group(self.fn, coeffs, [], [[] for _ in self.inputs], self.roles, [], [])
        for p, lo, hi in self.arrays:
            if p in keep:
                out.targets += self.targets[lo:hi]
                for dst, src in zip(out.inputs, self.inputs, strict=True):
                    dst += src[lo:hi]
                out.srcs += self.srcs[lo:hi]
                out.members += self.members[lo:hi]
        return out


_FN, _INPUTS, _GROUP, _COEFFS = (
    operator.attrgetter(a) for a in ("fn", "inputs", "group", "coeffs")
)


def groups(st: LayoutState, predictions: Mapping[str, Prediction]) -> list[list[Group]]:
    """The step's predictions by round (a round's ``"cur"`` inputs that are predicted are
    decided in an earlier one) and by (predictor, coefficients). Which chunks a prediction
    ties together is cached while the predictions' structure repeats (every step of a
    steady run); a step only regroups by coefficients, per group when they differ."""
    vals = list(predictions.values())
    key = (
        "groups",
        tuple(predictions),
        tuple(map(_FN, vals)),
        tuple(map(_INPUTS, vals)),
        tuple(map(_GROUP, vals)),
    )
    plan = st.cache.get(key)
    if plan is None:
        if len(st.cache) > 16:
            st.cache.clear()
        plan = st.cache[key] = _plan(st, predictions)
    coeffs = dict(zip(predictions, map(_COEFFS, vals), strict=True))
    rounds = []
    for planned in plan:
        out = []
        for g in planned:
            paths = [p for p, _, _ in g.arrays]
            distinct = set(map(coeffs.__getitem__, paths))
            if len(distinct) == 1:
                out.append(replace(g, coeffs=distinct.pop()))
                continue
            for c in sorted(distinct):
                out.append(g.part({p for p in paths if coeffs[p] == c}, c))
        rounds.append(out)
    return rounds


def _plan(st: LayoutState, predictions: Mapping[str, Prediction]) -> list[list[Group]]:
    """``_groups`` by predictor only (coefficients left empty): the cached part."""
    layout, where = st.layout, st.where
    spans = {p: (lo, hi) for p, lo, hi in layout.spans}
    pending = {p: pr for p, pr in predictions.items() if p in spans}
    rounds: list[list[Group]] = []
    done: set[str] = set()
    while pending:
        ready = {
            p: pr
            for p, pr in pending.items()
            if all(r != CUR or s not in pending or s == p for r, s in pr.inputs)
        }
        if not ready:  # a cycle (not an optimizer's): predict none of them
            break
        by: dict[str, Group] = {}
        for p, pr in ready.items():
            lo, hi = spans[p]
            g = by.get(pr.fn)
            if g is None:
                g = by[pr.fn] = Group(
                    pr.fn, (), [], [[] for _ in pr.inputs], tuple(r for r, _ in pr.inputs), [], []
                )
            first = len(g.targets)
            for i in range(hi - lo):
                ins = [where.get((s, i)) for _, s in pr.inputs]
                mem = [where.get((m, i)) for m in pr.group]
                if None in ins or None in mem:
                    continue
                g.targets.append(lo + i)
                for slot, j in zip(g.inputs, ins, strict=True):
                    slot.append(j)  # type: ignore[arg-type]
                g.srcs.append(tuple(s for _, s in pr.inputs))
                g.members.append(mem)  # type: ignore[arg-type]
            g.arrays.append((p, first, len(g.targets)))
        rounds.append([g for g in by.values() if g.targets])
        done |= ready.keys()
        pending = {p: pr for p, pr in pending.items() if p not in done}
    return rounds


def predict_residuals(
    g: Group,
    t: np.ndarray,
    ins: list[np.ndarray],
    prev_b: list[Any],
    cur_b: list[Any],
    st: LayoutState,
    scratch: Scratch,
) -> list[Any]:
    """Residuals (uint32 views, one per target chunk) of ``cur XOR predicted`` for the
    targets ``t``: their chunks and inputs gathered into contiguous float32 arrays, the
    predictor run once over all of them."""
    spec = PREDICTORS[g.fn]
    sizes = st.size[t]
    total = int(sizes.sum())
    bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()

    def gather(views: list[Any], idx: np.ndarray, name: str) -> np.ndarray:
        dst = scratch.get(name, total)
        parts = list(map(views.__getitem__, idx.tolist()))
        arrs = list(map(np.frombuffer, parts, itertools.repeat(np.uint8)))
        np.concatenate(arrs, out=dst)
        f4: np.ndarray = dst.view("<f4")
        return f4

    p_prev = gather(prev_b, t, "fp_prev")
    inputs = [
        gather(cur_b if role == CUR else prev_b, i, f"fp_in{k}")
        for k, (role, i) in enumerate(zip(g.roles, ins, strict=True))
    ]
    out = scratch.get("fp_out", total).view("<f4")
    tmp = scratch.get("fp_tmp", total).view("<f4")
    spec[2](p_prev, inputs, g.coeffs, out, tmp)
    cur = gather(cur_b, t, "fp_cur")
    res = np.bitwise_xor(cur.view(np.uint32), out.view(np.uint32), out=out.view(np.uint32))
    b4 = (np.asarray(bounds) // 4).tolist()
    return list(map(res.__getitem__, map(slice, b4[:-1], b4[1:])))
