"""The run's index, reading side: a derived cache of the commit headers that readers open fast.

The headers stay the source of truth. The index is a set of checksummed *segments* of columnar
rows (``format/segment.py``); a reader loads every segment's core columns and, for a slot with
no row (the unindexed *tail*, a lost segment), reads the header itself: a missing row costs a
read, never a wrong answer. Rows never change once their ref moved, but for gc's tombstones:
while gc's marker ``_dstt/index/gc.json`` exists, the rows of the slots it names are distrusted.
The newer generation's row wins where segments overlap.

Rejected: one module for both sides (a reader would load the writer's jobs and merges it never
runs): writing, merging and the jobs are ``writer.py``, which imports this module.
"""

from __future__ import annotations

import functools
import json
import threading
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dstt.errors import CorruptRunError, DsttError, StepNotFoundError
from dstt.store.format.layout import INDEX_PREFIX, commit_key, parse_index_name, step_file_key
from dstt.store.format.manifest import parse_header
from dstt.store.format.records import ArrayRecord, ChunkRecord, CommitHeader
from dstt.store.format.segment import (
    SCALARS,
    Layout,
    Locations,
    RowSet,
    blob,
    concat,
    core_span,
    decode_core,
    decode_locations,
    decode_rest,
    read_directory,
)

from .rows import rows_from_headers, take
from .source import HeaderSource

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from dstt.store.storage.base import Storage

__all__ = ["GC_MARKER", "Index", "IndexedHeader", "IndexedSource", "scalar_rows"]

GC_MARKER = f"{INDEX_PREFIX}/gc.json"


class IndexedHeader(CommitHeader):
    """A commit header known from the index: the core fields at once, the rest (metrics,
    objects, arrays table location) parsed from the header bytes the segment keeps, on first
    use. Equal to the header it was indexed from (``full()``)."""

    # built by ``Index.header`` through ``_indexed`` (no ``__init__``: a lineage makes one per
    # row, 10,000 for a 10,000-step run, and the keyword call was most of the walk's time)
    _fetch: Callable[[], CommitHeader]

    def full(self) -> CommitHeader:
        h: CommitHeader | None = self.__dict__["_h"]
        if h is None:
            h = self.__dict__["_fetch"]()
            core = ("slot", "step", "timeline", "parent")
            same = all(getattr(h, k) == getattr(self, k) for k in core)
            if same and h.pruned > self.pruned:
                raise StepNotFoundError(  # a gc elsewhere pruned it since this view was read
                    f"step {self.step} (slot {self.slot}) was pruned by gc after this view of "
                    "the run was opened; refresh it (run.refresh()) to see what is kept"
                )
            if not same or h.pruned != self.pruned:
                raise CorruptRunError(
                    f"index row of slot {self.slot} disagrees with its "
                    "header bytes; run `dstt index` to rebuild the index"
                )
            self.__dict__["_h"] = h
        return h

    metrics = property(lambda self: self.full().metrics)
    objects = property(lambda self: self.full().objects)
    arrays = property(lambda self: self.full().arrays)


