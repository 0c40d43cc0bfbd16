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

import contextlib
import gc
import json
import struct
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from dstt._lru import LRU
from dstt.errors import (
    ChecksumError,
    CorruptRunError,
    DsttError,
    FormatVersionError,
    NotARunError,
    StepNotFoundError,
    TimelineError,
)
from dstt.store.format.envelope import checksum
from dstt.store.format.layout import (
    COMMITS_PREFIX,
    HEAD_KEY,
    REFS_PREFIX,
    RELEASED_PREFIX,
    STEPS_PREFIX,
    ChunkPlan,
    check_timeline_name,
    commit_key,
    key_slot,
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
from dstt.store.index.view import Index, IndexedHeader, scalar_rows

from .chunks import ChunkReader

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from dstt.store.format.records import Location, ObjectRecord
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
        index: Index | None = None,
        use_index: bool = True,
    ) -> None:
        self.storage = storage
        #: the run's index (``index/view.py``): headers and tensor locations without a header
        #: read per step; loaded on first use, shared by a ``ReaderPool``'s readers;
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
        )
        self.refresh()

    # -- refs -----------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read HEAD and refs (cheap); drop cached headers that gc may have pruned.

        A missing or damaged ref or HEAD does not hide the run: it is recorded
        (``damaged_refs``, ``head_problem``) and the timelines whose ref is gone are rebuilt
        in memory from their commit headers (``recover_refs``); ``verify --repair`` writes them."""
        st = self.storage
        #: ref file key -> why it could not be read
        self.damaged_refs: dict[str, str] = {}
        #: why HEAD could not be read (the current timeline is then a guess), or None
        self.head_problem: str | None = None
        #: timelines rebuilt from their commit headers, their ref missing or damaged
        self.recovered: dict[str, RefInfo] = {}
        #: slot -> why its header could not be read, where a walk stepped over it
        self.bridged: dict[int, str] = {}
        head: str | None = None
        try:
            head = parse_head(st.read(HEAD_KEY), f"{st.location}/{HEAD_KEY}")
        except FileNotFoundError:
            self.head_problem = f"{st.location}/{HEAD_KEY}: missing"
        except FormatVersionError:
            raise
        except CorruptRunError as e:
            self.head_problem = str(e)
        refs = {}
        for name in st.list(REFS_PREFIX):
            if name.endswith(".json"):
                key = f"{REFS_PREFIX}/{name}"
                try:
                    r = parse_ref(st.read(key), f"{st.location}/{key}")
                except FileNotFoundError:  # deleted since the listing
                    continue
                except FormatVersionError:
                    raise
                except CorruptRunError as e:
                    self.damaged_refs[key] = str(e)
                    continue
                refs[r.name] = r
        self._refs = refs
        # tombstones are final; any other header may have become one since
        self._headers = {s: h for s, h in self._headers.items() if h.pruned}
        if self.index.loaded:
            self.index.load()
        if head is not None and head not in refs and not self.head_problem:
            self.head_problem = (
                f"{st.location}/{HEAD_KEY} names timeline {head!r}, which has no readable ref"
            )
        if self.head_problem or self.damaged_refs:
            self.recover_refs()
        if head is not None and head in self._refs:
            self.current_timeline = head
        elif self._refs:  # the timeline written last: what HEAD most likely named
            self.current_timeline = max(
                self._refs.values(), key=lambda t: (-1 if t.head is None else t.head, t.name)
            ).name
            self.head_problem = self.head_problem or f"{st.location}/{HEAD_KEY}: unreadable"
        else:
            raise NotARunError(
                f"{st.location} is not a dstt run, or its metadata is lost: "
                f"{self.head_problem or 'no timeline'}, no readable ref and no commit header "
                "that names a timeline"
            )

    def recover_refs(self) -> dict[str, RefInfo]:
        """Rebuild, in memory, the ref of every timeline whose commits no ref reaches and
        whose name has no readable ref: head = its newest intact commit, base = where its
        lineage enters another timeline. Reads every commit header (what ``verify`` and a
        damaged ref or HEAD pay for); returns what it added (also in ``recovered``)."""
        reached: set[int] = set()
        for name in list(self._refs):
            with contextlib.suppress(DsttError):
                reached |= {h.slot for h in self.walk(name)}
        tops: dict[str, CommitHeader] = {}  # name -> its newest commit (slots ascend)
        released = self.released()
        freed = {s for slots in released.values() for s in slots}  # any name: a renamed
        for n in self.all_slots():  # timeline's commits carry the name they were written under
            if n in reached or n in freed:
                continue
            try:
                h = self.header(n)
            except DsttError:
                continue
            if not h.pruned and h.timeline not in self._refs and h.timeline not in released:
                tops[h.timeline] = h
        added = {}
        for name, top in sorted(tops.items()):
            try:
                check_timeline_name(name)
            except TimelineError:
                continue
            base: CommitHeader | None = None
            first = top
            below = top.parent
            seen = {top.slot}
            while below is not None and below not in seen:
                seen.add(below)
                try:
                    h = self.header(below)
                except DsttError:
                    break
                if h.timeline != name:
                    base = h
                    break
                first, below = h, h.parent
            added[name] = RefInfo(
                name,
                top.slot,
                base_slot=None if base is None else base.slot,
                base_step=None if base is None else base.step,
                base_timeline=None if base is None else base.timeline,
                created=first.time,
            )
        self._refs.update(added)
        self.recovered.update(added)
        return added

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

    def released(self) -> dict[str, set[int]]:
        """Deleted or renamed timelines whose commits gc has not swept yet: name -> their
        slots (the record ``delete_timeline`` and ``rename_timeline`` write before the ref
        goes). Every user skips the slots a ref reaches first, so a record whose name has a
        ref again (reused, or a delete cut short before the ref went) releases nothing live."""
        st = self.storage
        out: dict[str, set[int]] = {}
        for name in st.list(RELEASED_PREFIX):
            try:
                doc = json.loads(st.read(f"{RELEASED_PREFIX}/{name}"))
                tl, slots = str(doc["timeline"]), {int(x) for x in doc["slots"]}
            except (OSError, ValueError, TypeError, KeyError):
                continue  # unreadable: nothing is released by it
            out[tl] = slots
        return out

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

        A damaged or missing header is stepped over, not a dead end: the walk goes on at
        the newest intact commit below it written under the same timeline name (the ref's
        fork point where there is none) and records the slot in ``bridged``, so the commits
        below it stay readable; that one step reads as ``CorruptRunError`` (``find``).
        Rejected alternative: ending the timeline at the damage, which hid every older step.
        """
        ref = self.ref(timeline)
        slot = ref.head
        name = ref.name
        seen: set[int] = set()
        while slot is not None:
            if slot in seen:
                raise CorruptRunError(f"{self.storage.location}: parent cycle at slot {slot}")
            seen.add(slot)
            try:
                h = self.header(slot)
            except FormatVersionError:
                raise
            except CorruptRunError as e:
                self.bridged[slot] = str(e)
                slot = self._bridge(slot, name, ref)
                continue
            yield h
            name, slot = h.timeline, h.parent

    def _bridge(self, damaged: int, name: str, ref: RefInfo) -> int | None:
        """The commit a walk goes on at below the damaged header of slot ``damaged``."""
        for slot in reversed(self.all_slots()):
            if slot >= damaged or slot in self.bridged:
                continue
            try:
                h = self.header(slot)
            except DsttError:
                continue
            if h.timeline == name:
                return slot
        if ref.base_slot is not None and ref.base_slot < damaged:
            return ref.base_slot
        return None

    def lineage(self, timeline: str | None = None) -> list[CommitHeader]:
        """Commits of a timeline, oldest first (pruned tombstones included)."""
        return list(self.walk(timeline))[::-1]

    def head(self, timeline: str | None = None) -> CommitHeader | None:
        slot = self.ref(timeline).head
        return None if slot is None else self.header(slot)

    def find(self, step: int, timeline: str | None = None) -> CommitHeader:
        """The commit of ``step`` on a timeline; ``StepNotFoundError`` if unknown or pruned."""
        name = timeline or self.current_timeline
        # newest first: a damaged older header does not hide it
        found = next((h for h in self.walk(name) if h.step == step), None)
        if found is not None and not found.pruned:
            return found
        kept = _describe([x.step for x in self.lineage(name) if not x.pruned])
        if found is not None:
            raise StepNotFoundError(
                f"step {step} of timeline {name!r} was pruned by gc; kept steps: {kept}"
            )
        if self.bridged:
            keys = ", ".join(commit_key(s) for s in sorted(self.bridged))
            raise CorruptRunError(
                f"no intact commit of step {step} on timeline {name!r} of "
                f"{self.storage.location}; the commit header(s) {keys} are damaged (one may be "
                "that step's): run `dstt verify --repair`"
            )
        raise StepNotFoundError(
            f"no committed step {step} on timeline {name!r} of {self.storage.location}; "
            f"committed steps: {kept}"
        )

    def max_slot(self) -> int:
        """Highest slot with any commit header (committed, orphaned or pruned) or any step
        file, or -1: the next writer starts above it, so it never overwrites the step files
        of a slot whose header is lost (gc keeps those; ``dstt verify`` reports them)."""
        return max([*self.all_slots(), *self.step_files().values()], default=-1)

    def all_slots(self) -> list[int]:
        slots = (parse_commit_name(n) for n in self.storage.list(COMMITS_PREFIX))
        return sorted(s for s in slots if s is not None)

    def step_files(self) -> dict[str, int]:
        """Every step and side file of the run (temporaries excluded) -> its slot."""
        keys = (f"{STEPS_PREFIX}/{n}" for n in self.storage.list(STEPS_PREFIX))
        return {k: s for k in keys if (s := key_slot(k)) is not None}

    # -- arrays ---------------------------------------------------------------------------
    def arrays(self, header: CommitHeader) -> dict[str, ArrayRecord]:
        """The arrays table of a commit (verified against the header's crc32c)."""
        table = None if header.pruned else self._tables.get(header.slot)
        if table is None:
            # the header's crc32c covers the whole file, so the envelope's own check is redundant
            table = parse_arrays(*self._table_bytes(header), verified=True)
            self._tables.put(header.slot, table)
        return table

    def table_columns(self, header: CommitHeader) -> dict[str, Any]:
        """The arrays table of a commit as its parsed columns (``manifest.TableBuilder``'s
        layout), verified, not cached: what the index's rows are built from."""
        return parse_arrays_columns(*self._table_bytes(header), verified=True)

    def _table_bytes(self, header: CommitHeader) -> tuple[bytes, str]:
        """The verified bytes of a commit's arrays table, and where they lie."""
        if header.pruned:
            raise StepNotFoundError(f"step {header.step} (slot {header.slot}) was pruned by gc")
        loc = header.arrays
        if loc is None:
            raise CorruptRunError(
                f"{self.storage.location}: commit of step {header.step} names no arrays table"
            )
        what = f"arrays table (bytes {loc.offset}-{loc.offset + loc.nbytes})"
        return self._verified(header, loc, f"{what} does not match its commit header")

    def _verified(
        self, header: CommitHeader, loc: Location | ObjectRecord, mismatch: str
    ) -> tuple[bytes, str]:
        """The bytes ``loc`` names in ``header``'s commit, checked against its size and
        crc32c (``ChecksumError``: ``mismatch``), and where they lie."""
        where = f"{self.storage.location}/{loc.key}"
        try:
            data = self.storage.read_range(loc.key, loc.offset, loc.nbytes)
        except FileNotFoundError:
            self._raise_missing(header, where)
        if len(data) != loc.nbytes or checksum(data) != loc.crc32c:
            raise ChecksumError(f"{where}: {mismatch}")
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

    def carrying(self, headers: Sequence[CommitHeader], name: str) -> list[CommitHeader]:
        """The headers among ``headers`` whose commit may carry object ``name`` (all that do;
        a few more at most): the index's rows are searched in their header bytes, in one read
        per segment, instead of parsing every header (seconds at 10,000 steps)."""
        # as the canonical header JSON spells the name (json.dumps, ASCII escapes)
        indexed = self.index.slots_mentioning(json.dumps(name).encode())
        return [h for h in headers if h.slot in indexed or not isinstance(h, IndexedHeader)]

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
                    known = plans[id(lay)] = _sizes(p)
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
            sizes += _sizes(rec.plan)
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
        return self._verified(header, rec, f"object {name!r} does not match its commit")[0]


def _sizes(plan: ChunkPlan) -> list[int]:
    """``[chunks, data bytes of each]``: one step's entry in ``_read_many``'s ``sizes``."""
    return [plan.n_chunks, *(b - a for a, b in map(plan.byte_range, range(plan.n_chunks)))]


def _describe(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{len(steps)} steps from {steps[0]} to {steps[-1]}"
