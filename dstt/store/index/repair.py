"""Whole-index rewrites: gc's new index, ``dstt index`` (rebuild) and verify's check.

All three hold the run's lock (or are read-only) and derive rows from the commit headers, the
source of truth (``writer.py``). ``rewrite`` writes one segment of every given row, then deletes
every older segment and the gc marker: a cut before the deletes leaves overlapping segments in
which the newer generation wins, so it never loses a row. ``rebuild`` reads every header from
its own file (not the index it replaces) and keeps the summaries of pruned steps from any
segment still readable — once gc deleted a step's side file, they exist nowhere else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dstt.errors import CorruptRunError, DsttError
from dstt.store.format.layout import INDEX_PREFIX, commit_key, parse_index_name
from dstt.store.format.manifest import dump_header, parse_header
from dstt.store.format.segment import RowSet, concat

from .rows import keep_summaries, rows_from_headers, take
from .view import GC_MARKER, Index, IndexedSource
from .writer import write_segment

if TYPE_CHECKING:
    from dstt.store.format.records import CommitHeader
    from dstt.store.storage.base import Storage

__all__ = ["all_rows", "check", "reachable_headers", "rebuild", "rewrite"]


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


def rewrite(
    st: Storage,
    reader: IndexedSource,
    headers: list[CommitHeader],
    old: dict[int, tuple[RowSet, int]],
    *,
    reuse: bool = True,
) -> None:
    """Replace the whole index by one segment of ``headers`` (gc, rebuild). With ``reuse``,
    rows of unchanged live steps are copied from ``old`` instead of re-read from step files."""
    index = Index(st).load()
    fresh, copied = [], []
    for h in headers:
        prev = old.get(h.slot)
        if (
            reuse
            and prev is not None
            and not h.pruned
            and prev[0].headers[prev[1]] == dump_header(h)
        ):
            copied.append(prev)
        else:
            fresh.append(h)
    parts = [rows_from_headers(reader, fresh)] if fresh else []
    parts += [take(rs, np.array([i])) for rs, i in copied]
    if parts:
        rows = keep_summaries(concat(parts), old)
        key = write_segment(st, rows, index.next_gen)
    else:
        key = ""
    for name in list(st.list(INDEX_PREFIX)):  # every other segment, damaged ones included
        k = f"{INDEX_PREFIX}/{name}"
        if parse_index_name(name) is not None and k != key:
            st.delete(k)
    if st.exists(GC_MARKER):
        st.delete(GC_MARKER)
    if reader.index.enabled:
        reader.index.load()


def reachable_headers(reader: IndexedSource, *, lenient: bool = False) -> dict[int, CommitHeader]:
    """Every commit reachable from a ref, read from its header file (not the index);
    ``lenient``: a chain ends at a missing or damaged header instead of raising."""
    out: dict[int, CommitHeader] = {}
    for tl in reader.timelines:
        slot = reader.ref(tl).head
        while slot is not None and slot not in out:
            key = commit_key(slot)
            try:
                h = parse_header(reader.storage.read(key), f"{reader.storage.location}/{key}")
            except (FileNotFoundError, CorruptRunError):
                if not lenient:
                    raise
                break  # damaged: ``verify`` reports it; the commits above it are indexed
            out[slot] = h
            slot = h.parent
    return out


def rebuild(reader: IndexedSource) -> int:
    """Re-derive the index from the commit headers (caller holds the run's lock); returns
    the rows written."""
    st = reader.storage
    old = all_rows(st, Index(st).load())
    heads = reachable_headers(reader, lenient=True)
    for slot, (rs, i) in old.items():  # rows below a damaged header: kept, not dropped
        if slot not in heads:
            try:
                heads[slot] = parse_header(rs.headers[i], f"{st.location}/{INDEX_PREFIX}")
            except DsttError:
                continue
    rewrite(st, reader, [heads[s] for s in sorted(heads)], old, reuse=False)
    return len(heads)


def check(reader: IndexedSource) -> list[tuple[str, str]]:
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
        if dump_header(got) != dump_header(h) or core != want:  # (bytes: NaN metrics)
            problems.append(
                (
                    seg.key,
                    f"row of slot {slot} (step {h.step}) disagrees with "
                    f"{commit_key(slot)}; run `dstt index` to rebuild",
                )
            )
    return problems
