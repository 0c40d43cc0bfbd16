"""Read side of write-time summaries, logged metrics as xarray, and loss-spike detection.

:func:`summary_rows` reads one commit's ``summaries`` object (fields:
:mod:`dstt.analysis.summary_kernel`); the coordinates and labels of every per-step view are here.
:func:`find_spikes` is :mod:`dstt.analysis.spikes`' rule, re-exported. :func:`spike_cause`
blames the update *into* the weights the jump's loss was computed on: a metric at step *k*
comes from the weights of *k - 1*, so ``parent -> cause`` is ``(k - 2) -> (k - 1)`` (with
sparser commits, the committed interval holding that update), tensors ranked by that cause
commit's ``update_ratio``.

Rejected alternative: ranking over a window around *k* — the update into *k* is the
optimizer's reaction to the bad loss, often the larger one, and then names the wrong tensors.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt import schema
from dstt.schema import SUMMARY_SCALARS, user_name
from dstt.store._internal import find_spikes

from .naming import canonical_path

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import xarray as xr

__all__ = [
    "ESTIMATE_NOTE",
    "Spike",
    "find_spikes",
    "label_updates",
    "spike_cause",
    "step_coords",
    "summary_rows",
    "tensor_names",
    "update_exactness",
    "utc_datetimes",
]

SUMMARIES_OBJECT = schema.SUMMARIES_OBJECT


def summary_rows(obj: Any) -> dict[str, dict[str, Any]]:
    """One commit's summaries object as ``{array path: {field: value}}``.

    The engine writes either that mapping (a step written in segments) or, whole, one
    *columnar* object ``{"columns": 1, "path": [...], "l2": array, ..., "probe": array
    (tensor, probe_index) NaN-padded, "probe_len": array}``; both read the same here.
    """
    if not (isinstance(obj, dict) and obj.get("columns") == 1):
        return dict(obj)
    paths = list(obj["path"])
    cols = {f: np.asarray(obj[f]).tolist() for f in SUMMARY_SCALARS}
    probe = np.asarray(obj["probe"])
    lens = np.asarray(obj["probe_len"]).tolist()
    # (columns written before exact flat-lane updates have no ``update_exact``: estimates)
    exact = np.asarray(obj.get("update_exact", np.zeros(len(paths), bool)), bool).tolist()
    out: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(paths):
        row: dict[str, Any] = {f: cols[f][i] for f in SUMMARY_SCALARS}
        for f in ("update_l2", "update_ratio"):
            if math.isnan(row[f]):  # unknown (first step, no probe); an inf stays inf
                row[f] = None
        row["probe"] = probe[i, : lens[i]].tolist()
        row["update_exact"] = bool(exact[i]) and row["update_l2"] is not None
        out[p] = row
    return out


def step_coords(
    steps: Sequence[int], slots: Sequence[int], timelines: Sequence[str], times: Sequence[float]
) -> dict[str, Any]:
    """The coordinates every per-step view shares: ``step`` (the index: unique and ascending
    along one timeline, so ``.sel(step=k)`` works after a rollback too), and ``slot``,
    ``timeline`` and ``time`` (``datetime64[ns]``, UTC) as plain coordinates along it."""
    return {
        "step": ("step", np.asarray(steps, dtype=np.int64)),
        "slot": ("step", np.asarray(slots, dtype=np.int64)),
        "timeline": ("step", np.asarray([str(t) for t in timelines], dtype=object)),
        "time": ("step", utc_datetimes(times)),
    }


def utc_datetimes(seconds: Sequence[float]) -> np.ndarray:
    """Seconds since the epoch (the store's commit times) as ``datetime64[ns]`` (UTC, naive as
    numpy's are), rounded to the microsecond the float holds exactly."""
    us = np.round(np.asarray(seconds, dtype=np.float64) * 1e6)
    return us.astype(np.int64).astype("datetime64[us]").astype("datetime64[ns]")


def tensor_names(paths: Sequence[str]) -> np.ndarray:
    """The ``tensor`` coordinate of summaries: user names without wrapper components."""
    return np.array([user_name(canonical_path(p)) for p in paths], dtype=object)


#: what an estimated update says about itself (the error: ``tests/inspect/
#: test_update_estimates.py`` measures it against the true ratio of two stored steps)
ESTIMATE_NOTE = (
    "estimate from the change of the 16 elements probed per tensor "
    "(update_exact False): a rough guide, typically within ~20% of the true "
    "value, now and then off by 2x or more; the exact change between two steps: "
    "run.diff(a, b)"
)


def update_exactness(exact: np.ndarray, known: np.ndarray) -> str:
    """``"exact"``, ``"estimate"``, ``"mixed"`` or ``"none"``: what the known update values
    (``known``: not NaN) of a summaries selection are, by their ``update_exact`` flags."""
    flags = exact[known]
    if flags.size == 0:
        return "none"
    if flags.all():
        return "exact"
    return "estimate" if not flags.any() else "mixed"


def label_updates(ds: xr.Dataset) -> xr.Dataset:
    """Say on the update variables of a summaries Dataset what they are: ``attrs`` of
    ``update_l2`` and ``update_ratio`` (``long_name``, ``exactness``: see
    :func:`update_exactness`, ``note``) and ``ds.attrs["update_exactness"]``."""
    kind = update_exactness(ds["update_exact"].values, np.isfinite(ds["update_ratio"].values))
    ds.attrs["update_exactness"] = kind
    names = {"update_l2": "||w_t - w_prev||", "update_ratio": "||w_t - w_prev|| / ||w_t||"}
    for var, long in names.items():
        ds[var].attrs.update(
            long_name=long,
            exactness=kind,
            note=ESTIMATE_NOTE
            if kind in ("estimate", "mixed")
            else "exact (the parent commit's copy was compared whole)",
        )
    return ds


@dataclass(frozen=True)
class Spike:
    """One loss spike: where the metric jumped, and the committed update that caused it.

    ``step`` is the metric's step at the spike's peak, ``start`` its first flagged step (the
    same for a one-step spike). ``cause`` is the committed step whose weights produced the
    jump (``start - 1`` when every step is committed; the module's cause rule otherwise) and
    ``parent`` the commit before it, so the bad update is ``parent -> cause`` (``update``).
    ``cause`` is None when the jump was computed on weights from before the first commit,
    ``parent`` None when ``cause`` is the first commit. ``tensors``: ``(name, score)`` of the
    cause's update, most abnormal first: the robust z-score of its update ratio against that
    tensor's own recent baseline (:mod:`dstt.inspect.diagnose`; NaN without a baseline, then
    ordered by ratio); tensors that moved less than their baseline (z < 0) are not listed;
    ``ratios`` holds their absolute update ratios.

    Data (:mod:`dstt.inspect.diagnose`, "which data"): ``batches`` are the recorded batch
    fingerprints of the steps ``parent + 1 .. start`` (``run.batches()``); ``suspect`` says
    whether the jump comes from the batch it was measured on (``"data"``) or from an abnormal
    update (``"update"``); ``samples`` are the suspect batches' sample indices and
    ``rollback_to`` the last commit before them, so ``run.rollback(sp.rollback_to,
    skip_samples=sp.samples)`` continues without them.
    """

    step: int
    value: float
    zscore: float
    baseline: float
    std: float
    tensors: list[tuple[str, float]] = field(default_factory=list)
    start: int | None = None
    cause: int | None = None
    parent: int | None = None
    timeline: str | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    batches: dict[int, list[Any]] = field(default_factory=dict)
    suspect: str | None = None
    #: ``run.explain`` of the run that found it (set by ``run.spikes()``; see :meth:`explain`)
    explainer: Callable[..., Any] | None = field(default=None, repr=False, compare=False)

    def explain(self, **kwargs: Any) -> Any:
        """Why this spike happened: ``run.explain(self, **kwargs)`` of the run that found it
        (:mod:`dstt.run.explain`)."""
        if self.explainer is None:
            from dstt.errors import ConfigError

            raise ConfigError(
                "this Spike was not found by run.spikes(), so it knows no run: "
                "call run.explain(spike) instead"
            )
        return self.explainer(self, **kwargs)

    @property
    def first_step(self) -> int:
        """The first flagged step: ``start``, else ``step`` (a spike built without one)."""
        return self.step if self.start is None else self.start

    @property
    def suspect_steps(self) -> list[int]:
        """The steps whose batches are suspected (see the class docstring)."""
        if self.start is None:
            return []
        if self.suspect == "update" and self.cause is not None:
            lo = self.parent + 1 if self.parent is not None else self.cause
            return list(range(lo, self.cause + 1))
        return [self.start]

    @property
    def samples(self) -> list[int]:
        """Sample indices of the suspect batches ([] where only hashes were recorded)."""
        return sorted(
            {i for k in self.suspect_steps for b in self.batches.get(k, ()) for i in b.samples}
        )

    @property
    def rollback_to(self) -> int | None:
        """The last commit trained on none of the suspect batches."""
        return self.parent if self.suspect == "update" else self.cause

    @property
    def update(self) -> tuple[int, int] | None:
        """``(parent, cause)``: the committed update that caused the spike, if both known."""
        if self.parent is None or self.cause is None:
            return None
        return self.parent, self.cause

    def __str__(self) -> str:
        top = (
            ", ".join(
                f"{n} (z={r:.3g}, ratio {self.ratios.get(n, math.nan):.3g})"
                for n, r in self.tensors[:3]
            )
            or "none (no update above its baseline, or no summaries)"
        )
        if self.update is not None:
            why = f"caused by the update {self.parent} -> {self.cause}"
        elif self.cause is not None:
            why = f"caused by the update into {self.cause} (the first commit)"
        else:
            why = "computed on weights from before the first commit"
        data = ""
        if self.suspect is not None:
            fps = [str(b) for k in self.suspect_steps for b in self.batches.get(k, ())]
            data = f"; suspect: {self.suspect} ({'; '.join(fps) or 'no batches recorded'})"
        return (
            f"step {self.step}: {self.value:.4g} (baseline {self.baseline:.4g}, "
            f"z={self.zscore:.1f}); {why}; most abnormal updates: {top}{data}"
        )


def spike_cause(steps: Sequence[int], start: int) -> tuple[int | None, int | None]:
    """``(parent, cause)`` of a jump first seen at step ``start`` by the module's cause rule;
    ``steps`` are the timeline's committed steps, ascending."""
    i = bisect.bisect_left(steps, start - 1)
    if i >= len(steps) or (i == 0 and steps[0] >= start):
        return None, None
    return (int(steps[i - 1]) if i > 0 else None), int(steps[i])