class _Segment:
    def __init__(self, st: Storage, name: str) -> None:
        self.name, self.key = name, f"{INDEX_PREFIX}/{name}"
        parsed = parse_index_name(name)
        assert parsed is not None
        self.lo, self.hi, self.gen = parsed
        where = f"{st.location}/{self.key}"
        head = st.read_range(self.key, 0, 1 << 16)
        got = read_directory(head, where)
        if isinstance(got, int):
            head = st.read_range(self.key, 0, got)
            got = read_directory(head, where)
            if isinstance(got, int):
                raise CorruptRunError(f"{where}: truncated index segment")
        self.d, self.base = got
        lo, hi = core_span(self.d)
        data = (
            head[self.base + lo : self.base + hi]
            if self.base + hi <= len(head)
            else st.read_range(self.key, self.base + lo, hi - lo)
        )
        self.core = decode_core(self.d, data, lo, where)
        self.n = int(self.d["n"])
        self.timelines: list[str] = list(self.d["timelines"])
        self._loc: dict[str, Locations | None] = {}
        self._locdir: dict[str, Any] | None = None
        self._lock = threading.Lock()

    @functools.cached_property
    def lists(self) -> tuple[list[Any], ...]:
        """The core columns as Python lists (``slot step parent timeline time pruned``), made
        once: a lineage builds one header per row, and a numpy scalar per field and row cost
        more than the rest of the walk."""
        names = ("slot", "step", "parent", "timeline", "time", "pruned")
        return tuple(self.core[k].tolist() for k in names)

    def read_blob(self, st: Storage, name: str) -> Any:  # noqa: ANN401 - bytes or an array, by the blob's kind
        off, nbytes = self.d["blobs"][name][:2]
        data = st.read_range(self.key, self.base + off, nbytes)
        return blob(self.d, name, data, off, f"{st.location}/{self.key}")

    def header_bytes(self, st: Storage, i: int) -> bytes:
        offs = self.core["hdr_off"]
        at = self.base + self.d["blobs"]["hdr"][0] + int(offs[i])
        return st.read_range(self.key, at, int(offs[i + 1] - offs[i]))

    def rows_mentioning(self, st: Storage, needle: bytes) -> set[int]:
        """Rows whose header bytes contain ``needle``: one read of all of them and a byte
        search, instead of parsing each header (~0.1 ms a row)."""
        offs = self.core["hdr_off"]
        raw = st.read_range(self.key, self.base + self.d["blobs"]["hdr"][0], int(offs[-1]))
        hits, at = [], raw.find(needle)
        while at >= 0:
            hits.append(at)
            at = raw.find(needle, at + 1)
        return set((np.searchsorted(offs, hits, side="right") - 1).tolist()) if hits else set()

    def locations(self, st: Storage, path: str) -> Locations | None:
        """The locations of ``path`` in every row; None where it has none, or where the
        segment is damaged (the arrays tables know them too)."""
        with self._lock:
            if path in self._loc:
                return self._loc[path]
            got = None
            try:
                if self._locdir is None:
                    self._locdir = json.loads(self.read_blob(st, "locdir"))
                ent = self._locdir.get(path)
                if ent is not None:
                    raw = st.read_range(self.key, self.base + ent[0], ent[1])
                    got = decode_locations(path, ent, raw, self.n, f"{st.location}/{self.key}")
            except (DsttError, OSError, ValueError):  # damaged, or merged away by a gc since
                return None
            self._loc[path] = got
            return got

    def scalars(self, st: Storage, summaries: bool) -> RowSet:
        """Metrics (and with ``summaries`` the write-time summaries) of every row, reading
        only those blobs: what ``Run.metrics()``/``summaries()`` need."""
        where = f"{st.location}/{self.key}"
        names = ["m_num", "m_extra"] + (
            ["s_has", "s_val", "s_exact", "s_probe"] if summaries else []
        )
        b = self.d["blobs"]
        lo = min(b[x][0] for x in names)
        hi = max(b[x][0] + b[x][1] for x in names)
        data = st.read_range(self.key, self.base + lo, hi - lo)
        got = {x: blob(self.d, x, data, lo, where) for x in names}
        extra = json.loads(got["m_extra"])
        n, c = self.n, self.core
        rs = RowSet(
            slot=c["slot"],
            step=c["step"],
            parent=c["parent"],
            timeline=c["timeline"],
            pruned=c["pruned"],
            time=c["time"],
            timelines=self.timelines,
            headers=[b""] * n,
            m_names=list(self.d["m_names"]),
            m_num=got["m_num"],
            m_text=[extra["text"].get(str(i)) for i in range(n)],
            m_hist=[extra["hist"].get(str(i)) for i in range(n)],
        )
        if summaries:
            rs.s_paths, rs.s_has, rs.s_val = list(self.d["s_paths"]), got["s_has"], got["s_val"]
            rs.s_exact, rs.s_probe = got["s_exact"], got["s_probe"]
        else:
            rs.s_has = np.zeros(n, np.uint8)
            rs.s_val = np.zeros((n, 0, len(SCALARS)))
            rs.s_exact = np.zeros((n, 0), np.uint8)
            rs.s_probe = np.zeros((n, 0, 0), np.float32)
        return rs

    def rows(self, st: Storage) -> RowSet:
        data = st.read_range(self.key, self.base, st.size(self.key) - self.base)
        return decode_rest(self.d, self.core, data, f"{st.location}/{self.key}")


