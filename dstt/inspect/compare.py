"""Per-tensor change between two commits (``dstt diff A B``, ``Run.diff``).

Both commits are streamed chunk by chunk through ``Reader.read_chunk`` and reduced in float64,
so memory stays at two chunks whatever the tensor size. The result is an xarray ``Dataset``
over a ``tensor`` dimension: ``delta_l2`` = ||B - A||, ``a_l2``, ``b_l2``, ``ratio`` =
``delta_l2 / a_l2`` and ``max_abs_delta``; ``status`` says ``both``, ``only_a``, ``only_b``,
``shape_changed`` or ``missing`` (then the numbers are NaN). Rejected alternative: diffing the
write-time summaries — their update norm is exact only between consecutive steps, and A and B
may be far apart or on different timelines.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from dstt.schema import user_name
from dstt.store._internal import numpy_dtype

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from dstt.store._internal import CommitHeader, Reader

__all__ = ["diff_commits"]

FIELDS = ("delta_l2", "a_l2", "b_l2", "ratio", "max_abs_delta")


def _chunk(reader: Reader, header: CommitHeader, rec: Any, i: int) -> np.ndarray:  # noqa: ANN401 - a stored or a logical record
    data = np.frombuffer(reader.read_chunk(header, rec.path, i), dtype=numpy_dtype(rec.dtype))
    return data.astype(np.float64)


def _one(reader: Reader, ha: CommitHeader, ra: Any, hb: CommitHeader, rb: Any) -> tuple[float, ...]:  # noqa: ANN401 - stored or logical records
    d2 = a2 = b2 = mx = 0.0
    for i in range(ra.plan.n_chunks):
        a, b = _chunk(reader, ha, ra, i), _chunk(reader, hb, rb, i)
        d = b - a
        d2 += float(np.dot(d, d))
        a2 += float(np.dot(a, a))
        b2 += float(np.dot(b, b))
        if d.size:
            mx = max(mx, float(np.max(np.abs(d))))
    dl, da, nb = math.sqrt(d2), math.sqrt(a2), math.sqrt(b2)
    return dl, da, nb, (dl / da if da > 0 else math.nan), mx


def diff_commits(
    reader: Reader,
    ha: CommitHeader,
    hb: CommitHeader,
    paths: Sequence[str] | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> xr.Dataset:
    """Change of every tensor (or of ``paths``) from commit ``ha`` to commit ``hb``.

    ``progress(n)`` is called after each tensor with its byte count (for a progress bar).
    """
    ta, tb = reader.arrays(ha), reader.arrays(hb)
    todo = sorted(set(ta) | set(tb)) if paths is None else list(paths)
    rows: list[tuple[float, ...]] = []
    status: list[str] = []
    nan = (math.nan,) * len(FIELDS)
    for p in todo:
        ra, rb = ta.get(p), tb.get(p)
        if ra is None or rb is None:
            rows.append(nan)
            status.append("missing" if ra is rb else "only_b" if ra is None else "only_a")
        elif tuple(ra.shape) != tuple(rb.shape) or ra.dtype != rb.dtype:
            rows.append(nan)
            status.append("shape_changed")
        else:
            rows.append(_one(reader, ha, ra, hb, rb))
            status.append("both")
        if progress:
            rec = ra or rb
            progress(rec.plan.nbytes if rec is not None else 0)
    table = np.array(rows, dtype=np.float64).reshape(len(todo), len(FIELDS))
    data = {f: ("tensor", table[:, k]) for k, f in enumerate(FIELDS)}
    coords = {
        "tensor": ("tensor", np.array([user_name(p) for p in todo], dtype=object)),
        "store_path": ("tensor", np.array(todo, dtype=object)),
        "status": ("tensor", np.array(status, dtype=object)),
    }
    return xr.Dataset(
        data,
        coords=coords,
        attrs={
            "step_a": int(ha.step),
            "step_b": int(hb.step),
            "slot_a": int(ha.slot),
            "slot_b": int(hb.slot),
        },
    )
