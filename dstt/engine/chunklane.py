"""The chunk lane: a step copied chunk by chunk into the fixed host cache, each chunk written alone.

Serves verify mode, writers without a flat layout and states larger than half the budget
(``Pipeline`` sends every other step through the flat lane, ``flatwrite.py``). The copy thread
sizes the ``HostCache`` from the first step (``_ensure_cache``), then per chunk reserves a lease
(may block: the byte budget), copies into it and hands it to a writer thread, which waits for
the copy, puts the chunk, adds it to the write-time summaries and releases the lease;
``_recopy_chunks`` copies and writes raced tensors again, synchronously. ``ChunkLane`` is a base
class of ``Pipeline`` (``pipeline.py``), which imports this module and never the other way; the
attributes it uses are declared here and set by ``Pipeline.__init__``. So ``pipeline.py`` orders
the threads and steps, and the per-chunk work lives here. Rejected alternative: the chunk lane
for every step — a copy call, lease, queue item and store call per chunk, ~0.3 ms of GIL-held
Python per tensor per step (docs/design.md, "The capture hot path").
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from dstt.errors import CaptureError

from ._convert import flat_bytes
from .staging import Copier, HostCache, Lease, Ready
from .summaries import SummaryBook, summarized

if TYPE_CHECKING:
    import queue

    from .flight import Flight

__all__ = ["ChunkLane"]

MiB = 1024 * 1024


class ChunkLane:
    """The chunk lane's side of a ``Pipeline``: the host cache, chunk copies, chunk writes."""

    cache: HostCache | None
    budget_bytes: int
    min_slab_bytes: int
    verify: bool
    _book: SummaryBook | None
    _copier: Copier
    _write_q: queue.SimpleQueue[tuple[Any, ...] | None]

    def _ensure_cache(self, f: Flight) -> HostCache:
        largest = max((min(p.chunk_nbytes, p.nbytes) for p in f.plans.values()), default=1)
        if self.cache is None:
            if largest > self.budget_bytes:
                raise CaptureError(
                    f"budget_bytes={self.budget_bytes} cannot hold one chunk of {largest} bytes; "
                    "raise budget_bytes (this run's arrays were created with larger chunks)"
                )
            total = max(f.nbytes, 1)
            slab = max(
                largest, self.min_slab_bytes, min(self.budget_bytes // 8, 4 * MiB, total // 4 + 1)
            )
            slab = (slab + 63) // 64 * 64
            capacity = max(slab, min(self.budget_bytes, 2 * total + 2 * slab))
            pin = torch.cuda.is_available() and any(s.is_cuda for s in f.sources.values())
            self.cache = HostCache(capacity, slab, pin=pin)
        elif largest > self.cache.slab_bytes:
            raise CaptureError(
                f"step {f.step}: a chunk of {largest} bytes exceeds the host "
                f"cache slab ({self.cache.slab_bytes} bytes); raise budget_bytes"
            )
        return self.cache

    def _copy_chunks(self, f: Flight) -> None:
        """Copy every chunk of ``f`` into leases of the host cache and queue its writes."""
        cache = self._ensure_cache(f)
        if self._book is not None:
            for path, plan in f.plans.items():
                if summarized(path):
                    f.summaries[path] = self._book.accumulator(path, plan.nbytes // plan.itemsize)
        self._copier.begin(f.marks)
        last: dict[torch.device, Ready] = {}  # chunk events of one stream complete in order
        try:
            for path, plan in f.plans.items():
                src = f.sources[path]
                for i in range(plan.n_chunks):
                    if f.dead:
                        return
                    start, stop = plan.byte_range(i)
                    lease = cache.reserve(stop - start)
                    f.stall_s += lease.waited_s
                    try:
                        ready = self._copier.copy(src, start, stop, lease)
                        if self.verify:
                            ready.wait()
                            f.guard.add_copy(path, lease.view)
                    except BaseException:
                        cache.release(lease)
                        raise
                    f.add_pending()
                    self._write_q.put((f, "chunk", path, i, lease, ready))
                    last[src.device] = ready
        finally:
            cache.seal()
            for r in last.values():
                r.wait()

    def _recopy_chunks(self, f: Flight, paths: list[str]) -> None:
        """Copy and write the chunks of ``paths`` of ``f`` again, synchronously."""
        f.wait_writes()  # earlier writes of these chunks must land first (last write wins)
        if f.dead or f.txn is None:
            return
        assert self.cache is not None
        for path in paths:
            t = f.tensors[path]
            src = flat_bytes(t if t.is_contiguous() else t.contiguous())
            f.guard.reset(path, t)
            plan = f.plans[path]
            acc = f.summaries.get(path)
            if acc is not None and self._book is not None:
                acc = f.summaries[path] = self._book.accumulator(path, acc.numel)
            for i in range(plan.n_chunks):
                start, stop = plan.byte_range(i)
                lease = self.cache.reserve(stop - start)
                try:
                    self._copier.copy(src, start, stop, lease).wait()
                    if self.verify:
                        f.guard.add_copy(path, lease.view)
                    f.txn.put_chunk(path, i, lease.view.numpy())
                    if acc is not None:
                        acc.add(start // plan.itemsize, lease.view.view(t.dtype))
                finally:
                    self.cache.release(lease)
            self.cache.seal()

    def _write_chunk(self, f: Flight, path: str, i: int, lease: Lease, ready: Ready) -> None:
        assert self.cache is not None
        try:
            t0 = time.perf_counter()
            ready.wait()
            f.add_cpu(0.0, t0 - time.perf_counter())  # waiting for the copy is not disk time
            if not f.dead:
                f.txn.put_chunk(path, i, lease.view.numpy())
                acc = f.summaries.get(path)
                if acc is not None:  # on the host copy, off the training thread
                    plan = f.plans[path]
                    values = lease.view.view(f.tensors[path].dtype)
                    acc.add(plan.byte_range(i)[0] // plan.itemsize, values)
        finally:
            self.cache.release(lease)
