"""Lazy xarray backend arrays over committed tensors: one commit, or one tensor over many.

Both are ``xarray.backends.BackendArray`` subclasses with outer indexing, wrapped lazily
(:func:`variable`), so ``.isel``/``.sel`` read nothing; values read only the chunks holding the
selected rows of axis 0, through ``Reader.read_chunk`` (crc32c-checked), copied once into the
result (bfloat16 upcast to float32 in that copy, exactly). A trajectory fills one step per
task on a small thread pool; readers are per thread (:mod:`dstt.inspect.readers`).

Rejected alternative: ``zarr``/``xr.open_zarr`` on the run — it would read slots no ref
reaches (aborted or pruned data), cannot follow a timeline's lineage, and skips the
manifest's crc32c check.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr
from xarray.backends import BackendArray
from xarray.core import indexing

from dstt.errors import SchemaError
from dstt.store._internal import numpy_dtype

from .readers import ReaderPool

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from dstt.store._internal import CommitHeader, Reader

__all__ = ["CommitArray", "ReaderPool", "TrajectoryArray", "read_outer", "variable", "view_dtype"]

Key = tuple[Any, ...]


def view_dtype(store_dtype: str) -> np.dtype[Any]:
    """The dtype a view shows: bfloat16 -> float32, everything else as stored."""
    return np.dtype(np.float32) if store_dtype == "bfloat16" else numpy_dtype(store_dtype)


# -- indexing ---------------------------------------------------------------------------------


def _outer(arr: np.ndarray, key: Key, first_axis: int) -> np.ndarray:
    """Apply an outer indexer (ints, slices, 1-d int arrays) to axes ``first_axis...``."""
    for i in range(len(key) - 1, -1, -1):  # last axis first: dropping axes keeps others put
        k = key[i]
        if isinstance(k, slice) and k == slice(None):
            continue
        idx: list[Any] = [slice(None)] * arr.ndim
        idx[first_axis + i] = k
        arr = arr[tuple(idx)]
    return arr


def _key_shape(key: Key, shape: Sequence[int]) -> tuple[int, ...]:
    """Shape that an outer indexer gives on ``shape`` (ints drop their axis)."""
    out: list[int] = []
    for k, n in zip(key, shape, strict=True):
        if isinstance(k, slice):
            out.append(len(range(*k.indices(n))))
        elif np.ndim(k) == 1:
            out.append(len(k))
    return tuple(out)


def _adapt(
    array: CommitArray | TrajectoryArray,
    key: indexing.ExplicitIndexer,
    raw: Callable[[Key], np.ndarray],
) -> np.ndarray:
    """``explicit_indexing_adapter`` with empty slices made forward first: xarray 2026.9's
    ``_decompose_slice`` raises IndexError on an empty negative-step slice (``[0:0:-1]``)."""
    if isinstance(key, (indexing.BasicIndexer, indexing.OuterIndexer)):
        parts = tuple(
            slice(0, 0) if isinstance(k, slice) and not len(range(*k.indices(n))) else k
            for k, n in zip(key.tuple, array.shape, strict=True)
        )
        key = type(key)(parts)
    out: np.ndarray = indexing.explicit_indexing_adapter(
        key, array.shape, indexing.IndexingSupport.OUTER, raw
    )
    return out


def read_outer(
    reader: Reader,
    header: CommitHeader,
    record: Any,  # noqa: ANN401 - a stored or a logical record
    key: Key,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Outer-indexed values of one tensor of one commit, reading only the needed chunks.

    Writes into ``out`` (shape of the result, view dtype) when given, else a new array.
    """
    store_dt = numpy_dtype(record.dtype)
    out_dt = view_dtype(record.dtype)
    shape = tuple(record.shape)
    if not shape:
        data = np.frombuffer(reader.read_chunk(header, record.path, 0), dtype=store_dt)
        res0 = np.empty((), out_dt) if out is None else out
        res0[...] = data.reshape(())
        return res0
    plan = record.plan
    rows = np.arange(shape[0])[key[0]]
    flat = np.atleast_1d(rows)
    rest = key[1:]
    full = (flat.size, *_key_shape(rest, shape[1:]))
    if out is None:
        res = np.empty(full, out_dt)
    elif np.ndim(rows) == 0:
        res = out[np.newaxis]
    else:
        res = out
    if plan.nbytes and flat.size:
        chunk_of = flat // plan.rows
        for c in np.unique(chunk_of):
            piece = np.frombuffer(reader.read_chunk(header, record.path, int(c)), dtype=store_dt)
            piece = piece.reshape(-1, *shape[1:])
            pos = np.flatnonzero(chunk_of == c)
            local = flat[pos] - int(c) * plan.rows
            if pos[-1] - pos[0] + 1 == pos.size and (
                pos.size == 1 or bool(np.all(np.diff(local) == 1))
            ):
                src = _outer(piece[local[0] : local[0] + pos.size], rest, 1)
                np.copyto(res[pos[0] : pos[-1] + 1], src, casting="unsafe")
            else:
                res[pos] = _outer(piece[local], rest, 1)
    if out is not None:
        return out
    return res[0, ...] if np.ndim(rows) == 0 else res


# -- backend arrays ---------------------------------------------------------------------------


