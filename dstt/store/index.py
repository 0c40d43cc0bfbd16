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
finds a marker re-indexes the marked slots. ``rebuild`` re-derives the whole index from the
headers (summaries of pruned steps come from any segment that still holds them).
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ChecksumError, CorruptRunError, DsttError
from .format.layout import INDEX_PREFIX, commit_key, index_key, parse_index_name, step_file_key
from .format.manifest import (
    ArrayRecord,
    ChunkRecord,
    CommitHeader,
    checksum,
    dump_header,
    parse_header,
)
from .format.segment import (
    SCALARS,
    Layout,
    Locations,
    RowSet,
    blob,
    concat,
    core_span,
    decode_core,
    decode_rest,
    encode,
    read_directory,
)

if TYPE_CHECKING:
    from .reader import Reader
    from .storage.base import Storage

__all__ = ["GC_MARKER", "Index", "IndexWriter", "IndexedHeader", "rebuild", "rows_from_headers"]

GC_MARKER = f"{INDEX_PREFIX}/gc.json"
SUMMARIES = "summaries"  # the engine's write-time summaries object (+ "summaries/<rank>")
HISTORY = "metrics/history"  # steps every=K did not checkpoint (dstt._session_metrics)
EVERY = 64
FANOUT = 8
CLOSE_MIN = 8


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
                got = (ids, crcs, [(str(dt), tuple(sh), int(r), tuple(tuple(c) for c in ch))
                                   for dt, sh, r, ch in lays])
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
        dtype, shape, nrows, chunks = lays[j]
        files = seg.d["files"]
        own = step_file_key(slot)
        recs = tuple(ChunkRecord(own if f < 0 else files[f], b, int(crcs[i, k]), offset=o)
                     for k, (f, o, b) in enumerate(chunks))
        return ArrayRecord(path, dtype, shape, nrows, recs)


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

def _as_float(v: Any) -> float:
    if v is None or isinstance(v, (str, bytes)):
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _summaries(obj: Any) -> dict[str, tuple[list[float], bool, list[float]]]:
    """``{path: (scalars, update_exact, probe)}`` of a write-time summaries object (the
    engine's per-path mapping or its columnar flat-lane form)."""
    out: dict[str, tuple[list[float], bool, list[float]]] = {}
    if isinstance(obj, dict) and obj.get("columns") == 1:
        cols = [np.asarray(obj[f], dtype=np.float64) for f in SCALARS]
        probe = np.asarray(obj["probe"], dtype=np.float64)
        lens = np.asarray(obj["probe_len"]).tolist()
        for i, p in enumerate(obj["path"]):
            out[str(p)] = ([float(c[i]) for c in cols], False,
                           probe[i, :int(lens[i])].tolist() if probe.ndim == 2 else [])
        return out
    if isinstance(obj, dict):
        for p, v in obj.items():
            if isinstance(v, dict):
                out[str(p)] = ([_as_float(v.get(f)) for f in SCALARS],
                               bool(v.get("update_exact", False)),
                               [_as_float(x) for x in (v.get("probe") or ())])
    return out


