"""Index rows from commit headers, and the row operations a segment write needs.

``rows_from_headers`` turns headers (plus what their step files still hold: the write-time
``summaries`` objects, ``metrics/history``, the arrays table's raw chunk locations) into a
``RowSet`` (``format/segment.py``); ``take``/``dedup`` select rows, ``keep_summaries`` carries
the summaries of pruned steps over from older rows (gc, rebuild). Kept apart from
``index.py`` (which decides when rows are written and which are trusted) because this is the
one place that knows the engine's object conventions: the store otherwise never looks inside
an object. Rejected alternative: decoding summaries in ``dstt.inspect`` — the store could then
not keep them when gc deletes the side files.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import DsttError
from .format.layout import step_file_key
from .format.manifest import ArrayRecord, CommitHeader, dump_header
from .format.segment import SCALARS, Layout, Locations, RowSet, concat

if TYPE_CHECKING:
    from .reader import Reader

__all__ = ["HISTORY", "SUMMARIES", "dedup", "keep_summaries", "rows_from_headers", "take"]

SUMMARIES = "summaries"  # the engine's write-time summaries object (+ "summaries/<rank>")
HISTORY = "metrics/history"  # steps every=K did not checkpoint (dstt._session_metrics)


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
    hs = [h.full() if hasattr(h, "full") else h for h in headers]  # IndexedHeader
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
                    (i, (rec.dtype, tuple(rec.shape), rec.rows, tuple(chunks),
                         None if rec.dims is None else tuple(rec.dims)),
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


def keep_summaries(rows: RowSet, old: dict[int, tuple[RowSet, int]]) -> RowSet:
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