def _fetch(st: Storage, seg: _Segment, i: int, slot: int) -> CommitHeader:
    """How an ``IndexedHeader`` reads its full header: from the segment's header bytes, or
    the header file itself when the segment is damaged or gone."""
    try:
        return parse_header(seg.header_bytes(st, i), f"{st.location}/{seg.key} (row {i})")
    except (DsttError, OSError):  # a damaged or vanished segment: the header itself
        key = commit_key(slot)
        return parse_header(st.read(key), f"{st.location}/{key}")


def _indexed(fields: dict[str, Any]) -> IndexedHeader:
    """An ``IndexedHeader`` whose ``__dict__`` is ``fields`` (the frozen dataclass's own
    ``__setattr__`` refuses assignments)."""
    h = object.__new__(IndexedHeader)
    object.__setattr__(h, "__dict__", fields)
    return h


class Index:
    """The reader's view of the index: which slots have rows, and what they say."""

    def __init__(self, storage: Storage, *, enabled: bool = True) -> None:
        self.storage = storage
        self.enabled = enabled  # False: no rows (verify reads every header itself)
        self._segs: dict[str, _Segment] = {}
        self.problems: list[tuple[str, str]] = []  # (key, message) of segments ignored
        self.distrusted: set[int] = set()
        #: slot -> (segment, row)
        self.rows: dict[int, tuple[_Segment, int]] = {}
        self.loaded = False  # whether the segments were read (``load``) at least once
        self._lock = threading.Lock()

    def load(self) -> Index:
        """(Re-)read the list of segments; segments already read are kept (immutable)."""
        with self._lock:
            st = self.storage
            names = (
                sorted(n for n in st.list(INDEX_PREFIX) if parse_index_name(n) is not None)
                if self.enabled
                else []
            )
            segs: dict[str, _Segment] = {}
            problems = []
            for n in names:
                seg = self._segs.get(n)
                if seg is None:
                    try:
                        seg = _Segment(st, n)
                    except FileNotFoundError:  # merged away meanwhile: its rows are elsewhere
                        continue
                    except (DsttError, ValueError, KeyError, TypeError) as e:
                        problems.append((f"{INDEX_PREFIX}/{n}", str(e)))
                        continue
                segs[n] = seg
            try:
                marker = json.loads(st.read(GC_MARKER)) if names else {"slots": []}
                distrusted = {int(s) for s in marker["slots"]}
            except FileNotFoundError:
                distrusted = set()
            except (ValueError, KeyError, TypeError):
                distrusted = {-1}  # unreadable marker: trust no row at all
            rows: dict[int, tuple[_Segment, int]] = {}
            for seg in sorted(segs.values(), key=lambda s: s.gen):  # newer generations win
                rows.update(
                    zip(seg.core["slot"].tolist(), ((seg, i) for i in range(seg.n)), strict=True)
                )
            if -1 in distrusted:
                rows.clear()
            for s in distrusted:
                rows.pop(s, None)
            self._segs, self.rows, self.problems = segs, rows, problems
            self.distrusted = distrusted
            self.loaded = True
            return self

    def slots_mentioning(self, needle: bytes) -> set[int]:
        """Slots of the index's rows whose header bytes contain ``needle`` (a superset of
        the commits carrying an object of that name; slots the index has no row for are
        not answered here: check their headers)."""
        self.ensure()
        out: set[int] = set()
        for seg in self.segments:
            try:
                hits: Iterable[int] = seg.rows_mentioning(self.storage, needle)
            except (DsttError, OSError, ValueError):  # damaged, or merged away by a gc since
                hits = range(seg.n)  # every row of it may: a superset, never a miss
            for i in hits:
                slot = int(seg.core["slot"][i])
                if self.rows.get(slot) == (seg, i):  # the row in use (newest generation)
                    out.add(slot)
        return out

    @property
    def segments(self) -> list[_Segment]:
        return sorted(self._segs.values(), key=lambda s: s.gen)

    @property
    def next_gen(self) -> int:
        """The generation of a new segment: above every segment's, so its rows win."""
        return max((s.gen for s in self.segments), default=0) + 1

    def ensure(self) -> Index:
        return self if self.loaded else self.load()

    def header(self, slot: int) -> IndexedHeader | None:
        got = self.ensure().rows.get(slot)
        if got is None:
            return None
        seg, i = got
        slots, steps, parents, tls, times, pruned = seg.lists
        parent = parents[i]
        return _indexed(
            {
                "slot": slots[i],
                "step": steps[i],
                "timeline": seg.timelines[tls[i]],
                "parent": None if parent < 0 else parent,
                "time": times[i],
                "pruned": bool(pruned[i]),
                "_fetch": functools.partial(_fetch, self.storage, seg, i, slot),
                "_h": None,
            }
        )

    def locate_many(self, slots: list[int], path: str) -> list[tuple[Layout, list[int]] | None]:
        """Per slot, the layout of ``path`` and its chunks' crc32c, or None (not indexed,
        pruned, absent, encoded): ``located`` for many steps, without record objects."""
        idx = self.ensure()
        out: list[tuple[Layout, list[int]] | None] = []
        cache: dict[str, tuple[Any, ...] | None] = {}  # per segment: its columns as lists
        for slot in slots:
            got = idx.rows.get(slot)
            if got is None:
                out.append(None)
                continue
            seg, i = got
            if seg.key not in cache:
                raw = seg.locations(self.storage, path)
                cache[seg.key] = (
                    None
                    if raw is None
                    else (
                        raw.ids.tolist(),
                        raw.crc.tolist(),
                        raw.layouts,
                        seg.core["pruned"].tolist(),
                    )
                )
            loc = cache[seg.key]
            if loc is None or loc[3][i] or loc[0][i] < 0:
                out.append(None)
            else:
                out.append((loc[2][loc[0][i]], loc[1][i]))
        return out

    def located(self, slot: int, path: str) -> ArrayRecord | None:
        """The arrays-table record of ``path`` in ``slot`` from the index (raw chunks only),
        or None (no row, pruned, the tensor absent or encoded: read the arrays table)."""
        got = self.ensure().rows.get(slot)
        if got is None:
            return None
        seg, i = got
        loc = None if seg.core["pruned"][i] else seg.locations(self.storage, path)
        if loc is None:
            return None
        j = int(loc.ids[i])
        if j < 0:
            return None
        dtype, shape, nrows, chunks, dims = loc.layouts[j]
        files = seg.d["files"]
        own = step_file_key(slot)
        recs = tuple(
            ChunkRecord(own if f < 0 else files[f], b, int(loc.crc[i, k]), offset=o)
            for k, (f, o, b) in enumerate(chunks)
        )
        return ArrayRecord(path, dtype, shape, nrows, recs, dims)