def rows_from_headers(reader: Reader, headers: Iterable[CommitHeader], *,
                      summaries: bool = True, locations: bool = True) -> RowSet:
    """Index rows of ``headers``: their metrics, and what their step files still hold of
    metrics history, summaries and tensor locations (nothing of that for a pruned step);
    ``summaries``/``locations`` False leaves those out (a reader's tail)."""
    hs = [h.full() if isinstance(h, IndexedHeader) else h for h in headers]
    n = len(hs)
    tls = sorted({h.timeline for h in hs})
    tl_of = {t: i for i, t in enumerate(tls)}
    names = sorted({k for h in hs for k, v in h.metrics.items()
                    if not isinstance(v, str)})
    col = {k: j for j, k in enumerate(names)}
    m_num = np.full((n, len(names)), np.nan)
    m_text: list[dict[str, Any] | None] = []
    m_hist: list[Any] = []
    sums: list[dict[str, tuple[list[float], bool, list[float]]]] = []
    files: list[str] = []
    file_of: dict[str, int] = {}
    locs: dict[str, list[tuple[int, Layout, list[int]]]] = {}
    for i, h in enumerate(hs):
        text = {}
        for k, v in h.metrics.items():
            if isinstance(v, str):
                text[k] = v
            else:
                m_num[i, col[k]] = _as_float(v)
        m_text.append(text or None)
        hist = None
        s: dict[str, tuple[list[float], bool, list[float]]] = {}
        if not h.pruned:
            try:
                if HISTORY in h.objects:
                    hist = reader.read_object(h, HISTORY)
                for name in sorted(h.objects) if summaries else ():
                    if name == SUMMARIES or name.startswith(f"{SUMMARIES}/"):
                        s.update(_summaries(reader.read_object(h, name)))
            except (DsttError, OSError, ValueError):
                pass  # unreadable now: the row keeps its metrics; verify reports the damage
            try:
                table = reader.arrays(h) if locations else {}
            except (DsttError, OSError):
                table = {}
            own = step_file_key(h.slot)
            for path, rec in table.items():
                if not isinstance(rec, ArrayRecord) or any(c.encoding != "raw"
                                                           for c in rec.chunks):
                    continue
                chunks = []
                for c in rec.chunks:
                    f = -1
                    if c.key != own:
                        f = file_of.get(c.key, -2)
                        if f == -2:
                            f = file_of[c.key] = len(files)
                            files.append(c.key)
                    chunks.append((f, c.offset, c.nbytes))
                locs.setdefault(path, []).append(
                    (i, (rec.dtype, tuple(rec.shape), rec.rows, tuple(chunks)),
                     [c.crc32c for c in rec.chunks]))
        m_hist.append(_jsonable(hist))
        sums.append(s)
    paths = sorted({p for s in sums for p in s})
    pcol = {p: j for j, p in enumerate(paths)}
    width = max((len(v[2]) for s in sums for v in s.values()), default=0)
    s_val = np.full((n, len(paths), len(SCALARS)), np.nan)
    s_exact = np.zeros((n, len(paths)), np.uint8)
    s_probe = np.full((n, len(paths), width), np.nan, np.float32)
    s_has = np.zeros(n, np.uint8)
    for i, s in enumerate(sums):
        s_has[i] = bool(s)
        for p, (vals, exact, probe) in s.items():
            j = pcol[p]
            s_val[i, j] = vals
            s_exact[i, j] = exact
            s_probe[i, j, :len(probe)] = probe
    loc: dict[str, Locations] = {}
    for path, entries in locs.items():
        width = max(len(e[2]) for e in entries)
        lays: list[Layout] = []
        seen: dict[Layout, int] = {}
        ids = np.full(n, -1, np.int32)
        crc = np.zeros((n, width), np.uint32)
        for i, lay, crcs in entries:
            at = seen.get(lay)
            if at is None:
                at = seen[lay] = len(lays)
                lays.append(lay)
            ids[i] = at
            crc[i, :len(crcs)] = crcs
        loc[path] = Locations(lays, ids, crc)
    return RowSet(
        slot=np.array([h.slot for h in hs], np.int64),
        step=np.array([h.step for h in hs], np.int64),
        parent=np.array([-1 if h.parent is None else h.parent for h in hs], np.int64),
        timeline=np.array([tl_of[h.timeline] for h in hs], np.int32),
        pruned=np.array([h.pruned for h in hs], np.uint8),
        time=np.array([h.time for h in hs], np.float64), timelines=tls,
        headers=[dump_header(h) for h in hs], m_names=names, m_num=m_num, m_text=m_text,
        m_hist=m_hist, s_paths=paths, s_has=s_has, s_val=s_val, s_exact=s_exact,
        s_probe=s_probe, files=files, loc=loc)


def _jsonable(x: Any) -> Any:
    """The history object as plain JSON (tuples -> lists); None if it is not plain data."""
    if x is None:
        return None
    try:
        return json.loads(json.dumps(x, allow_nan=True))
    except (TypeError, ValueError):
        return None


def dedup(rows: RowSet) -> RowSet:
    """Keep the last row of each slot (later rows are newer), ordered by slot."""
    slots = rows.slot[::-1]
    _, first = np.unique(slots, return_index=True)
    keep = np.sort(len(rows) - 1 - first)
    if len(keep) == len(rows) and np.all(np.diff(rows.slot) > 0):
        return rows
    return take(rows, keep)


