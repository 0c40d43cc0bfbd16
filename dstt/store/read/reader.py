"""Reading committed steps: refs → lineage of commit headers → arrays tables → verified chunks.

A reader only ever looks at slots reachable from a timeline ref, so torn or orphaned writes are
invisible by construction. Every chunk read is checked (size, crc32c against the arrays table
and the chunk's own trailer); every header and table is checked against its envelope crc.
Headers are immutable once written except for gc's tombstones, so they are cached until
``refresh()``. Rejected alternative: listing slots from the ``step`` coordinate — it is written
after the commit point and cannot tell timelines apart. Chunks, delta chains, whole arrays
and row ranges are read by a ``ChunkReader`` (``chunks.py``) the reader holds.
"""

from __future__ import annotations

import gc
import struct
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from dstt._lru import LRU
from dstt.errors import (
    ChecksumError,
    CorruptRunError,
    NotARunError,
    StepNotFoundError,
    TimelineError,
)
from dstt.store.format.envelope import checksum
from dstt.store.format.layout import (
    COMMITS_PREFIX,
    HEAD_KEY,
    REFS_PREFIX,
    ChunkPlan,
    commit_key,
    parse_commit_name,
    step_file_key,
)
from dstt.store.format.manifest import (
    parse_arrays,
    parse_arrays_columns,
    parse_head,
    parse_header,
    parse_ref,
)
from dstt.store.format.objects import decode_object
from dstt.store.format.records import ArrayRecord, CommitHeader, RefInfo
from dstt.store.format.zarr_meta import numpy_dtype
from dstt.store.index.view import Index, scalar_rows

from .chunks import ChunkReader

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from dstt.store.format.segment import RowSet
    from dstt.store.storage.base import Storage

__all__ = ["Reader"]


