"""Metrics and write-time summaries from the run's index rows (``dstt.store.RowSet``).

The index (``dstt/store/index/writer.py``) keeps every commit's metrics, metrics history and
write-time summaries as columns — pruned steps included, since gc frees tensor bytes but never
the history of scalars. :func:`metrics_from_rows` feeds those rows to
:func:`dstt.inspect.summaries.metrics_dataset` (one light record per row, so the Dataset is the
one a list of headers gives) and adds a ``pruned`` coordinate; :func:`summaries_from_rows`
builds the ``summaries()`` Dataset straight from the float64 matrices (the per-step dicts of
``summaries_dataset`` cost seconds at 10,000 steps). Rejected alternative: reading each
commit's ``summaries`` object — one read and one JSON parse per step, and gone after gc.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xarray as xr

from dstt.store._internal import SUMMARY_SCALARS, RowSet

from .summaries import (
    METRICS_HISTORY_OBJECT,
    label_updates,
    metrics_dataset,
    step_coords,
    tensor_names,
)

__all__ = ["metrics_from_rows", "summaries_from_rows"]


@dataclass
class _Row:
    step: int
    slot: int
    timeline: str
    time: float
    metrics: dict[str, Any]
    objects: dict[str, Any] = field(default_factory=dict)
    history: Any = None


def metrics_from_rows(rows: RowSet) -> xr.Dataset:
    """``metrics_dataset`` of the rows (commits in step order), with a ``pruned`` coordinate
    (True where gc freed the step's tensors; its metrics stay)."""
    names = rows.m_names
    num = rows.m_num
    recs = []
    for i in range(len(rows)):
        m: dict[str, Any] = {
            k: v for k, v in zip(names, num[i].tolist(), strict=True) if v == v
        }  # NaN: not logged at this step
        text = rows.m_text[i]
        if text:
            m.update(text)
        hist = rows.m_hist[i]
        recs.append(
            _Row(
                int(rows.step[i]),
                int(rows.slot[i]),
                rows.timelines[int(rows.timeline[i])],
                float(rows.time[i]),
                m,
                {METRICS_HISTORY_OBJECT: None} if hist is not None else {},
                hist,
            )
        )
    ds = metrics_dataset(recs, lambda r, _name: r.history)
    pruned_of = dict(zip(rows.slot.tolist(), rows.pruned.astype(bool).tolist(), strict=True))
    pruned = np.array([pruned_of.get(int(s), False) for s in ds["slot"].values], dtype=bool)
    return ds.assign_coords(pruned=("step", pruned))


def summaries_from_rows(rows: RowSet) -> xr.Dataset:
    """The ``summaries()`` Dataset of the rows that have summaries (see
    :func:`dstt.inspect.summaries.summaries_dataset` for the variables), plus ``pruned``."""
    has = np.flatnonzero(rows.s_has.astype(bool))
    # ``step`` stays a unique index: a step met twice along the lineage keeps its later row
    last: dict[int, int] = {int(rows.step[i]): int(i) for i in has}
    keep = np.array([last[k] for k in sorted(last)], dtype=np.int64)
    # views, not copies, where every row and tensor is kept (the usual case: 150 MB at 10k steps)
    every_row = len(keep) == len(rows) and bool(np.all(keep == np.arange(len(rows))))
    val = rows.s_val if every_row else rows.s_val[keep]
    probe = rows.s_probe if every_row else rows.s_probe[keep]
    exact = rows.s_exact if every_row else rows.s_exact[keep]
    # a tensor a step summarized always has an l2: absent tensors are NaN there
    present = ~np.all(np.isnan(val[:, :, 0]), axis=0) if len(keep) else np.zeros(val.shape[1], bool)
    if not bool(present.all()):
        cols = np.flatnonzero(present)
        val, probe, exact = val[:, cols], probe[:, cols], exact[:, cols]
    else:
        cols = np.arange(val.shape[1])
    width = probe.shape[2]
    while width and np.all(np.isnan(probe[:, :, width - 1])):
        width -= 1
    probe = probe[:, :, :width].astype(np.float64)
    paths = [rows.s_paths[j] for j in cols]
    data: dict[str, Any] = {
        f: (("step", "tensor"), val[:, :, k]) for k, f in enumerate(SUMMARY_SCALARS)
    }
    data["update_exact"] = (("step", "tensor"), exact.astype(bool))
    data["probe"] = (("step", "tensor", "probe_index"), probe)
    coords = {
        **step_coords(
            rows.step[keep].tolist(),
            rows.slot[keep].tolist(),
            [rows.timelines[int(t)] for t in rows.timeline[keep]],
            rows.time[keep].tolist(),
        ),
        "tensor": ("tensor", tensor_names(paths)),
        "store_path": ("tensor", np.array(paths, dtype=object)),
        "pruned": ("step", rows.pruned[keep].astype(bool)),
    }
    return label_updates(xr.Dataset(data, coords=coords))