def take(rows: RowSet, idx: np.ndarray) -> RowSet:
    il = idx.tolist()
    return RowSet(
        slot=rows.slot[idx], step=rows.step[idx], parent=rows.parent[idx],
        timeline=rows.timeline[idx], pruned=rows.pruned[idx], time=rows.time[idx],
        timelines=rows.timelines, headers=[rows.headers[i] for i in il],
        m_names=rows.m_names, m_num=rows.m_num[idx], m_text=[rows.m_text[i] for i in il],
        m_hist=[rows.m_hist[i] for i in il], s_paths=rows.s_paths, s_has=rows.s_has[idx],
        s_val=rows.s_val[idx], s_exact=rows.s_exact[idx], s_probe=rows.s_probe[idx],
        files=rows.files,
        loc={p: Locations(lo.layouts, lo.ids[idx], lo.crc[idx]) for p, lo in rows.loc.items()})


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

    def __init__(self, reader: Reader, *, every: int = EVERY) -> None:
        self.reader, self.storage, self.every = reader, reader.storage, max(1, every)
        self.index = reader.index.load()
        self.pending: dict[int, CommitHeader] = {}
        if self.index.distrusted:  # a gc was cut short: re-index the slots it marked
            self._repair_marked()
        for tl in reader.timelines:  # the tail: reachable slots without a row
            for h in reader.walk(tl):
                if h.slot in self.index.rows or h.slot in self.pending:
                    break
                self.pending[h.slot] = h

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
            rows = _keep_summaries(rows, old)
            write_segment(st, rows, self._next_gen())
        st.delete(GC_MARKER)
        self.index.load()

    def _next_gen(self) -> int:
        return max((s.gen for s in self.index.segments), default=0) + 1

    def add(self, header: CommitHeader) -> None:
        """A commit's ref moved: queue its row; write a segment when ``every`` are queued."""
        self.pending[header.slot] = header
        if len(self.pending) >= self.every:
            self.flush()

    def close(self) -> None:
        """At the writer's close: write the pending rows if there are ``CLOSE_MIN`` (8) or
        more (fewer stay the tail, read from their headers and arrays tables: a session of a
        few commits adds no file)."""
        if len(self.pending) >= min(CLOSE_MIN, self.every):
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        rows = rows_from_headers(self.reader, sorted(self.pending.values(),
                                                     key=lambda h: h.slot))
        write_segment(self.storage, rows, self._next_gen())
        self.pending.clear()
        self.index.load()
        self.merge()

    def merge(self) -> None:
        """While the ``FANOUT`` newest segments are of one size tier, merge them (LSM)."""
        while True:
            segs = self.index.segments
            if len(segs) < FANOUT:
                return
            newest = segs[-FANOUT:]
            tiers = {_tier(s.n, self.every) for s in newest}
            if len(tiers) != 1:
                return
            rows = concat([s.rows(self.storage) for s in newest])
            write_segment(self.storage, rows, self._next_gen())
            for s in newest:
                self.storage.delete(s.key)
            self.index.load()


def _keep_summaries(rows: RowSet, old: dict[int, tuple[RowSet, int]]) -> RowSet:
    """Rows of pruned steps whose files are gone keep the summaries and history an older
    row of theirs holds."""
    fill = [i for i, s in enumerate(rows.slot.tolist())
            if rows.pruned[i] and s in old and not rows.s_has[i]]
    if not fill:
        return rows
    parts, picks = [rows], []
    for i in fill:
        src, j = old[int(rows.slot[i])]
        parts.append(take(src, np.array([j])))
        picks.append(i)
    merged = concat(parts)
    n = len(rows)
    for k, i in enumerate(picks):
        r = n + k
        merged.s_has[i] = merged.s_has[r]
        merged.s_val[i] = merged.s_val[r]
        merged.s_exact[i] = merged.s_exact[r]
        merged.s_probe[i] = merged.s_probe[r]
        merged.m_hist[i] = merged.m_hist[r] if merged.m_hist[i] is None else merged.m_hist[i]
    return take(merged, np.arange(n))