class IndexedSource(HeaderSource, Protocol):
    """A run's headers and its index (the store's ``Reader``): what ``scalar_rows``, the
    index writer and the repairs read a run through (``source.py``)."""

    @property
    def index(self) -> Index: ...


def scalar_rows(reader: IndexedSource, headers: list[CommitHeader], *, summaries: bool) -> RowSet:
    """Index rows (metrics, history, summaries) of ``headers``, in their order: from the
    segments where they have rows, from the headers and step files for the rest (the tail)."""
    idx = reader.index.ensure()
    groups: dict[str, tuple[_Segment, list[int], list[int]]] = {}
    tail: list[int] = []
    for pos, h in enumerate(headers):
        got = idx.rows.get(h.slot)
        if got is None:
            tail.append(pos)
            continue
        g = groups.setdefault(got[0].key, (got[0], [], []))
        g[1].append(pos)
        g[2].append(got[1])
    parts, order = [], []
    for seg, pos_list, rows in groups.values():
        try:
            cols = seg.scalars(reader.storage, summaries)
        except (DsttError, OSError, ValueError):  # damaged: read these rows' headers instead
            tail += pos_list
            continue
        whole = len(rows) == seg.n and rows == list(range(seg.n))
        parts.append(cols if whole else take(cols, np.array(rows, np.int64)))
        order += pos_list
    if tail:
        parts.append(
            rows_from_headers(
                reader, [headers[p] for p in tail], summaries=summaries, locations=False
            )
        )
        order += tail
    if not parts:
        return rows_from_headers(reader, [])
    out = concat(parts)
    if order == list(range(len(order))):
        return out
    return take(out, np.argsort(np.array(order, np.int64), kind="stable"))
