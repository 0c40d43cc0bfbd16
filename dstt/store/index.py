"""The run's index: a derived, immutable cache of the commit headers that readers open fast.

The commit headers stay the source of truth. The index is a set of *segments*
(``format/segment.py``), each a checksummed file of columnar rows for some slots; a reader
loads every segment's core columns (a few range reads each), and for a slot with no row — the
*tail* the writer has not indexed yet, a segment lost or damaged — reads the header itself. So
a missing row costs a header read, never a wrong answer. Rows are facts about headers that
never change once their ref moved, with one exception, gc's tombstones, handled below.

Writing (``IndexWriter``, driven by the exclusive writer): after a commit's ref moves its
header joins ``pending``; every ``every`` (64) commits the pending rows become one new segment
(durable), and when the 8 newest segments are of one size tier they are merged into one and
deleted (LSM), so a run of 100,000 steps has a few dozen segments. A writer opening a run
queues the tail a crashed session left. Where segments overlap, the newer generation's row wins.

gc (``maintenance.gc``) keeps every row — metrics, write-time summaries, history — of the steps
it prunes: the index is where the scalars of a pruned step live on after its files are gone.
Its order, each step durable before the next: (1) a marker ``_dstt/index/gc.json`` naming the
slots about to be pruned (readers distrust those rows while it exists and read their headers),
(2) the tombstones, (3) one new segment of every row with the pruned ones marked, (4) delete
the older segments, (5) delete the marker, (6) delete the step files. A cut anywhere leaves
rows that agree with the headers or rows a reader ignores; a writer (or ``dstt index``) that
finds a marker re-indexes the marked slots. ``index_repair.rebuild`` re-derives the whole
index from the headers (summaries of pruned steps come from any segment that still holds them);
``index_rows`` turns headers into rows.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ChecksumError, CorruptRunError, DsttError, StepNotFoundError
from .format.layout import INDEX_PREFIX, commit_key, index_key, parse_index_name, step_file_key
from .format.manifest import (
    ArrayRecord,
    ChunkRecord,
    CommitHeader,
    checksum,
    parse_header,
)
from .format.segment import (
    SCALARS,
    Layout,
    RowSet,
    blob,
    concat,
    core_span,
    decode_core,
    decode_rest,
    encode,
    layout_of,
    read_directory,
)
from .index_job import IndexJob
from .index_rows import dedup, keep_summaries, rows_from_headers, take

if TYPE_CHECKING:
    from .reader import Reader
    from .storage.base import Storage

__all__ = ["GC_MARKER", "Index", "IndexWriter", "IndexedHeader", "scalar_rows", "write_segment"]

GC_MARKER = f"{INDEX_PREFIX}/gc.json"
EVERY = 64
FANOUT = 8
CLOSE_MIN = 8
#: background jobs start at most this often (each is an interpreter start, ~0.1-0.2 s of CPU:
#: every 64 commits of a 7 ms step it took a quarter of a core), unless the pending rows
#: reach ``JOB_MAX_TAIL`` segments' worth (a reader reads the tail from headers meanwhile)
JOB_INTERVAL_S = 10.0
JOB_MAX_TAIL = 16


class IndexedHeader(CommitHeader):
    """A commit header known from the index: the core fields at once, the rest (metrics,
    objects, arrays table location) parsed from the header bytes the segment keeps, on first
    use. Equal to the header it was indexed from (``full()``)."""

    def __init__(self, fetch: Callable[[], CommitHeader], slot: int, step: int, timeline: str,
                 parent: int | None, time: float, pruned: bool) -> None:
        self.__dict__.update(slot=slot, step=step, timeline=timeline, parent=parent, time=time,
                             pruned=pruned, _fetch=fetch, _h=None)

    def full(self) -> CommitHeader:
        h: CommitHeader | None = self.__dict__["_h"]
        if h is None:
            h = self.__dict__["_fetch"]()
            if (h.slot, h.step, h.timeline, h.parent) == (
                    self.slot, self.step, self.timeline, self.parent) and h.pruned > self.pruned:
                raise StepNotFoundError(  # a gc elsewhere pruned it since this view was read
                    f"step {self.step} (slot {self.slot}) was pruned by gc after this view of "
                    "the run was opened; refresh it (run.refresh()) to see what is kept")
            if (h.slot, h.step, h.timeline, h.parent, h.pruned) != (
                    self.slot, self.step, self.timeline, self.parent, self.pruned):
                raise CorruptRunError(f"index row of slot {self.slot} disagrees with its "
                                      "header bytes; run `dstt index` to rebuild the index")
            self.__dict__["_h"] = h
        return h

    metrics = property(lambda self: self.full().metrics)  # type: ignore[assignment]
    objects = property(lambda self: self.full().objects)  # type: ignore[assignment]
    arrays = property(lambda self: self.full().arrays)  # type: ignore[assignment]


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
        data = head[self.base + lo:self.base + hi] if self.base + hi <= len(head) else \
            st.read_range(self.key, self.base + lo, hi - lo)
        self.core = decode_core(self.d, data, lo, where)
        self.n = int(self.d["n"])
        self.timelines: list[str] = list(self.d["timelines"])
        self._loc: dict[str, tuple[np.ndarray, np.ndarray, list[Layout]] | None] = {}
        self._locdir: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def read_blob(self, st: Storage, name: str) -> Any:
        off, nbytes = self.d["blobs"][name][:2]
        data = st.read_range(self.key, self.base + off, nbytes)
        return blob(self.d, name, data, off, f"{st.location}/{self.key}")

    def header_bytes(self, st: Storage, i: int) -> bytes:
        offs = self.core["hdr_off"]
        at = self.base + self.d["blobs"]["hdr"][0] + int(offs[i])
        return st.read_range(self.key, at, int(offs[i + 1] - offs[i]))

    def locations(self, st: Storage, path: str) -> tuple[np.ndarray, np.ndarray,
                                                         list[Layout]] | None:
        with self._lock:
            if path in self._loc:
                return self._loc[path]
            if self._locdir is None:
                self._locdir = json.loads(self.read_blob(st, "locdir"))
            ent = self._locdir.get(path)
            got = None
            if ent is not None:
                off, nbytes, crc, width, lays = ent
                raw = st.read_range(self.key, self.base + off, nbytes)
                if len(raw) != nbytes or checksum(raw) != crc:
                    raise ChecksumError(f"{st.location}/{self.key}: index locations of "
                                        f"{path!r} fail their crc32c")
                ids = np.frombuffer(raw[:4 * self.n], "<i4")
                crcs = np.frombuffer(raw[4 * self.n:], "<u4").reshape(self.n, width)
                got = (ids, crcs, [layout_of(x) for x in lays])
            self._loc[path] = got
            return got

    def scalars(self, st: Storage, summaries: bool) -> RowSet:
        """Metrics (and with ``summaries`` the write-time summaries) of every row, reading
        only those blobs: what ``Run.metrics()``/``summaries()`` need."""
        where = f"{st.location}/{self.key}"
        names = ["m_num", "m_extra"] + (["s_has", "s_val", "s_exact", "s_probe"]
                                        if summaries else [])
        b = self.d["blobs"]
        lo = min(b[x][0] for x in names)
        hi = max(b[x][0] + b[x][1] for x in names)
        data = st.read_range(self.key, self.base + lo, hi - lo)
        got = {x: blob(self.d, x, data, lo, where) for x in names}
        extra = json.loads(got["m_extra"])
        n, c = self.n, self.core
        rs = RowSet(slot=c["slot"], step=c["step"], parent=c["parent"], timeline=c["timeline"],
                    pruned=c["pruned"], time=c["time"], timelines=self.timelines,
                    headers=[b""] * n, m_names=list(self.d["m_names"]), m_num=got["m_num"],
                    m_text=[extra["text"].get(str(i)) for i in range(n)],
                    m_hist=[extra["hist"].get(str(i)) for i in range(n)])
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
        self._loaded = False
        self._lock = threading.Lock()

    def load(self) -> Index:
        """(Re-)read the list of segments; segments already read are kept (immutable)."""
        with self._lock:
            st = self.storage
            names = sorted(n for n in st.list(INDEX_PREFIX) if parse_index_name(n) is not None
                           ) if self.enabled else []
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
                rows.update(zip(seg.core["slot"].tolist(), ((seg, i) for i in range(seg.n)),
                                strict=True))
            if -1 in distrusted:
                rows.clear()
            for s in distrusted:
                rows.pop(s, None)
            self._segs, self.rows, self.problems = segs, rows, problems
            self.distrusted = distrusted
            self._loaded = True
            return self

    @property
    def segments(self) -> list[_Segment]:
        return sorted(self._segs.values(), key=lambda s: s.gen)

    def ensure(self) -> Index:
        return self if self._loaded else self.load()

    def header(self, slot: int) -> IndexedHeader | None:
        got = self.ensure().rows.get(slot)
        if got is None:
            return None
        seg, i = got
        c = seg.core
        st = self.storage

        def fetch() -> CommitHeader:
            try:
                return parse_header(seg.header_bytes(st, i), f"{st.location}/{seg.key} (row {i})")
            except (DsttError, OSError):  # a damaged or vanished segment: the header itself
                key = commit_key(slot)
                return parse_header(st.read(key), f"{st.location}/{key}")

        parent = int(c["parent"][i])
        return IndexedHeader(fetch, int(c["slot"][i]), int(c["step"][i]),
                             seg.timelines[int(c["timeline"][i])],
                             None if parent < 0 else parent, float(c["time"][i]),
                             bool(c["pruned"][i]))

    def locate_many(self, slots: list[int], path: str
                    ) -> list[tuple[Layout, list[int]] | None]:
        """Per slot, the layout of ``path`` and its chunks' crc32c, or None (not indexed,
        pruned, absent, encoded): ``located`` for many steps, without record objects."""
        idx = self.ensure()
        out: list[tuple[Layout, list[int]] | None] = []
        cache: dict[str, tuple[Any, ...]] = {}
        for slot in slots:
            got = idx.rows.get(slot)
            if got is None:
                out.append(None)
                continue
            seg, i = got
            loc = cache.get(seg.key)
            if loc is None:
                try:
                    raw = seg.locations(self.storage, path)
                except (DsttError, OSError, ValueError):
                    raw = None
                loc = cache[seg.key] = (False,) if raw is None else (
                    True, raw[0].tolist(), raw[1].tolist(), raw[2], seg.core["pruned"].tolist())
            if not loc[0] or loc[4][i]:
                out.append(None)
                continue
            j = loc[1][i]
            out.append(None if j < 0 else (loc[3][j], loc[2][i]))
        return out

    def located(self, slot: int, path: str) -> ArrayRecord | None:
        """The arrays-table record of ``path`` in ``slot`` from the index (raw chunks only),
        or None (no row, pruned, the tensor absent or encoded: read the arrays table)."""
        got = self.ensure().rows.get(slot)
        if got is None:
            return None
        seg, i = got
        if seg.core["pruned"][i]:
            return None
        try:
            loc = seg.locations(self.storage, path)
        except (DsttError, OSError, ValueError):  # damaged: the arrays table knows too
            return None
        if loc is None:
            return None
        ids, crcs, lays = loc
        j = int(ids[i])
        if j < 0:
            return None
        dtype, shape, nrows, chunks, dims = lays[j]
        files = seg.d["files"]
        own = step_file_key(slot)
        recs = tuple(ChunkRecord(own if f < 0 else files[f], b, int(crcs[i, k]), offset=o)
                     for k, (f, o, b) in enumerate(chunks))
        return ArrayRecord(path, dtype, shape, nrows, recs, dims)


def scalar_rows(reader: Reader, headers: list[CommitHeader], *, summaries: bool) -> RowSet:
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
        parts.append(rows_from_headers(reader, [headers[p] for p in tail],
                                       summaries=summaries, locations=False))
        order += tail
    if not parts:
        return rows_from_headers(reader, [])
    out = concat(parts)
    if order == list(range(len(order))):
        return out
    return take(out, np.argsort(np.array(order, np.int64), kind="stable"))


# -- rows from headers --------------------------------------------------------------------------

def write_segment(st: Storage, rows: RowSet, gen: int) -> str:
    """Write ``rows`` (deduplicated, by slot) as a new segment, durably; returns its key."""
    rows = dedup(rows)
    key = index_key(int(rows.slot.min()), int(rows.slot.max()), gen)
    st.write_durable(key, encode(rows, gen))
    return key


def _tier(n: int, every: int) -> int:
    t, size = 0, every * FANOUT
    while n >= size:
        t, size = t + 1, size * FANOUT
    return t


class IndexWriter:
    """The exclusive writer's side of the index: pending rows, segments, merges."""

    def __init__(self, reader: Reader, *, every: int = EVERY,
                 background: bool | None = None) -> None:
        """``background``: write segments from a job process (default: for a run on local
        files, unless ``DSTT_INDEX_JOBS=0``), so the committer never spends the GIL on rows."""
        self.reader, self.storage, self.every = reader, reader.storage, max(1, every)
        self.index = reader.index.load()
        self.pending: dict[int, CommitHeader] = {}
        if background is None:
            background = IndexJob.supported(self.storage)
        self.background = background
        self.job: IndexJob | None = None
        self._job_slots: list[int] = []
        self._job_started = -math.inf  # the first segment's worth goes at once
        if self.index.distrusted:  # a gc was cut short: re-index the slots it marked
            self._repair_marked()
        for tl in reader.timelines:  # the tail: reachable slots without a row
            try:
                for h in reader.walk(tl):
                    if h.slot in self.index.rows or h.slot in self.pending:
                        break
                    self.pending[h.slot] = h
            except DsttError:  # a damaged header: what lies below it is verify's business;
                continue       # the commits above it are queued, and the writer opens

    def _repair_marked(self) -> None:
        st = self.storage
        marked = self.index.distrusted
        reachable = {}
        for tl in self.reader.timelines:
            for h in self.reader.walk(tl):
                if h.slot in marked:
                    reachable[h.slot] = h
        if reachable:
            rows = rows_from_headers(self.reader, reachable.values())
            old = {}
            for seg in self.index.segments:
                sel = [i for i, s in enumerate(seg.core["slot"].tolist()) if s in reachable]
                if sel:
                    got = take(seg.rows(st), np.array(sel))
                    old.update({int(s): (got, i) for i, s in enumerate(got.slot.tolist())})
            rows = keep_summaries(rows, old)
            write_segment(st, rows, self._next_gen())
        st.delete(GC_MARKER)
        self.index.load()

    def _next_gen(self) -> int:
        return max((s.gen for s in self.index.segments), default=0) + 1

    def add(self, header: CommitHeader) -> None:
        """A commit's ref moved: queue its row; write a segment when ``every`` are queued
        (in the background where a job process can do it: ``background.py``)."""
        self.pending[header.slot] = header
        if self.job is not None and self.job.done():
            self._reap()
        if len(self.pending) >= self.every and self.job is None:
            if not self.background:
                self.flush()
            elif (len(self.pending) >= JOB_MAX_TAIL * self.every
                  or time.monotonic() - self._job_started >= JOB_INTERVAL_S):
                self._start_job()

    def close(self) -> None:
        """At the writer's close: write the pending rows if there are ``CLOSE_MIN`` (8) or
        more (fewer stay the tail, read from their headers and arrays tables: a session of a
        few commits adds no file). With background jobs (local files) fewer than ``every``
        stay the tail too — a job for them would cost the close seconds at a thousand
        tensors; the next writer queues them, a reader reads their headers meanwhile — and
        ``every`` or more go to one last job, waited for."""
        self.wait()
        if self.background and len(self.pending) >= self.every:  # a segment's worth: one job
            self._start_job()
            self.wait()
        elif not self.background and len(self.pending) >= min(CLOSE_MIN, self.every):
            self.flush()

    def wait(self) -> None:
        """Let a background segment write finish (before anything else writes the index:
        this writer's own flush, a gc under this writer)."""
        if self.job is not None:
            self.job.wait()
            self._reap()

    def _start_job(self) -> None:
        self._job_started = time.monotonic()
        slots = sorted(self.pending)
        self.job = IndexJob.start(self.storage.location, slots, self.every)
        if self.job is None:  # could not start a process: do it here
            self.background = False
            self.flush()
            return
        self._job_slots = slots

    def _reap(self) -> None:
        job, self.job = self.job, None
        if job is None:
            return
        if job.ok:  # its rows are in a segment now (or had rows already)
            for s in self._job_slots:
                self.pending.pop(s, None)
        else:  # its rows stay pending: written here later (a flush, or the writer's close)
            self.background = False
        self._job_slots = []
        self.index.load()

    def flush(self) -> None:
        self.wait()
        flush_rows(self.storage, self.reader, self.index, self.pending, self.every)
        self.pending.clear()

    def merge(self) -> None:
        """While the ``FANOUT`` newest segments are of one size tier, merge them (LSM)."""
        merge_segments(self.storage, self.index, self.every)


def flush_rows(st: Storage, reader: Reader, index: Index,
               pending: dict[int, CommitHeader], every: int) -> None:
    """Write the rows of ``pending`` as one new segment, then merge (what a flush does, in
    this process or in a background job)."""
    if not pending:
        return
    # a gc run under the writer (it holds the lock) may have rewritten the index since: its
    # rows of the pending slots are newer than what the writer remembers of them
    index.load()
    todo = [h for s, h in sorted(pending.items()) if s not in index.rows]
    if not todo:
        return
    rows = rows_from_headers(reader, todo)
    write_segment(st, rows, max((s.gen for s in index.segments), default=0) + 1)
    index.load()
    merge_segments(st, index, every)


def merge_segments(st: Storage, index: Index, every: int) -> None:
    """While the ``FANOUT`` newest segments are of one size tier, merge them (LSM)."""
    while True:
        segs = index.segments
        if len(segs) < FANOUT:
            return
        newest = segs[-FANOUT:]
        tiers = {_tier(s.n, every) for s in newest}
        if len(tiers) != 1:
            return
        rows = concat([s.rows(st) for s in newest])
        write_segment(st, rows, max((s.gen for s in index.segments), default=0) + 1)
        for s in newest:
            st.delete(s.key)
        index.load()


