"""The run's index, writing side: pending rows, segments, merges (LSM), background jobs.

After a commit's ref moves its header joins ``pending``; every ``every`` (64) commits they become
one new durable segment, and when the 8 newest segments are of one size tier they are merged
(LSM): a run of 100,000 steps has a few dozen. gc keeps every row of the steps it prunes (the
index is where their scalars live on), in an order where each step is durable before the next
and a cut leaves rows that agree with the headers or rows readers ignore: marker, tombstones,
new segment, old segments deleted, marker deleted, step files deleted.

The reading side is ``index/view.py``, imported here and never the other way. Rejected: one
module for both sides (a reader would load the writer's jobs and merges it never runs).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import numpy as np

from dstt.errors import DsttError
from dstt.store.format.layout import index_key
from dstt.store.format.segment import RowSet, concat, encode

from .job import IndexJob
from .rows import dedup, keep_summaries, rows_from_headers, take
from .view import GC_MARKER, Index, IndexedSource

if TYPE_CHECKING:
    from dstt.store.format.records import CommitHeader
    from dstt.store.storage.base import Storage

__all__ = ["IndexWriter", "write_segment"]

EVERY = 64
FANOUT = 8
CLOSE_MIN = 8
#: background jobs start at most this often (each is an interpreter start, ~0.1-0.2 s of CPU:
#: every 64 commits of a 7 ms step it took a quarter of a core), unless the pending rows
#: reach ``JOB_MAX_TAIL`` segments' worth (a reader reads the tail from headers meanwhile)
JOB_INTERVAL_S = 10.0
JOB_MAX_TAIL = 16


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

    def __init__(self, reader: IndexedSource, *, every: int = EVERY) -> None:
        self.reader, self.storage, self.every = reader, reader.storage, max(1, every)
        self.index = reader.index.load()
        self.pending: dict[int, CommitHeader] = {}
        #: write segments from a job process (a run on local files, unless
        #: ``DSTT_INDEX_JOBS=0``), so the committer never spends the GIL on rows
        self.background = IndexJob.supported(self.storage)
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
                continue  # the commits above it are queued, and the writer opens

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
            write_segment(st, rows, self.index.next_gen)
        st.delete(GC_MARKER)
        self.index.load()

    def add(self, header: CommitHeader) -> None:
        """A commit's ref moved: queue its row; write a segment when ``every`` are queued
        (in the background where a job process can do it: ``job.py``)."""
        self.pending[header.slot] = header
        if self.job is not None and self.job.done():
            self._reap()
        if len(self.pending) >= self.every and self.job is None:
            if not self.background:
                self.flush()
            elif (
                len(self.pending) >= JOB_MAX_TAIL * self.every
                or time.monotonic() - self._job_started >= JOB_INTERVAL_S
            ):
                self._start_job()

    def close(self) -> None:
        """Write the pending rows if there are ``CLOSE_MIN`` (8) or more; fewer stay the tail
        (a session of a few commits adds no file). With background jobs, fewer than ``every``
        stay the tail too (a job would cost the close seconds at a thousand tensors; the
        next writer queues them), and ``every`` or more go to one last job, waited for."""
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


def flush_rows(
    st: Storage, reader: IndexedSource, index: Index, pending: dict[int, CommitHeader], every: int
) -> None:
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
    write_segment(st, rows, index.next_gen)
    index.load()
    merge_segments(st, index, every)


def merge_segments(st: Storage, index: Index, every: int) -> None:
    """While the ``FANOUT`` newest segments are of one size tier, merge them (LSM)."""
    while True:
        segs = index.segments
        if len(segs) < FANOUT:
            return
        newest = segs[-FANOUT:]
        if len({_tier(s.n, every) for s in newest}) != 1:
            return
        rows = concat([s.rows(st) for s in newest])
        write_segment(st, rows, index.next_gen)
        for s in newest:
            st.delete(s.key)
        index.load()
