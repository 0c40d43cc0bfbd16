"""Metrics and write-time summaries from the run's index rows (``dstt.store.RowSet``).

The index keeps every commit's metrics and summaries as columns, pruned steps included (gc
frees tensor bytes, never scalars' history). :func:`summaries_from_rows` builds the Dataset
straight from those columns (``Run.metrics()``, :mod:`dstt.run.metrics`, reads them too);
:func:`summary_columns` gives the same table as plain numpy (:class:`SummaryColumns`), so
``dstt show``, ``dstt log`` and the spike ranking never import xarray (~0.5 s cold).

Rejected alternatives: reading each commit's ``summaries`` object (one read and JSON parse per
step, and gone after gc); a Dataset everywhere (the import alone breaks the CLI's 0.3 s
budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.schema import SUMMARY_SCALARS

from .summaries import (
    label_updates,
    step_coords,
    tensor_names,
)

if TYPE_CHECKING:
    import xarray as xr

    from dstt.store._internal import RowSet

__all__ = ["SummaryColumns", "summaries_from_rows", "summary_columns"]


class _Values:
    """One column, as ``ds[name]`` answers ``.values``."""

    __slots__ = ("values",)

    def __init__(self, values: np.ndarray) -> None:
        self.values = values


@dataclass
class SummaryColumns:
    """The ``summaries()`` table as numpy: ``data`` (``l2``, ``update_ratio``, ...: step x
    tensor; ``probe``: step x tensor x probe), ``coords`` (``step``, ``slot``, ``timeline``,
    ``time`` in seconds, ``pruned``: per step; ``tensor``, ``store_path``: per tensor).
    ``cols["l2"].values`` and ``cols.sizes`` answer as a Dataset's would."""

    data: dict[str, np.ndarray]
    coords: dict[str, np.ndarray]

    @property
    def sizes(self) -> dict[str, int]:
        return {"step": len(self.coords["step"]), "tensor": len(self.coords["tensor"])}

    def __getitem__(self, name: str) -> _Values:
        got = self.data.get(name)
        return _Values(self.coords[name] if got is None else got)

    def __contains__(self, name: object) -> bool:
        return name in self.data or name in self.coords


def summary_columns(rows: RowSet) -> SummaryColumns:
    """The rows that have summaries as :class:`SummaryColumns` (no xarray): a step met twice
    along the lineage keeps its later row; tensors no kept row summarized are left out."""
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
    cols = np.flatnonzero(present)
    if len(cols) < val.shape[1]:
        val, probe, exact = val[:, cols], probe[:, cols], exact[:, cols]
    width = probe.shape[2]
    while width and np.all(np.isnan(probe[:, :, width - 1])):
        width -= 1
    paths = [rows.s_paths[j] for j in cols]
    data = {f: val[:, :, k] for k, f in enumerate(SUMMARY_SCALARS)}
    data["update_exact"] = exact.astype(bool)
    data["probe"] = probe[:, :, :width].astype(np.float64)
    coords = {
        "step": rows.step[keep].astype(np.int64),
        "slot": rows.slot[keep].astype(np.int64),
        "timeline": np.array([rows.timelines[int(t)] for t in rows.timeline[keep]], dtype=object),
        "time": rows.time[keep].astype(np.float64),
        "pruned": rows.pruned[keep].astype(bool),
        "tensor": tensor_names(paths),
        "store_path": np.array(paths, dtype=object),
    }
    return SummaryColumns(data, coords)


def summaries_from_rows(rows: RowSet) -> xr.Dataset:
    """The ``summaries()`` Dataset of the rows that have summaries: ``l2 rms maxabs nan inf
    update_l2 update_ratio`` over ``(step, tensor)`` (float64, NaN where unknown or absent),
    ``update_exact`` (bool) and ``probe`` over ``(step, tensor, probe_index)``. ``update_l2`` and
    ``update_ratio`` compare each commit with its parent: exact where ``update_exact``, else
    estimates from the probed elements (their ``attrs`` say so: :func:`label_updates`).
    ``tensor`` holds user names; ``store_path`` is a coordinate along it; along ``step`` the
    coordinates of :func:`step_coords` and ``pruned``."""
    import xarray as xr

    t = summary_columns(rows)
    c = t.coords
    data: dict[str, Any] = {
        k: (("step", "tensor", "probe_index") if k == "probe" else ("step", "tensor"), v)
        for k, v in t.data.items()
    }
    coords = {
        **step_coords(
            c["step"].tolist(), c["slot"].tolist(), c["timeline"].tolist(), c["time"].tolist()
        ),
        "tensor": ("tensor", c["tensor"]),
        "store_path": ("tensor", c["store_path"]),
        "pruned": ("step", c["pruned"]),
    }
    return label_updates(xr.Dataset(data, coords=coords))
