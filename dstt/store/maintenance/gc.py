"""Offline garbage collection of a run: ``gc`` what no kept commit needs.

gc works in the safe order: it first turns a commit header into a *tombstone* (durably), which
makes the step invisible and keeps the timeline's parent chain intact, and only then deletes
the step's bytes; it never touches the head of any timeline and holds the writer lock, so it
cannot race a training process. A reader that already holds a pruned step gets a clean
``StepNotFoundError`` on its next chunk read. Rejected alternative: rewriting parent pointers
around pruned commits — it would mutate committed headers.
"""

from __future__ import annotations

import bisect
import contextlib
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dstt.errors import CorruptRunError, DsttError
from dstt.schema import LIGHT_OBJECT
from dstt.store.format.layout import (
    HEAD_KEY,
    LOCK_KEY,
    RELEASED_PREFIX,
    commit_key,
    ref_key,
)
from dstt.store.format.manifest import dump_header
from dstt.store.format.parts import remove_parts
from dstt.store.index.repair import all_rows, rewrite
from dstt.store.index.rows import keep_summaries, rows_from_headers
from dstt.store.index.view import GC_MARKER, IndexedHeader
from dstt.store.index.writer import IndexWriter, write_segment
from dstt.store.read.reader import Reader

from .retention import Retention, policy
from .verify import Progress, named_timeline, unreached

if TYPE_CHECKING:
    from collections.abc import Collection, Iterable
    from contextlib import AbstractContextManager

    from dstt.store.format.records import CommitHeader
    from dstt.store.format.segment import RowSet
    from dstt.store.storage.base import Storage

__all__ = ["GcReport", "LiveWriter", "RunFiles", "gc"]


class RunFiles(Protocol):
    """The run gc sweeps: its storage (the store's ``Repository``; a protocol, so this room
    imports nothing above it)."""

    @property
    def storage(self) -> Storage: ...


class LiveWriter(Protocol):
    """The live exclusive writer gc runs under (``commit/writer.py``'s ``Writer.gc``): a
    protocol, not the class, since the writer imports this module."""

    @property
    def index(self) -> IndexWriter | None: ...

    @property
    def in_flight(self) -> set[int]: ...

    def check_open(self) -> None: ...

    def quiesced(self) -> AbstractContextManager[None]:
        """Commits wait while inside; on entry the writer is open, its background index
        job finished and its lazily written refs durable."""
        ...


def _delta_bases(r: Reader, reachable: dict[int, CommitHeader], keep: set[int]) -> set[int]:
    """Slots that kept delta chunks need to be reconstructed (transitively)."""
    todo, bases = list(keep), set()
    while todo:
        h = reachable.get(todo.pop())
        if h is None or h.pruned:
            continue
        for rec in r.arrays(h).values():
            for c in rec.chunks:
                for slot in c.slots:
                    if slot not in keep and slot not in bases:
                        bases.add(slot)
                        todo.append(slot)
    return bases


def _files_of(r: Reader, h: CommitHeader) -> set[str]:
    """The files a live commit reads: its chunks' and objects' files and its arrays table's."""
    keys = {c.key for rec in r.arrays(h).values() for c in rec.chunks}
    keys |= {o.key for o in h.objects.values()}
    if h.arrays is not None:
        keys.add(h.arrays.key)
    return keys


@dataclass(frozen=True)
class GcReport:
    pruned_steps: tuple[tuple[str, int], ...]
    orphan_slots: tuple[int, ...]
    files_removed: int
    bytes_freed: int
    dry_run: bool
    #: ``(timeline, first step, last step)`` of each spike window the policy kept
    spike_windows: tuple[tuple[str, int, int], ...] = ()
    #: ``(timeline, step)`` of each light step (``every="auto"``) this gc left without the
    #: stored step its rebuild starts from or the commit carrying its record: no longer
    #: rebuildable (``Retention(keep_light=False)``, or the policy did not keep that step)
    stranded_light: tuple[tuple[str, int], ...] = ()


def _light_of(r: Reader, line: list[CommitHeader]) -> dict[int, tuple[int, int]]:
    """``{light step: (slot of its base, slot of the commit carrying its record)}`` of one
    timeline (``line``: oldest first, tombstones included). The base is the commit just
    before the light step; one already pruned (stranded by an earlier gc) leaves the step
    out, as does a carrier pruned (its record is gone with its files)."""
    live = [h for h in line if not h.pruned]
    steps = [h.step for h in line]
    out: dict[int, tuple[int, int]] = {}
    for h in r.carrying(live, LIGHT_OBJECT):
        if LIGHT_OBJECT not in h.objects:
            continue
        rec = r.read_object(h, LIGHT_OBJECT)
        for k in rec.get("steps", ()) if isinstance(rec, dict) else ():
            i = bisect.bisect_left(steps, int(k))
            if i > 0 and not line[i - 1].pruned:
                out[int(k)] = (line[i - 1].slot, h.slot)
    return out