def all_rows(st: Storage, index: Index) -> dict[int, tuple[RowSet, int]]:
    """Every trusted row of every readable segment: slot -> (rows, i)."""
    out: dict[int, tuple[RowSet, int]] = {}
    for seg in index.segments:
        try:
            rs = seg.rows(st)
        except (DsttError, OSError, ValueError):
            continue
        out.update({int(s): (rs, i) for i, s in enumerate(rs.slot.tolist())})
    return out


def rewrite(st: Storage, reader: Reader, headers: list[CommitHeader],
            old: dict[int, tuple[RowSet, int]], *, reuse: bool = True) -> None:
    """Replace the whole index by one segment of ``headers`` (gc, rebuild). With ``reuse``,
    rows of unchanged live steps are copied from ``old`` instead of re-read from step files."""
    index = Index(st).load()
    gen = max((s.gen for s in index.segments), default=0) + 1
    fresh, copied = [], []
    for h in headers:
        prev = old.get(h.slot)
        if reuse and prev is not None and not h.pruned and \
                prev[0].headers[prev[1]] == dump_header(h):
            copied.append(prev)
        else:
            fresh.append(h)
    parts = [rows_from_headers(reader, fresh)] if fresh else []
    parts += [take(rs, np.array([i])) for rs, i in copied]
    if parts:
        rows = _keep_summaries(concat(parts), old)
        key = write_segment(st, rows, gen)
    else:
        key = ""
    for seg in index.segments:
        if seg.key != key:
            st.delete(seg.key)
    for name in list(st.list(INDEX_PREFIX)):  # damaged segments the index ignored
        k = f"{INDEX_PREFIX}/{name}"
        if parse_index_name(name) is not None and k != key and st.exists(k):
            st.delete(k)
    if st.exists(GC_MARKER):
        st.delete(GC_MARKER)
    if reader.index.enabled:
        reader.index.load()


def reachable_headers(reader: Reader) -> dict[int, CommitHeader]:
    """Every commit reachable from a ref, read from its header file (not the index)."""
    out: dict[int, CommitHeader] = {}
    for tl in reader.timelines:
        slot = reader.ref(tl).head
        while slot is not None and slot not in out:
            h = parse_header(reader.storage.read(commit_key(slot)),
                             f"{reader.storage.location}/{commit_key(slot)}")
            out[slot] = h
            slot = h.parent
    return out


def rebuild(reader: Reader) -> int:
    """Re-derive the index from the commit headers (caller holds the run's lock); returns
    the rows written."""
    st = reader.storage
    old = all_rows(st, Index(st).load())
    heads = reachable_headers(reader)
    rewrite(st, reader, [heads[s] for s in sorted(heads)], old, reuse=False)
    return len(heads)


def check(reader: Reader) -> list[tuple[str, str]]:
    """Problems of the index against the headers: damaged segments, rows that disagree."""
    st = reader.storage
    idx = Index(st).load()
    problems = list(idx.problems)
    for seg in idx.segments:  # every blob, not only what a reader opens
        try:
            seg.rows(st)
        except (DsttError, OSError, ValueError, KeyError) as e:
            problems.append((seg.key, f"damaged index segment ({e}); run `dstt index`"))
    try:
        heads = reachable_headers(reader)
    except (DsttError, OSError):
        return problems  # a damaged header: verify reports it where its walk meets it
    for slot, (seg, i) in sorted(idx.rows.items()):
        h = heads.get(slot)
        if h is None:
            continue  # an unreachable row (e.g. a lazily written ref lost): never read
        try:
            got = parse_header(seg.header_bytes(st, i), seg.key)
        except (DsttError, OSError) as e:
            problems.append((seg.key, f"row of slot {slot}: {e}"))
            continue
        c = seg.core
        core = (int(c["step"][i]), int(c["parent"][i]), bool(c["pruned"][i]))
        want = (h.step, -1 if h.parent is None else h.parent, h.pruned)
        if got != h or core != want:
            problems.append((seg.key, f"row of slot {slot} (step {h.step}) disagrees with "
                                      f"{commit_key(slot)}; run `dstt index` to rebuild"))
    return problems
