"""Index rows from commit headers, and the row operations a segment write needs.

``rows_from_headers`` turns headers (plus what their step files still hold: the write-time
``summaries`` objects, ``metrics/history``, the arrays table's raw chunk locations) into a
``RowSet`` (``format/segment.py``); ``take``/``dedup`` select rows, ``keep_summaries`` carries
the summaries of pruned steps over from older rows (gc, rebuild). Kept apart from
``index/writer.py`` (which decides when rows are written and which are trusted) because this is the
one place that knows the engine's object conventions: the store otherwise never looks inside
an object. Rejected alternative: decoding summaries in ``dstt.inspect`` — the store could then
not keep them when gc deletes the side files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from dstt import schema
from dstt.errors import CorruptRunError, DsttError
from dstt.store.format.layout import ChunkPlan, step_file_key
from dstt.store.format.manifest import FileIds, dump_header
from dstt.store.format.segment import SCALARS, Layout, Locations, RowSet, concat
from dstt.store.format.zarr_meta import dtype_itemsize

from .shard_summaries import fold_columns

if TYPE_CHECKING:
    from collections.abc import Iterable

    from dstt.store.format.records import CommitHeader

    from .source import HeaderSource

__all__ = [
    "HISTORY",
    "SUMMARIES",
    "as_float",
    "dedup",
    "keep_summaries",
    "rows_from_headers",
    "take",
]

SUMMARIES = schema.SUMMARIES_OBJECT  # (+ "summaries/<rank>")
HISTORY = schema.METRICS_HISTORY_OBJECT  # steps every=K did not checkpoint


def as_float(v: Any) -> float:
    """A stored metric or summary value as a float (NaN for None, text, or anything else
    that is not a number)."""
    if v is None or isinstance(v, (str, bytes)):
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _summaries(obj: Any) -> dict[str, tuple[list[float], bool, list[float]]]:
    """``{path: (scalars, update_exact, probe)}`` of the engine's per-path summaries mapping
    (the flat lane's columnar form is decoded by ``_summary_rows`` itself)."""
    out: dict[str, tuple[list[float], bool, list[float]]] = {}
    if isinstance(obj, dict):
        for p, v in obj.items():
            if isinstance(v, dict):
                out[str(p)] = (
                    [as_float(v.get(f)) for f in SCALARS],
                    bool(v.get("update_exact", False)),
                    [as_float(x) for x in (v.get("probe") or ())],
                )
    return out


def rows_from_headers(
    reader: HeaderSource,
    headers: Iterable[CommitHeader],
    *,
    summaries: bool = True,
    locations: bool = True,
) -> RowSet:
    """Index rows of ``headers``: their metrics, and what their step files still hold of
    metrics history, summaries and tensor locations (nothing of that for a pruned step);
    ``summaries``/``locations`` False leaves those out (a reader's tail).

    O(1) Python per commit in its arrays for a steady run (array by array it took ~33 ms a
    commit at 1,600 arrays): tables are read as columns, tables that differ only in their
    checksums share one set of layouts, columnar summaries are scattered with numpy."""
    hs = [h.full() if hasattr(h, "full") else h for h in headers]  # IndexedHeader
    n = len(hs)
    tls = sorted({h.timeline for h in hs})
    tl_of = {t: i for i, t in enumerate(tls)}
    names = sorted({k for h in hs for k, v in h.metrics.items() if not isinstance(v, str)})
    col = {k: j for j, k in enumerate(names)}
    m_num = np.full((n, len(names)), np.nan)
    m_text: list[dict[str, Any] | None] = []
    m_hist: list[Any] = []
    objs: list[list[Any]] = []  # per row: its summaries objects, in name order
    locs = _Locations(n)
    for i, h in enumerate(hs):
        text = {}
        for k, v in h.metrics.items():
            if isinstance(v, str):
                text[k] = v
            else:
                m_num[i, col[k]] = as_float(v)
        m_text.append(text or None)
        hist = None
        found: list[Any] = []
        if not h.pruned:
            try:
                if HISTORY in h.objects:
                    hist = reader.read_object(h, HISTORY)
                for name in sorted(h.objects) if summaries else ():
                    if name == SUMMARIES or name.startswith(f"{SUMMARIES}/"):
                        found.append(reader.read_object(h, name))
            except (DsttError, OSError, ValueError):
                found = []  # unreadable now: the row keeps its metrics; verify reports it
            if locations:
                with contextlib.suppress(
                    DsttError, OSError, TypeError, ValueError, KeyError, IndexError
                ):  # damaged: verify reports it
                    locs.add(i, reader.table_columns(h), step_file_key(h.slot))
        m_hist.append(_jsonable(hist))
        objs.append(found)
    sv = _summary_rows(n, objs)
    return RowSet(
        slot=np.array([h.slot for h in hs], np.int64),
        step=np.array([h.step for h in hs], np.int64),
        parent=np.array([-1 if h.parent is None else h.parent for h in hs], np.int64),
        timeline=np.array([tl_of[h.timeline] for h in hs], np.int32),
        pruned=np.array([h.pruned for h in hs], np.uint8),
        time=np.array([h.time for h in hs], np.float64),
        timelines=tls,
        headers=[dump_header(h) for h in hs],
        m_names=names,
        m_num=m_num,
        m_text=m_text,
        m_hist=m_hist,
        s_paths=sv.paths,
        s_has=sv.has,
        s_val=sv.val,
        s_exact=sv.exact,
        s_probe=sv.probe,
        files=locs.files,
        loc=locs.build(),
    )


class _Shape:
    """The layouts of one arrays table, shared by every commit whose table has the same
    columns but its checksums: per raw array its ``Layout`` and its chunks' range."""

    def __init__(self, doc: dict[str, Any], own: str, file_id: Any) -> None:
        a, c, codecs = doc["arrays"], doc["chunks"], doc["codecs"]
        files = [str(f) for f in doc["files"]]
        fids = [-1 if f == own else file_id(f) for f in files]
        file, offset, nbytes = c["file"], c["offset"], c["nbytes"]
        dims_col = a.get("dims") or [None] * len(a["path"])
        self.arrays: list[tuple[str, Layout, int, int]] = []
        pos = 0
        for path, dtype, shape, rows, dims in zip(
            a["path"], a["dtype"], a["shape"], a["rows"], dims_col, strict=True
        ):
            shape_t = tuple(int(x) for x in shape)
            k = ChunkPlan(shape_t, dtype_itemsize(str(dtype)), int(rows)).n_chunks
            if pos + k > len(offset):
                raise CorruptRunError(f"array {path}: {k} chunks expected, the table ends first")
            if not any(str(j) in codecs for j in range(pos, pos + k)):  # raw chunks only
                chunks = tuple(
                    (fids[file[j]], int(offset[j]), int(nbytes[j])) for j in range(pos, pos + k)
                )
                dims_t = None if dims is None else tuple(str(d) for d in dims)
                lay = (str(dtype), shape_t, int(rows), chunks, dims_t)
                self.arrays.append((str(path), lay, pos, pos + k))
            pos += k
        self.rows: list[int] = []
        self.crcs: list[list[int]] = []


class _Locations(FileIds):
    """Every row's tensor locations, grouped by the shape of its arrays table."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self._shapes: list[tuple[tuple[Any, ...], _Shape]] = []

    def add(self, row: int, doc: dict[str, Any], own: str) -> None:
        c = doc["chunks"]
        files = tuple(None if f == own else f for f in doc["files"])
        sig = (doc["arrays"], c["file"], c["offset"], c["nbytes"], doc["codecs"], files)
        shape = next((sh for known, sh in reversed(self._shapes) if known == sig), None)
        if shape is None:  # (the newest first: a steady run's tables all match the last)
            shape = _Shape(doc, own, self.file_id)
            self._shapes.append((sig, shape))
        shape.rows.append(row)
        shape.crcs.append(c["crc32c"])

    def build(self) -> dict[str, Locations]:
        per: dict[str, list[tuple[np.ndarray, Layout, np.ndarray]]] = {}
        for _, shape in self._shapes:
            rows = np.asarray(shape.rows, dtype=np.intp)
            crc = np.asarray(shape.crcs, dtype=np.uint32).reshape(len(rows), -1)
            for path, lay, lo, hi in shape.arrays:
                per.setdefault(path, []).append((rows, lay, crc[:, lo:hi]))
        out: dict[str, Locations] = {}
        for path, entries in per.items():
            width = max(e[2].shape[1] for e in entries)
            seen: dict[Layout, int] = {}  # each layout once, numbered as first met
            ids = np.full(self.n, -1, np.int32)
            crc = np.zeros((self.n, width), np.uint32)
            for rows, lay, c in entries:
                ids[rows] = seen.setdefault(lay, len(seen))
                crc[rows, : c.shape[1]] = c
            out[path] = Locations(list(seen), ids, crc)
        return out


class _SummaryRows(NamedTuple):
    paths: list[str]
    has: np.ndarray
    val: np.ndarray
    exact: np.ndarray
    probe: np.ndarray


def _summary_rows(n: int, objs: list[list[Any]]) -> _SummaryRows:
    """The summaries columns of ``n`` rows from each row's summaries objects (later objects
    of a row win for a path): the flat lane's columnar objects with numpy, the per-path
    mappings of other steps path by path."""
    decoded: list[list[Any]] = []
    paths_set: set[str] = set()
    width = 0
    for found in objs:
        row: list[Any] = []
        for obj in found:
            if isinstance(obj, dict) and obj.get("columns") == 1:
                ps = [str(p) for p in obj["path"]]
                lens = np.asarray(obj["probe_len"], dtype=np.int64)
                probe = np.asarray(obj["probe"], dtype=np.float64)
                if probe.ndim != 2:  # no probes: every row is empty
                    probe = np.zeros((len(ps), 0))
                lens = np.minimum(lens, probe.shape[1])
                vals = np.asarray([obj[f] for f in SCALARS], dtype=np.float64).T  # (paths, scalars)
                # (columns from before exact flat-lane updates have no ``update_exact``)
                ex = np.asarray(obj.get("update_exact", np.zeros(len(ps), bool)), bool)
                ex = ex & np.isfinite(vals[:, SCALARS.index("update_l2")])
                row.append(("cols", ps, vals, probe, lens, ex))
                width = max(width, int(lens.max(initial=0)))
            else:
                per = _summaries(obj)
                row.append(("paths", per))
                ps = list(per)
                width = max(width, max((len(v[2]) for v in per.values()), default=0))
            paths_set.update(ps)
        decoded.append(row)
    paths = sorted(paths_set)
    pcol = {p: j for j, p in enumerate(paths)}
    val = np.full((n, len(paths), len(SCALARS)), np.nan)
    exact = np.zeros((n, len(paths)), np.uint8)
    probe_out = np.full((n, len(paths), width), np.nan, np.float32)
    has = np.zeros(n, np.uint8)
    index_of: dict[tuple[str, ...], np.ndarray] = {}
    for i, row in enumerate(decoded):
        for item in row:
            if item[0] == "cols":
                _, ps, vals, probe, lens, ex = item
                key = tuple(ps)
                idx = index_of.get(key)
                if idx is None:
                    idx = index_of[key] = np.array([pcol[p] for p in ps], dtype=np.intp)
                if not len(idx):
                    continue
                has[i] = 1
                val[i, idx] = vals
                exact[i, idx] = ex
                w = min(width, probe.shape[1])
                keep = np.arange(w)[None, :] < lens[:, None]
                block = np.where(keep, probe[:, :w], np.nan).astype(np.float32)
                probe_out[i, idx, :w] = block
                probe_out[i, idx, w:] = np.nan
            else:
                for p, (vals_p, ex, pr) in item[1].items():
                    has[i] = 1
                    j = pcol[p]
                    val[i, j] = vals_p
                    exact[i, j] = ex
                    probe_out[i, j, :] = np.nan
                    probe_out[i, j, : len(pr)] = pr
    paths, val, exact, probe_out = fold_columns(paths, has, val, exact, probe_out)
    return _SummaryRows(paths, has, val, exact, probe_out)


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
    return dataclasses.replace(
        rows,
        **{  # every array column has a row per row; the lists of names do not
            f.name: v[idx]
            for f in dataclasses.fields(rows)
            if isinstance(v := getattr(rows, f.name), np.ndarray)
        },
        headers=[rows.headers[i] for i in il],
        m_text=[rows.m_text[i] for i in il],
        m_hist=[rows.m_hist[i] for i in il],
        loc={p: Locations(lo.layouts, lo.ids[idx], lo.crc[idx]) for p, lo in rows.loc.items()},
    )


def keep_summaries(rows: RowSet, old: dict[int, tuple[RowSet, int]]) -> RowSet:
    """Rows of pruned steps whose files are gone keep the summaries and history an older
    row of theirs holds."""
    fill = [
        i
        for i, s in enumerate(rows.slot.tolist())
        if rows.pruned[i] and s in old and not rows.s_has[i]
    ]
    if not fill:
        return rows
    picked = (old[int(rows.slot[i])] for i in fill)
    merged = concat([rows, *(take(src, np.array([j])) for src, j in picked)])
    n = len(rows)
    for col in (merged.s_has, merged.s_val, merged.s_exact, merged.s_probe):
        col[fill] = col[n:]
    for k, i in enumerate(fill):
        if merged.m_hist[i] is None:
            merged.m_hist[i] = merged.m_hist[n + k]
    return take(merged, np.arange(n))