def _keep_set(
    r: Reader, pol: Retention, line: list[CommitHeader], light: dict[int, tuple[int, int]]
) -> tuple[set[int], list[tuple[int, int]]]:
    """Slots of ``line`` (one timeline, oldest first, tombstones included) the policy keeps,
    and its spike windows. The spike metric of every commit, pruned ones too, comes from the
    index's metric columns (no header parsed per step). ``light`` (:func:`_light_of`): with
    ``pol.keep_light`` the light steps are steps of the policy, and each kept one keeps its
    base and its record's carrier."""
    live = [h for h in line if not h.pruned]
    ms: Any = ()
    mv: Any = ()
    if pol.spike_window and line:
        ms, mv = _metric_series(r.scalar_rows(line, summaries=False), pol.spike_metric)
    light = light if pol.keep_light else {}
    every = [h.step for h in live]
    if light:
        every = sorted({*every, *light})
    steps = pol.keep(every, ms, mv)
    slots = {h.slot for h in live if h.step in steps}
    for k, pair in light.items():
        if k in steps:
            slots.update(pair)
    return slots, pol.spike_windows(every, ms, mv)


def _metric_series(rows: RowSet, name: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of metric ``name``, ascending: each commit's own value and those of
    the steps its ``metrics/history`` carries (light steps, the steps ``every=K`` skipped),
    as ``run.spikes()`` sees them, so a spike at a step that was not stored keeps its window."""
    by_step: dict[int, float] = {}
    for i in range(len(rows.step)):
        hist = rows.m_hist[i] if i < len(rows.m_hist) else None
        if isinstance(hist, dict):
            for k, m in zip(hist.get("steps", ()), hist.get("metrics", ()), strict=False):
                v = m.get(name) if isinstance(m, dict) else None
                if isinstance(v, int | float) and not isinstance(v, bool):
                    by_step.setdefault(int(k), float(v))
    if name in rows.m_names:
        col = rows.m_num[:, rows.m_names.index(name)]
        for step, v in zip(rows.step.tolist(), col.tolist(), strict=True):
            if not np.isnan(v):
                by_step[int(step)] = float(v)  # a commit's own value over a carried one
    steps = sorted(by_step)
    return np.asarray(steps, dtype=np.int64), np.asarray(
        [by_step[k] for k in steps], dtype=np.float64
    )


def _tombstones(
    r: Reader, headers: list[CommitHeader], progress: Progress, total: int
) -> list[CommitHeader]:
    """Rewrite ``headers`` as tombstones, durably, before any file is deleted, so a crash
    between deletes leaves every kept step intact. With a delta among them: newest first,
    each durable before the next (at every cut each live commit's bases are still live);
    else (raw steps, the usual case) one barrier for all instead of two syncs each."""
    st = r.storage
    chained = any(c.slots for h in headers for rec in r.arrays(h).values() for c in rec.chunks)
    out = []
    for n, h in enumerate(sorted(headers, key=lambda x: -x.slot)):
        if progress:
            progress(n, total)
        h = h.full() if isinstance(h, IndexedHeader) else h
        t = replace(h, pruned=True, arrays=None)
        (st.write_durable if chained else st.write)(commit_key(h.slot), dump_header(t))
        out.append(t)
    if out and not chained:
        st.barrier()
    return out[::-1]


def _prune_live(
    st: Storage,
    r: Reader,
    writer: LiveWriter,
    prune: list[CommitHeader],
    progress: Progress,
    total: int,
) -> None:
    """Tombstones and index rows of ``prune`` under a live writer, in gc's order (marker,
    tombstones, a new segment, marker deleted; the files after), but O(pruned): the new
    segment holds only the pruned rows and, the newest generation, wins over their older
    rows. Summaries and history come from each slot's older row, or (not indexed yet) from
    its files, read before the tombstone is written."""
    if not prune:
        return
    slots = [h.slot for h in prune]
    old: dict[int, tuple[RowSet, int]] = {}
    by_seg: dict[Any, list[int]] = {}
    unindexed = []
    index = r.index.load()
    for h in prune:
        got = index.rows.get(h.slot)
        if got is None:
            unindexed.append(h)
        else:
            by_seg.setdefault(got[0], []).append(h.slot)
    for seg, want in by_seg.items():
        try:
            rows = seg.rows(st)
        except (DsttError, OSError, ValueError):  # damaged: the headers' files then
            unindexed += [h for h in prune if h.slot in set(want)]
            continue
        old.update({s: (rows, index.rows[s][1]) for s in want})  # (rows in the segment's order)
    if unindexed:
        fresh = rows_from_headers(r, unindexed)
        old.update({int(x): (fresh, i) for i, x in enumerate(fresh.slot.tolist())})
    st.write_durable(GC_MARKER, json.dumps({"slots": slots}).encode())
    dead = _tombstones(r, prune, progress, total)
    write_segment(st, keep_summaries(rows_from_headers(r, dead), old), index.next_gen)
    st.delete(GC_MARKER)
    if writer.index is not None:  # its queued rows of these slots are stale now
        for s in slots:
            writer.index.pending.pop(s, None)
        writer.index.index.load()


def gc(
    repo: RunFiles,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_steps: Iterable[int] = (),
    retention: Retention | None = None,
    dry_run: bool = False,
    progress: Progress = None,
    writer: LiveWriter | None = None,
    released: Collection[int] = (),
) -> GcReport:
    """Prune commits outside the retention policy and remove orphaned files.

    ``retention`` (a ``Retention``) or the keywords ``keep_last``/``keep_every``/``keep_steps``
    say what to keep; with no policy nothing committed is pruned and only orphans (slots that
    crashed before their ref moved, aborted steps) are removed. Timeline heads, the steps other
    timelines fork from and the bases of kept deltas are always kept.

    ``writer``: run under that live exclusive writer (it holds the run's lock: a second lock
    would be refused) instead of taking the lock: a session's background retention
    (``Writer.gc``). Commits wait while the index is rewritten; slots the writer has in flight
    (and anything past the newest commit, e.g. other ranks' parts) are not touched, nor are
    temporary files and part manifests.

    gc never deletes a slot it cannot prove abandoned (``_unproven``), and nothing at all
    while refs, HEAD or a reachable header are damaged (``CorruptRunError``: repair first).
    ``released``: slots the caller proved abandoned (``delete_timeline``).
    """
    pol = policy(retention, keep_last, keep_every, keep_steps)
    st = repo.storage
    if writer is None:
        with st.lock(LOCK_KEY):
            return _gc(st, pol, dry_run, progress, None, released)
    return _gc(st, pol, dry_run, progress, writer, released)


def _refuse_damaged(r: Reader) -> None:
    """gc deletes nothing in a run whose refs, HEAD or reachable headers are damaged: what
    is reachable, and so what is garbage, is then a guess."""
    damage = [*sorted(r.damaged_refs), *(ref_key(n) for n in sorted(r.recovered))]
    damage += [commit_key(s) for s in sorted(r.bridged)]
    if r.head_problem:
        damage.append(HEAD_KEY)
    if damage:
        raise CorruptRunError(
            f"{r.storage.location}: gc deletes nothing while the run's metadata is damaged "
            f"({', '.join(damage)}): what no ref reaches cannot be told from what a damaged "
            "ref hides. Run `dstt verify --repair` first, then gc"
        )


def _unproven(
    r: Reader, reachable: dict[int, CommitHeader], newest: int, released: Collection[int]
) -> set[int]:
    """Unreachable slots gc cannot prove abandoned, so keeps with all their files: any newer
    than every ref's head (a lost ref update cannot be told from a crash before one), any
    whose header cannot be read, any of a timeline without a ref (its ref lost), by its
    header or its step zip. ``released``: slots the caller proved abandoned."""
    names = set(r.timelines)
    out = {s for s in r.all_slots() if s > newest and s not in released}  # headers not read
    return out | {
        slot
        for slot, _, what in unreached(r, {*reachable, *out}, released)
        if slot > newest
        or isinstance(what, DsttError)
        or (what is not None and named_timeline(what) not in names)
    }


def _gc(
    st: Storage,
    pol: Retention | None,
    dry_run: bool,
    progress: Progress,
    writer: LiveWriter | None,
    released: Collection[int] = (),
) -> GcReport:
    if writer is not None:
        writer.check_open()
    r = Reader(st)
    _refuse_damaged(r)
    reachable: dict[int, CommitHeader] = {}
    keep: set[int] = set()
    windows: list[tuple[str, int, int]] = []
    lights: list[tuple[str, int, tuple[int, int]]] = []
    for tl in r.timelines:
        line = r.lineage(tl)
        for h in line:
            reachable[h.slot] = h
        if pol is not None and pol.prunes:
            light = _light_of(r, line)
            lights += [(tl, k, pair) for k, pair in light.items()]
            got, spans = _keep_set(r, pol, line, light)
            keep |= got
            windows += [(tl, lo, hi) for lo, hi in spans]
        else:
            keep |= {h.slot for h in line}
        ref = r.ref(tl)
        if ref.head is not None:
            keep.add(ref.head)
        if ref.base_slot is not None:  # a fork point: the timeline's own first parent
            keep.add(ref.base_slot)
    _refuse_damaged(r)  # a walk above stepped over a damaged header
    keep |= _delta_bases(r, reachable, keep)
    prune = sorted(s for s, h in reachable.items() if not h.pruned and s not in keep)
    # a live writer's slots in flight, and anything past its newest commit (slots other
    # ranks are writing parts into), are not garbage
    newest = max(reachable, default=-1)
    busy = writer.in_flight if writer is not None else set()
    records = r.released()  # deleted timelines not swept yet (maintenance/timelines.py)
    released = {*released, *(s for slots in records.values() for s in slots)}
    unproven = _unproven(r, reachable, newest, released)

    def untouchable(slot: int) -> bool:
        return slot in unproven or (writer is not None and (slot in busy or slot > newest))

    orphans = [s for s in r.all_slots() if s not in reachable and not untouchable(s)]
    live = {s for s in keep if s in reachable and not reachable[s].pruned}
    # files still needed by kept commits (deltas and dedups read older steps' files)
    needed: set[str] = set().union(*(_files_of(r, reachable[s]) for s in live))
    # every file of a kept slot stays, whatever its tensors reference: each rank's zip
    # is that step's plain Zarr hierarchy even where all its chunks are deltas or dedups
    doomed = [
        k
        for k, slot in r.step_files().items()
        if k not in needed and slot not in live and not untouchable(slot)
    ]
    removed = freed = 0
    for k in doomed:
        with contextlib.suppress(OSError):  # gone meanwhile: neither removed nor freed here
            freed += st.size(k)
            removed += 1
    pruned_steps = tuple((reachable[s].timeline, reachable[s].step) for s in prune)
    gone = set(prune)
    total = len(prune) + len(doomed)  # progress: tombstones, then files
    stranded = tuple(
        sorted((tl, k) for tl, k, (base, carrier) in lights if base in gone or carrier in gone)
    )
    if not dry_run and writer is not None:  # a live writer: only the pruned rows
        # the plan above needs no lock: commits meanwhile only add slots past ``newest``,
        # whose parent (the head seen here) is kept; from here commits wait
        with writer.quiesced():  # no index job writes a segment now; the refs are durable
            _prune_live(st, r, writer, [reachable[s] for s in prune], progress, total)
    elif not dry_run:
        # the index keeps every row of a pruned step (index/writer.py): rows of the steps not
        # indexed yet are read now, while their files still exist
        old = all_rows(st, r.index.load())
        todo_rows = [reachable[s] for s in sorted(reachable) if s not in old]
        if todo_rows:
            fresh = rows_from_headers(r, todo_rows)
            old.update({int(s): (fresh, i) for i, s in enumerate(fresh.slot.tolist())})
        reindex = bool(prune) or st.exists(GC_MARKER) or bool(set(orphans) & set(old))
        if prune:  # readers distrust these rows until the new index is written
            st.write_durable(GC_MARKER, json.dumps({"slots": prune}).encode())
        # tombstones first (durable before the index and any delete: _tombstones)
        for t in _tombstones(r, [reachable[s] for s in prune], progress, total):
            reachable[t.slot] = t
        if reindex:  # new segment, old ones deleted, then the marker: before any file
            rewrite(st, r, [reachable[s] for s in sorted(reachable)], old)
    if not dry_run:  # no reader looks at these files any more: commits need not wait
        for n, k in enumerate(doomed):
            if progress:
                progress(len(prune) + n, total)
            st.delete(k)
        for slot in orphans:  # an orphan's header goes last: a crash leaves it findable
            st.delete(commit_key(slot))
        for tl in records:  # swept: the deleted timelines' records go last
            st.delete(f"{RELEASED_PREFIX}/{tl}.json")
        if writer is None:
            # part manifests of multi-rank commits: gc holds the lock, so no commit is in
            # flight and every part left is either merged already or from a crashed session
            removed += remove_parts(st)
            removed += st.remove_temporaries()
    if progress:
        progress(1, 1)
    return GcReport(pruned_steps, tuple(orphans), removed, freed, dry_run, tuple(windows), stranded)
