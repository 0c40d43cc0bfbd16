"""The low-level save/restore pair: a dict of numpy arrays and objects in, the same out.

This is what the capture engine drives chunk by chunk; here it is whole-array, for tests,
scripts and other frameworks. No torch: tensors arrive as numpy arrays (bfloat16 as
``ml_dtypes.bfloat16``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.errors import StepNotFoundError

from .format.zarr_meta import dtype_itemsize
from .repository import Repository

if TYPE_CHECKING:
    import os
    from collections.abc import Mapping

    from .format.records import CommitHeader, Metric
    from .storage.base import Storage

__all__ = ["StoredStep", "dtype_name", "load", "save"]


def dtype_name(dtype: np.dtype[Any]) -> str:
    """The store's name for a numpy dtype (``ValueError`` for unsupported ones)."""
    if dtype.name == "bfloat16":
        return "bfloat16"
    name = np.dtype(dtype).name
    dtype_itemsize(name)
    return name


def save(
    path: str | os.PathLike[str] | Storage,
    step: int,
    arrays: Mapping[str, Any],
    objects: Mapping[str, Any] | None = None,
    metrics: Mapping[str, Metric] | None = None,
    *,
    timeline: str | None = None,
    chunk_bytes: int | None = None,
) -> CommitHeader:
    """Commit ``arrays`` (path → numpy array) and ``objects`` as ``step``; returns the header."""
    repo = Repository.create(path)
    opts = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    with repo.writer(**opts) as w:
        txn = w.begin(step, timeline=timeline)
        try:
            for name, arr in arrays.items():
                a = np.asarray(arr)
                a = a if a.flags.c_contiguous else a.copy(order="C")
                if a.dtype.byteorder == ">":  # chunks are little-endian; convert the values
                    a = a.astype(a.dtype.newbyteorder("<"))
                plan = txn.declare(name, dtype_name(a.dtype), a.shape)
                flat = a.reshape(-1).view(np.uint8)
                for i in range(plan.n_chunks):
                    start, stop = plan.byte_range(i)
                    txn.put_chunk(name, i, flat[start:stop])
            for name, obj in (objects or {}).items():
                txn.put_object(name, obj)
            return txn.commit(metrics)
        except BaseException:
            txn.abort()
            raise


@dataclass(frozen=True)
class StoredStep:
    """One committed step as ``load`` reads it back whole: its header, every array (path ->
    numpy array) and every object. Not ``Snapshot``: that name is ``dstt.Snapshot``, the
    lazy step view of inspection."""

    header: CommitHeader
    arrays: dict[str, np.ndarray]
    objects: dict[str, Any]


def load(
    path: str | os.PathLike[str] | Storage,
    step: int | None = None,
    *,
    timeline: str | None = None,
    trusted: bool = False,
) -> StoredStep:
    """Read back a committed step (default: the head of the current timeline), verified."""
    r = Repository.open(path).reader()
    if step is None:
        h = r.head(timeline)
        if h is None:
            raise StepNotFoundError(f"{r.storage.location} has no committed step yet")
    else:
        h = r.find(step, timeline)
    arrays = {p: r.read_array(h, p) for p in r.arrays(h)}
    objects = {n: r.read_object(h, n, trusted=trusted) for n in h.objects}
    return StoredStep(h, arrays, objects)