class CommitArray(BackendArray):
    """One tensor of one commit, shape as stored, dtype as shown (bf16 -> float32)."""

    def __init__(self, readers: ReaderPool, header: CommitHeader, record: Any) -> None:  # noqa: ANN401 - a stored or a logical record
        self.readers, self.header, self.record = readers, header, record
        self.shape = tuple(record.shape)
        self.dtype = view_dtype(record.dtype)

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return _adapt(self, key, self._raw)

    def __reduce__(self) -> tuple[Any, ...]:
        return (CommitArray, (self.readers, _plain(self.header), self.record))

    def _raw(self, key: Key) -> np.ndarray:
        return read_outer(self.readers.get(), self.header, self.record, key)


def _plain(header: CommitHeader) -> CommitHeader:
    """A header that pickles: an index-backed one (which holds a closure over the index) as
    the full header it stands for."""
    full = getattr(header, "full", None)
    return full() if callable(full) else header


_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dstt-read")
        return _POOL


class TrajectoryArray(BackendArray):
    """Tensor ``path`` over many commits: shape ``(len(headers), *shape)``.

    Construction reads nothing: each step's arrays table is looked up when that step is read.
    A step where the tensor is absent (e.g. an optimizer state before the first update) reads
    as NaN (float tensors; other dtypes raise); a step where it has another shape or dtype
    raises ``SchemaError`` (a ``ValueError``).
    """

    def __init__(
        self,
        readers: ReaderPool,
        headers: Sequence[Any],
        path: str,
        shape: tuple[int, ...],
        store_dtype: str,
        *,
        threads: bool = True,
    ) -> None:
        self.readers, self.headers, self.path = readers, list(headers), path
        self.shape = (len(self.headers), *shape)
        self.store_dtype = store_dtype
        self.dtype = view_dtype(store_dtype)
        self.threads = threads
        self._nbytes = int(np.prod(shape)) * numpy_dtype(store_dtype).itemsize

    def __getitem__(self, key: indexing.ExplicitIndexer) -> np.ndarray:
        return _adapt(self, key, self._raw)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with plain headers (dask ships the array to its workers)."""
        return (
            TrajectoryArray,
            (
                self.readers,
                [_plain(h) for h in self.headers],
                self.path,
                self.shape[1:],
                self.store_dtype,
            ),
            {"threads": self.threads},
        )

    def _fill(self, i: int, rest: Key, out: np.ndarray) -> None:
        reader, header = self.readers.get(), self.headers[i]
        # the index locates the tensor's chunks without the step's arrays table
        record = reader.located(header, self.path) or reader.arrays(header).get(self.path)
        if record is None:
            if self.dtype.kind != "f":
                raise SchemaError(
                    f"{self.path!r} is missing at step {header.step} and has dtype "
                    f"{self.store_dtype}, which has no NaN; narrow the steps"
                )
            out[...] = np.nan
            return
        if tuple(record.shape) != self.shape[1:] or record.dtype != self.store_dtype:
            raise SchemaError(
                f"{self.path!r} is {record.dtype}{tuple(record.shape)} at step {header.step} "
                f"but {self.store_dtype}{self.shape[1:]} at the newest selected step; "
                "select steps on one side of the change"
            )
        read_outer(reader, header, record, rest, out)

    def _raw(self, key: Key) -> np.ndarray:
        sel = np.arange(self.shape[0])[key[0]]
        rest = key[1:]
        idx = [int(i) for i in np.atleast_1d(sel)]
        res = np.empty((len(idx), *_key_shape(rest, self.shape[1:])), self.dtype)
        # the index locates the tensor in every step: one batched read of exactly its bytes
        every = isinstance(key[0], slice) and len(idx) == len(self.headers)
        many = self.readers.get().read_many(
            self.headers if every else [self.headers[i] for i in idx], self.path
        )
        if many is not None and all(len(b) == self._nbytes for b in many):
            dt, shape = numpy_dtype(self.store_dtype), self.shape[1:]
            if all(isinstance(k, slice) and k == slice(None) for k in rest):  # whole steps
                block = np.frombuffer(bytearray().join(many), dtype=dt).reshape(len(many), *shape)
                if block.dtype == res.dtype:  # the joined bytes are the result: no copy
                    return block[0, ...] if np.ndim(sel) == 0 else block
                np.copyto(res, block, casting="unsafe")
                return res[0, ...] if np.ndim(sel) == 0 else res
            for j, data in enumerate(many):
                piece = np.frombuffer(data, dtype=dt).reshape(shape)
                np.copyto(res[j, ...], _outer(piece, rest, 0), casting="unsafe")
            return res[0, ...] if np.ndim(sel) == 0 else res
        if self.threads and len(idx) > 1:
            list(_pool().map(lambda j: self._fill(idx[j], rest, res[j, ...]), range(len(idx))))
        else:
            for j, i in enumerate(idx):
                self._fill(i, rest, res[j, ...])
        return res[0, ...] if np.ndim(sel) == 0 else res


def variable(
    array: BackendArray,
    dims: Sequence[str],
    chunks: Any = None,  # noqa: ANN401 - xarray's chunks
    attrs: dict[str, Any] | None = None,
) -> xr.Variable:
    """A lazy ``xr.Variable`` over ``array``; a dask-backed one when ``chunks`` is given."""
    var = xr.Variable(tuple(dims), indexing.LazilyIndexedArray(array), attrs=attrs or {})
    if chunks is not None:
        try:
            import dask.array  # noqa: F401
        except ImportError:
            raise ImportError(
                "chunks= needs dask; install it (pip install dask) or leave "
                "chunks unset for lazy numpy-backed views"
            ) from None
        var = var.chunk(chunks)
    return var
