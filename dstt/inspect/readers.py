"""Readers of one run shared by every view: one per thread, one cache of arrays tables, and
tables keyed by canonical names.

Each thread gets its own ``dstt.store.Reader`` (they keep private caches) sharing one locked
cache of parsed arrays tables (a 1000-tensor table costs ~25 ms to verify and parse). Each
table is augmented here once for every view: sharded commits' logical tensors
(:mod:`dstt.inspect.sharded`), and keys made canonical paths (wrapper components dropped);
records keep their stored ``path``, and lookups map back to it. No xarray is imported.

Rejected alternative: canonical names in each view (tensor, layer, trajectory, export,
restore) — five places to keep one rule, and the store's index answers by stored path.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from dstt._lru import LRU
from dstt.store._internal import Index, LocalStorage, Reader

from .naming import canonical_path
from .sharded import LogicalRecord, read_logical_chunk, with_logical

if TYPE_CHECKING:
    from collections.abc import Sequence

    from dstt.store._internal import CommitHeader, Storage

__all__ = ["ReaderPool"]


class _SharedReader(Reader):
    """A ``Reader`` whose arrays tables come from (and go to) a shared cache, augmented with
    logical tensors and keyed by canonical paths (``stored``: canonical -> stored path of
    the tensors whose stored path has wrapper components)."""

    def __init__(
        self,
        storage: Storage,
        tables: LRU[int, dict[str, Any]],
        index: Index | None = None,
        stored: dict[str, str] | None = None,
    ) -> None:
        super().__init__(storage, table_cache=1, index=index)
        self._shared = tables
        self._stored = {} if stored is None else stored

    def arrays(self, header: CommitHeader) -> dict[str, Any]:
        table = None if header.pruned else self._shared.get(header.slot)
        if table is None:
            table = super().arrays(header)  # verifies; raises for pruned steps
            table = self._canonical(with_logical(self, header, table))
            self._shared.put(header.slot, table)
        return table

    def _canonical(self, table: dict[str, Any]) -> dict[str, Any]:
        if not any("/_" in p for p in table):
            return table
        out: dict[str, Any] = {}
        for p in sorted(table, key=lambda p: canonical_path(p) != p):  # plain names first
            c = canonical_path(p)
            if c != p:
                self._stored.setdefault(c, p)
            out.setdefault(c, table[p])
        return out

    def located(self, header: CommitHeader, path: str) -> Any:  # noqa: ANN401 - a stored or a logical record
        return super().located(header, self._stored.get(path, path))

    def record(self, header: CommitHeader, path: str) -> Any:  # noqa: ANN401 - a stored or a logical record
        path = canonical_path(path)  # a stored path (a delta's inputs name them) or not
        rec = self.located(header, path)
        if rec is None:
            rec = self.arrays(header).get(path)
        return rec if rec is not None else super().record(header, path)  # the store's error

    def read_chunk(self, header: CommitHeader, path: str, index: int) -> memoryview:
        rec = self.record(header, path)
        if isinstance(rec, LogicalRecord):
            return read_logical_chunk(self, header, rec, index)
        return super().read_chunk(header, path, index)

    def read_many(self, headers: Sequence[Any], path: str) -> list[memoryview] | None:
        # None where the index misses a step (its table is keyed canonically): step by step
        return super().read_many(headers, self._stored.get(path, path))


class ReaderPool:
    """One reader per thread over one storage, all sharing one arrays-table cache.

    ``primary`` is the creating thread's reader, the one the owner reads refs and headers
    with; to see a changed run, the owner makes a new pool.
    """

    def __init__(self, storage: Storage, *, table_cache: int = 32) -> None:
        self.storage = storage
        self.tables: LRU[int, dict[str, Any]] = LRU(table_cache)
        self.index = Index(storage)  # one index for every thread's reader
        self.stored: dict[str, str] = {}  # canonical -> stored paths met in any table
        self._local = threading.local()
        self.primary = self.get()

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its storage's description (dask sends the arrays that hold a pool to
        its workers): threads, caches and open readers are rebuilt where it lands. A
        ``LocalStorage`` travels as its folder; other storages pickle themselves (an
        ``S3Storage`` as its URL and options)."""
        st = self.storage
        where = str(st.root) if isinstance(st, LocalStorage) else st
        return (_rebuilt_pool, (where, self.tables.capacity))

    def get(self) -> Reader:
        r = getattr(self._local, "reader", None)
        if r is None:
            r = self._local.reader = _SharedReader(
                self.storage, self.tables, self.index, self.stored
            )
        return r


def _rebuilt_pool(where: str | Storage, table_cache: int) -> ReaderPool:
    storage = LocalStorage(where) if isinstance(where, str) else where
    return ReaderPool(storage, table_cache=table_cache)