class Reader:
    """Read-only view of a run's committed state."""

    def __init__(
        self,
        storage: Storage,
        *,
        table_cache: int = 8,
        decoded_cache_bytes: int = 256 << 20,
        index: Index | None = None,
        use_index: bool = True,
    ) -> None:
        self.storage = storage
        #: the run's index (``index/view.py``, written by ``index/writer.py``): headers and tensor
        #: locations without a header read per step; loaded on first use, shared by the
        #: readers of a ``ReaderPool``.
        #: ``use_index=False``: every header from its own file (verify)
        self.index = index if index is not None else Index(storage, enabled=use_index)
        self._headers: dict[int, CommitHeader] = {}
        self._tables: LRU[int, dict[str, ArrayRecord]] = LRU(table_cache)
        #: chunk reads (delta chains decoded through their bases, cached in bytes)
        self.chunks = ChunkReader(
            storage,
            header=self.header,
            record=self.record,
            missing=self._raise_missing,
            decoded_cache_bytes=decoded_cache_bytes,
        )
        self.refresh()

    # -- refs -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read HEAD and refs (cheap); drop cached headers that gc may have pruned."""
        st = self.storage
        try:
            self.current_timeline = parse_head(st.read(HEAD_KEY), f"{st.location}/{HEAD_KEY}")
        except FileNotFoundError:
            raise NotARunError(f"{st.location} is not a dstt run (no {HEAD_KEY})") from None
        refs = {}
        for name in st.list(REFS_PREFIX):
            if name.endswith(".json"):
                key = f"{REFS_PREFIX}/{name}"
                r = parse_ref(st.read(key), f"{st.location}/{key}")
                refs[r.name] = r
        self._refs = refs
        # tombstones are final; any other header may have become one since
        self._headers = {s: h for s, h in self._headers.items() if h.pruned}
        if self.index.loaded:
            self.index.load()

    def moved(self, ref: RefInfo) -> None:
        """A ref the caller just wrote (the run's writer, which holds its lock and so moves
        every ref): this reader's copy follows without re-reading it."""
        self._refs[ref.name] = ref

    @property
    def timelines(self) -> dict[str, RefInfo]:
        return dict(self._refs)

    def ref(self, timeline: str | None = None) -> RefInfo:
        name = timeline or self.current_timeline
        try:
            return self._refs[name]
        except KeyError:
            raise TimelineError(
                f"no timeline {name!r} in {self.storage.location}; timelines: {sorted(self._refs)}"
            ) from None

    # -- headers and lineage --------------------------------------------------------------
    def header(self, slot: int) -> CommitHeader:
        h = self._headers.get(slot)
        if h is None:
            h = self.index.header(slot)
            if h is not None:
                self._headers[slot] = h
                return h
            key = commit_key(slot)
            try:
                data = self.storage.read(key)
            except FileNotFoundError:
                raise CorruptRunError(
                    f"{self.storage.location}/{key}: commit header missing, but a ref or "
                    "parent points at it"
                ) from None
            h = parse_header(data, f"{self.storage.location}/{key}")
            if h.slot != slot:
                raise CorruptRunError(f"{self.storage.location}/{key}: header names slot {h.slot}")
            self._headers[slot] = h
        return h

    def walk(self, timeline: str | None = None) -> Iterator[CommitHeader]:
        """Commits of a timeline, newest first (pruned tombstones included), read lazily.

        A damaged header raises ``CorruptRunError`` only when the walk reaches it, so the
        commits above it stay reachable (``find``, ``verify``).
        """
        slot = self.ref(timeline).head
        seen: set[int] = set()
        while slot is not None:
            if slot in seen:
                raise CorruptRunError(f"{self.storage.location}: parent cycle at slot {slot}")
            seen.add(slot)
            h = self.header(slot)
            yield h
            slot = h.parent

    def lineage(self, timeline: str | None = None) -> list[CommitHeader]:
        """Commits of a timeline, oldest first (pruned tombstones included)."""
        out = list(self.walk(timeline))
        out.reverse()
        return out

    def head(self, timeline: str | None = None) -> CommitHeader | None:
        slot = self.ref(timeline).head
        return None if slot is None else self.header(slot)

    def find(self, step: int, timeline: str | None = None) -> CommitHeader:
        """The commit of ``step`` on a timeline; ``StepNotFoundError`` if unknown or pruned."""
        name = timeline or self.current_timeline
        for h in self.walk(name):  # newest first: a damaged older header does not hide it
            if h.step == step:
                if h.pruned:
                    line = self.lineage(name)
                    raise StepNotFoundError(
                        f"step {step} of timeline {name!r} was pruned by gc; kept steps: "
                        f"{_describe([x.step for x in line if not x.pruned])}"
                    )
                return h
        line = self.lineage(name)
        raise StepNotFoundError(
            f"no committed step {step} on timeline {name!r} of {self.storage.location}; "
            f"committed steps: {_describe([x.step for x in line if not x.pruned])}"
        )

    def max_slot(self) -> int:
        """Highest slot with any commit header (committed, orphaned or pruned), or -1."""
        slots = [parse_commit_name(n) for n in self.storage.list(COMMITS_PREFIX)]
        return max((s for s in slots if s is not None), default=-1)

    def all_slots(self) -> list[int]:
        slots = (parse_commit_name(n) for n in self.storage.list(COMMITS_PREFIX))
        return sorted(s for s in slots if s is not None)

    # -- arrays ---------------------------------------------------------------------------
    def arrays(self, header: CommitHeader) -> dict[str, ArrayRecord]:
        """The arrays table of a commit (verified against the header's crc32c)."""
        if header.pruned:
            raise StepNotFoundError(f"step {header.step} (slot {header.slot}) was pruned by gc")
        table = self._tables.get(header.slot)
        if table is not None:
            return table
        data, where = self._table_bytes(header)
        # the header's crc32c covers the whole file, so the envelope's own check is redundant
        table = parse_arrays(data, where, verified=True)
        self._tables.put(header.slot, table)
        return table

    def table_columns(self, header: CommitHeader) -> dict[str, Any]:
        """The arrays table of a commit as its parsed columns (``manifest.TableBuilder``'s
        layout), verified, not cached: what the index's rows are built from."""
        if header.pruned:
            raise StepNotFoundError(f"step {header.step} (slot {header.slot}) was pruned by gc")
        data, where = self._table_bytes(header)
        return parse_arrays_columns(data, where, verified=True)

    def _table_bytes(self, header: CommitHeader) -> tuple[bytes, str]:
        loc = header.arrays
        if loc is None:
            raise CorruptRunError(
                f"{self.storage.location}: commit of step {header.step} names no arrays table"
            )
        where = f"{self.storage.location}/{loc.key}"
        try:
            data = self.storage.read_range(loc.key, loc.offset, loc.nbytes)
        except FileNotFoundError:
            self._raise_missing(header, where)
        if len(data) != loc.nbytes or checksum(data) != loc.crc32c:
            raise ChecksumError(
                f"{where}: arrays table (bytes {loc.offset}-"
                f"{loc.offset + loc.nbytes}) does not match its commit header"
            )
        return data, where

    def _raise_missing(self, header: CommitHeader, where: str) -> NoReturn:
        self._headers.pop(header.slot, None)
        key = commit_key(header.slot)
        try:  # the header file itself, not the index's copy: gc may have pruned it since
            now = parse_header(self.storage.read(key), f"{self.storage.location}/{key}")
        except (CorruptRunError, FileNotFoundError):
            now = header
        if now.pruned:
            raise StepNotFoundError(f"step {header.step} was pruned by gc while being read")
        raise CorruptRunError(f"{where}: file missing; step {header.step} is damaged")

    def scalar_rows(self, headers: Sequence[CommitHeader], *, summaries: bool = True) -> RowSet:
        """Metrics, metrics history and (``summaries``) write-time summaries of ``headers``
        as columns, from the index (pruned steps included: gc keeps their rows)."""
        return scalar_rows(self, list(headers), summaries=summaries)

    def located(self, header: CommitHeader, path: str) -> ArrayRecord | None:
        """The record of ``path`` in ``header``'s commit from the index alone (raw chunks;
        no arrays table read), or None: then read it from ``arrays(header)``."""
        if header.pruned:
            return None
        return self.index.located(header.slot, path)

    def read_many(self, headers: Sequence[CommitHeader], path: str) -> list[memoryview] | None:
        """Verified raw bytes of ``path`` at each of ``headers`` (a trajectory), or None
        when the index does not locate it in every one of them (read step by step then).
        One batched ``Storage.read_ranges`` of exactly the tensor's chunks: no arrays table,
        no zip directory. The cyclic GC is paused meanwhile: the loop allocates only acyclic
        tuples and bytes, and at 10,000 steps the collections it would trigger (walking every
        live header) took 40 % of the time."""
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._read_many(headers, path)
        finally:
            if paused:
                gc.enable()

    def _read_many(self, headers: Sequence[CommitHeader], path: str) -> list[memoryview] | None:
        found = self.index.locate_many([h.slot for h in headers], path)
        want: list[tuple[str, int, int]] = []
        crcs: list[int] = []
        sizes: list[int] = []  # per step: chunks, then each chunk's data bytes
        plans: dict[int, list[int]] = {}  # id(layout) -> [chunks, data bytes of each]
        for h, got in zip(headers, found, strict=True):
            if got is not None and not h.pruned:
                lay, crc = got
                chunks = lay[3]
                if len(chunks) == 1 and chunks[0][0] < 0:  # the flat lane's common case
                    want.append((step_file_key(h.slot), chunks[0][1], chunks[0][2]))
                    crcs.append(crc[0])
                else:
                    files = self.index.rows[h.slot][0].d["files"]
                    want += [
                        (step_file_key(h.slot) if f < 0 else files[f], off, n)
                        for f, off, n in chunks
                    ]
                    crcs += crc[: len(chunks)]
                known = plans.get(id(lay))
                if known is None:
                    p = ChunkPlan(lay[1], numpy_dtype(lay[0]).itemsize, lay[2])
                    known = plans[id(lay)] = [
                        p.n_chunks,
                        *(b - a for a, b in map(p.byte_range, range(p.n_chunks))),
                    ]
                sizes += known
                continue
            rec = self.arrays(h).get(path)  # the tail not indexed yet: its arrays table
            if (
                type(rec) is not ArrayRecord
                or len(rec.chunks) != rec.plan.n_chunks
                or any(c.encoding != "raw" for c in rec.chunks)
            ):
                return None  # absent, a view of other arrays (ZeRO), or encoded
            want += [(c.key, c.offset, c.nbytes) for c in rec.chunks]
            crcs += [c.crc32c for c in rec.chunks]
            rec_plan = rec.plan
            n = rec_plan.n_chunks
            sizes.append(n)
            sizes += [b - a for a, b in map(rec_plan.byte_range, range(n))]
        try:
            got_bytes = self.storage.read_ranges(want)
        except FileNotFoundError:  # pruned meanwhile, or damaged: the step-by-step path says
            return None
        out: list[memoryview] = []
        if len(want) == len(headers):  # one chunk per step: the tight loop
            for (_, _, nbytes), data, want_crc, size in zip(
                want, got_bytes, crcs, sizes[1::2], strict=True
            ):
                view = memoryview(data)
                if (
                    len(data) != nbytes
                    or checksum(view[:-4]) != want_crc
                    or int.from_bytes(data[-4:], "little") != want_crc
                ):
                    break  # the general loop below names the damaged chunk
                out.append(view[:size])
            else:
                return out
            out = []
        k = at = 0
        for h in headers:
            n = sizes[at]
            parts = []
            for i in range(n):
                data, want_crc = got_bytes[k], crcs[k]
                body = memoryview(data)[:-4]
                if (
                    len(data) != want[k][2]
                    or checksum(body) != want_crc
                    or data[-4:] != struct.pack("<I", want_crc)
                ):
                    raise ChecksumError(
                        f"{self.storage.location}/{want[k][0]}: crc32c "
                        f"mismatch (chunk {i} of {path!r}, step {h.step}); "
                        "the chunk is damaged"
                    )
                parts.append(body[: sizes[at + 1 + i]])
                k += 1
            at += 1 + n
            out.append(parts[0] if len(parts) == 1 else memoryview(b"".join(parts)))
        return out

    def record(self, header: CommitHeader, path: str) -> ArrayRecord:
        rec = self.located(header, path)
        if rec is not None:
            return rec
        table = self.arrays(header)
        try:
            return table[path]
        except KeyError:
            raise StepNotFoundError(f"step {header.step} has no array {path!r}") from None

    def read_chunk(self, header: CommitHeader, path: str, index: int) -> memoryview:
        """Verified bytes of chunk ``index`` of ``path`` (edge padding removed)."""
        return self.chunks.read_chunk(header, path, index)

    def read_array(self, header: CommitHeader, path: str) -> np.ndarray:
        """The whole tensor as a numpy array (bfloat16 as ``ml_dtypes.bfloat16``)."""
        rec = self.record(header, path)
        plan = rec.plan
        out = np.empty(plan.nbytes, dtype=np.uint8)
        for i in range(plan.n_chunks):
            start, stop = plan.byte_range(i)
            out[start:stop] = np.frombuffer(self.read_chunk(header, path, i), dtype=np.uint8)
        return out.view(numpy_dtype(rec.dtype)).reshape(rec.shape)

    def read_rows(self, header: CommitHeader, path: str, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of axis 0 of a tensor, reading only the chunks that hold them."""
        rec = self.record(header, path)
        plan = rec.plan
        if not rec.shape:
            return self.read_array(header, path)
        start, stop = max(0, start), min(rec.shape[0], stop)
        dt = numpy_dtype(rec.dtype)
        if stop <= start:
            return np.empty((0, *rec.shape[1:]), dtype=dt)
        first, last = start // plan.rows, (stop - 1) // plan.rows
        parts = [
            np.frombuffer(self.read_chunk(header, path, i), dtype=np.uint8)
            for i in range(first, last + 1)
        ]
        flat = np.concatenate(parts) if len(parts) > 1 else parts[0]
        block = flat.view(dt).reshape(-1, *rec.shape[1:])
        lo = start - first * plan.rows
        return block[lo : lo + (stop - start)]

    def read_object(self, header: CommitHeader, name: str, *, trusted: bool = False) -> Any:  # noqa: ANN401 - a stored object
        data = self.read_object_bytes(header, name)
        rec = header.objects[name]
        where = f"{self.storage.location}/{rec.key}"
        return decode_object(data, rec.encoding, trusted=trusted, where=where)

    def read_object_bytes(self, header: CommitHeader, name: str) -> bytes:
        """The stored bytes of object ``name``, checked against the commit but not decoded
        (nothing is unpickled: a caller decodes only what it needs, with
        ``dstt.store.format.objects.decode_object``)."""
        try:
            rec = header.objects[name]
        except KeyError:
            raise StepNotFoundError(
                f"step {header.step} has no object {name!r}; objects: {sorted(header.objects)}"
            ) from None
        where = f"{self.storage.location}/{rec.key}"
        try:
            data = self.storage.read_range(rec.key, rec.offset, rec.nbytes)
        except FileNotFoundError:
            self._raise_missing(header, where)
        if len(data) != rec.nbytes or checksum(data) != rec.crc32c:
            raise ChecksumError(f"{where}: object {name!r} does not match its commit")
        return data


def _describe(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{len(steps)} steps from {steps[0]} to {steps[-1]}"
