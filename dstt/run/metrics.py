"""``Run.metrics()``: the logged metrics per step, read from the run's index as numpy columns,
an xarray ``Dataset`` only when one is asked for.

:class:`Metrics` holds the index's rows; ``names``, ``in``, ``steps`` and ``column(name)``
are numpy (no xarray), and everything a ``Dataset`` has builds that ``Dataset`` once
(:meth:`Metrics.to_xarray`) and answers from it, so code written against the ``Dataset``
keeps working. Rejected alternatives: a ``Dataset`` subclass (xarray forbids adding state to
one, and its import is what costs); a second method for the fast path (``run.metrics()``
is what a newcomer types first, and what ``dstt log`` uses). The columns, and the 2 s this
saved: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.store._internal import as_float

if TYPE_CHECKING:
    from collections.abc import Iterator

    import xarray as xr

    from dstt.store._internal import RowSet

__all__ = ["Metrics"]


class Metrics:
    """Logged metrics per step (``run.metrics()``): numpy columns, and on demand the
    ``xarray.Dataset`` over ``step`` that every ``Dataset`` attribute is answered from."""

    def __init__(self, rows: RowSet) -> None:
        self._rows = rows
        self._cols: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None
        self._ds: xr.Dataset | None = None

    # -- numpy: no xarray -------------------------------------------------------------------
    def _columns(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        if self._cols is None:
            self._cols = _columns(self._rows)
        return self._cols

    @property
    def names(self) -> list[str]:
        """The logged metrics' names, sorted."""
        return list(self._columns()[1])

    @property
    def steps(self) -> np.ndarray:
        """The steps (int64, ascending, each once)."""
        return self._columns()[0]["step"]

    def column(self, name: str) -> np.ndarray:
        """One metric (or ``step``, ``slot``, ``timeline``, ``time``, ``pruned``) as a numpy
        array along :attr:`steps`; ``KeyError`` naming the logged metrics if unknown."""
        coords, data = self._columns()
        if name in data:
            return data[name]
        if name in coords:
            return coords[name]
        raise KeyError(f"metric {name!r} was never logged; logged: {list(data)}")

    def __contains__(self, name: object) -> bool:
        coords, data = self._columns()
        return name in data or name in coords

    def __iter__(self) -> Iterator[str]:
        return iter(self._columns()[1])

    def __len__(self) -> int:
        return len(self._columns()[1])

    # -- xarray: built once, when asked -------------------------------------------------------
    def to_xarray(self) -> xr.Dataset:
        """The metrics as an ``xarray.Dataset`` over ``step`` (coordinates ``slot``,
        ``timeline``, ``time`` as UTC ``datetime64[ns]``, ``pruned``); built once."""
        if self._ds is None:
            import xarray as xr

            from dstt.inspect.summaries import utc_datetimes

            coords, data = self._columns()
            self._ds = xr.Dataset(
                {k: ("step", v) for k, v in data.items()},
                coords={
                    k: ("step", utc_datetimes(v.tolist()) if k == "time" else v)
                    for k, v in coords.items()
                },
            )
        return self._ds

    def __getitem__(self, key: Any) -> Any:
        return self.to_xarray()[key]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_rows", "_cols", "_ds"):
            raise AttributeError(name)
        return getattr(self.to_xarray(), name)

    def __repr__(self) -> str:
        return repr(self.to_xarray())

    def _repr_html_(self) -> str:
        return str(self.to_xarray()._repr_html_())


def _columns(rows: RowSet) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(coordinates, variables)`` of the rows, as :class:`Metrics` describes them."""
    n = len(rows)
    step = np.asarray(rows.step, dtype=np.int64)
    plain = (
        not any(rows.m_text)
        and all(h is None for h in rows.m_hist)
        and bool(np.all(np.diff(step) > 0))
    )
    if plain:  # the usual case: one committed row per step, numbers only
        num = np.asarray(rows.m_num, dtype=np.float64).reshape(n, len(rows.m_names))
        data = {
            k: num[:, j].copy()
            for j, k in sorted(enumerate(rows.m_names), key=lambda jk: jk[1])
            if not np.all(np.isnan(num[:, j]))
        }
        timeline = [rows.timelines[int(t)] for t in rows.timeline.tolist()]
        return _coords(step, rows.slot, timeline, rows.time, rows.pruned), data
    return _general(rows)


def _coords(step: Any, slot: Any, timeline: Any, time: Any, pruned: Any) -> dict[str, np.ndarray]:
    """:class:`Metrics`'s coordinates, one value per step each."""
    return {
        "step": np.asarray(step, dtype=np.int64),
        "slot": np.asarray(slot, dtype=np.int64),
        "timeline": np.asarray(timeline, dtype=object),
        "time": np.asarray(time, dtype=np.float64),
        "pruned": np.asarray(pruned).astype(bool),
    }


def _general(rows: RowSet) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The rows with text metrics, carried history or a step met twice: one dict per step."""
    names = rows.m_names
    num = rows.m_num
    found: dict[int, tuple[int, str, float, dict[str, Any], bool]] = {}
    for i in range(len(rows)):
        timeline = rows.timelines[int(rows.timeline[i])]
        hist = rows.m_hist[i]
        if hist is not None:
            for k, t, m in zip(hist["steps"], hist["time"], hist["metrics"], strict=True):
                found.pop(int(k), None)
                found[int(k)] = (-1, timeline, float(t), m, False)
        row: dict[str, Any] = {
            k: v for k, v in zip(names, num[i].tolist(), strict=True) if v == v
        }  # NaN: not logged at this step
        text = rows.m_text[i]
        if text:
            row.update(text)
        k = int(rows.step[i])
        found.pop(k, None)
        found[k] = (int(rows.slot[i]), timeline, float(rows.time[i]), row, bool(rows.pruned[i]))
    steps = sorted(found)
    ordered = [found[k] for k in steps]
    data: dict[str, np.ndarray] = {}
    for name in sorted({k for *_, m, _p in ordered for k in m}):
        vals = [m.get(name) for *_, m, _p in ordered]
        if any(isinstance(v, str) for v in vals):
            data[name] = np.array(["" if v is None else str(v) for v in vals], dtype=object)
        else:
            data[name] = np.array([as_float(v) for v in vals], dtype=np.float64)
    columns = [[r[i] for r in ordered] for i in (0, 1, 2, 4)]  # slot, timeline, time, pruned
    return _coords(steps, *columns), data
