"""The capture lane's side of the pipeline: plans, the ring of step buffers, writes by the sink.

``flatlane.py`` holds the values (a ``FlatPlan``, the ``StepBuffers`` ring, ``Segment``s);
this module holds what the pipeline does with them: find the cached plan of a step's tensors,
allocate the ring once (in the sink's shared memory where it lends some) and hand one sealed
step to its ``StepHandle`` (``dstt.store._seam``) as one ``FlatSegment`` with its digest —
or, for a step larger than a buffer, its segments in byte order, each from a ring buffer the
next then reuses. How the bytes reach the disk (a flusher process, threads, encoded or raw)
is the sink's business. Kept out of ``pipeline.py``, which orders threads and steps.
Rejected: driving the store's transaction and flusher from here (their protocols leaked).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING

import torch

from dstt.store._internal import Digest, FlatSegment

from .flatlane import FlatPlan, Segment, StepBuffers, plan_key, segments
from .summaries import flat_digest_plan, summarized

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.analysis.summary_kernel import DigestPlan
    from dstt.engine.state.dims import DimsOf
    from dstt.store._internal import FlatLayout, StepSink

    from .flight import Flight
    from .staging import Copier
    from .summaries import SummaryBook

__all__ = ["FlatLane", "discard"]


def discard(f: Flight) -> None:
    """Drop a step that will not commit (a failed or dropped one whose writes are over):
    its files go now, not once the committer reaches it — a full disk needs the room."""
    if f.handle is not None:
        f.handle.abort()
    f.wrote = False


class FlatLane:
    """Plans, step buffers and writes of one pipeline's flat lane."""

    def __init__(
        self,
        sink: StepSink,
        *,
        budget_bytes: int,
        dims: DimsOf | None,
        book: SummaryBook | None,
        min_bytes: int = 0,
    ) -> None:
        """``book``: the write-time summaries (None: none); ``min_bytes``: buffers at least
        this large (a caller whose first step is not its largest, one DeepSpeed file each)."""
        self.sink, self.budget_bytes, self.dims = sink, budget_bytes, dims
        self.book, self.min_bytes = book, min_bytes
        self.shared = False  # the ring is the sink's shared memory
        self._segments: dict[tuple[int, int], tuple[FlatLayout, list[Segment]]] = {}
        self.steps: StepBuffers | None = None
        self._plans: dict[tuple[object, ...], FlatPlan] = {}
        self._digests: dict[int, DigestPlan] = {}
        #: a whole step's bytes in each buffer, by (buffer, step size): one view each, kept
        self._views: dict[tuple[int, int], memoryview] = {}
        self._alloc = threading.Lock()  # the ring is allocated once
        #: ids of the digested steps (``Flight.digest_token``, from ``ticket``): the
        #: committer calls a step's update exact only where the digest compared it with its
        #: parent's copy; digests run in token order (the next token due, those done early)
        self._tokens = itertools.count()
        self._turn = threading.Condition()
        self._next_turn = 0
        self._passed: set[int] = set()

    def plan(self, tensors: Mapping[str, torch.Tensor]) -> FlatPlan | None:
        """The cached flat plan of these tensors (None: no tensors, objects only)."""
        if not tensors:
            return None
        key = plan_key(tensors)
        plan = self._plans.get(key)
        if plan is None or not plan.fits(tensors):
            plan = FlatPlan.build(self.sink.layout, tensors, self.dims)
            if len(self._plans) >= 4:  # a model that keeps changing: do not pile up plans
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def whole(self, plan: FlatPlan) -> bool:
        """Whether a step of ``plan`` fits one buffer of the ring (else: in segments)."""
        if self.steps is not None:
            return plan.nbytes <= self.steps.nbytes
        return 2 * plan.nbytes <= self.budget_bytes

    def ensure_steps(self, plan: FlatPlan) -> StepBuffers:
        """The ring of step buffers, allocated at the first step: whole-step buffers (at
        least ``min_bytes``) two to four of which fit the budget, or two halves of the
        budget where a step is larger (it is then copied and written in segments). Called
        from the copy thread and, copying at stage, the training thread: one allocates."""
        if self.steps is not None:
            return self.steps
        with self._alloc:
            if self.steps is None:
                half = self.budget_bytes // 2
                nbytes = max(plan.nbytes, min(self.min_bytes, half))
                count = max(2, min(4, self.budget_bytes // nbytes)) if nbytes <= half else 2
                nbytes = min(nbytes, max(half, 1))
                pin = plan.cuda and torch.cuda.is_available()
                shared = self.sink.buffers(nbytes, count)
                memory = None if shared is None else shared.buffers
                steps = StepBuffers(nbytes, count, pin=pin, memory=memory)
                if shared is not None:  # the writer process catches up while the ring is dry
                    steps.on_pressure = shared.urgent
                self.shared = shared is not None
                self.steps = steps
            return self.steps

    # -- a step larger than a buffer: segments of its layout -----------------------------
    def segments(self, plan: FlatPlan, nbytes: int) -> list[Segment]:
        """``plan``'s layout cut into segments of at most ``nbytes`` (cached per plan)."""
        key = (id(plan.layout), nbytes)
        got = self._segments.get(key)
        if got is None:
            if len(self._segments) >= 4:
                self._segments.clear()
            got = self._segments[key] = (plan.layout, segments(plan.layout, nbytes))
        return got[1]

    def start_summaries(self, f: Flight, plan: FlatPlan) -> None:
        """Start the write-time summaries of a segmented step (added chunk by chunk)."""
        if self.book is None:
            return
        for a in plan.layout.arrays:
            if summarized(a.path):
                f.summaries[a.path] = self.book.accumulator(a.path, a.nbytes // a.plan.itemsize)

    def copy_segment(
        self, f: Flight, plan: FlatPlan, seg: Segment, index: int, copier: Copier
    ) -> None:
        """Copy the parts of ``seg`` into buffer ``index`` (one batched copy; waits for it)."""
        assert self.steps is not None
        buf = self.steps.buffers[index]
        arrays = plan.layout.arrays
        dst: list[torch.Tensor] = []
        src: list[torch.Tensor] = []
        for k, lo, hi in seg.parts:
            at = arrays[k].offset + lo - seg.start
            dst.append(buf[at : at + hi - lo])
            src.append(f.sources[arrays[k].path][lo:hi])
        copier.copy_all(dst, src).wait()
        if f.guard.verify:
            for (k, _, _), v in zip(seg.parts, dst, strict=True):
                f.guard.add_copy(arrays[k].path, v)

    def write_segment(self, f: Flight, plan: FlatPlan, seg: Segment, index: int, n: int) -> None:
        """Write ``seg``, the ``n``-th segment of ``f``, from buffer ``index`` once the ones
        before it are (segments go in byte order), add its chunks to the write-time
        summaries, then free the buffer for the next segment."""
        assert self.steps is not None
        assert f.handle is not None
        try:
            f.wait_segment(n)
            if f.dead:
                return
            buf = self.steps.buffers[index]
            f.wrote = True
            f.handle.write(FlatSegment(plan.layout, seg.start, buf.numpy()[: seg.stop - seg.start]))
            if f.summaries:  # on the host copy, off the training thread
                arrays = plan.layout.arrays
                for k, _, s, e, _, _ in plan.layout.chunks[seg.lo : seg.hi]:
                    a = arrays[k]
                    acc = f.summaries.get(a.path)
                    if acc is not None:
                        part = buf[s - seg.start : e - seg.start].view(f.tensors[a.path].dtype)
                        acc.add((s - a.offset) // a.plan.itemsize, part)
        except BaseException as e:
            f.fail(e)  # the cause first: an aborted handle refuses the committer's objects
            discard(f)
            raise
        finally:
            f.segment_done()
            self.steps.release(index)

    def write(self, f: Flight) -> None:
        """Write a flat step once sealed (a detected race may still recopy into its buffer
        until then), digested from the same buffer, then free the buffer."""
        assert self.steps is not None
        assert f.flat is not None
        assert f.buffer is not None
        assert f.handle is not None
        token = f.digest_token
        try:
            t0 = time.perf_counter()
            f.wait_sealed()
            f.add_cpu(0.0, t0 - time.perf_counter())  # waiting for training is not disk time
            if f.dead:
                return
            layout = f.flat.layout
            plan = self._digest_plan(f.flat) if self.book is not None else None
            d = (
                None
                if plan is None
                else Digest(plan, token, lambda: self._wait_turn(token), lambda: self._pass(token))
            )
            data = self._view(f.buffer, layout.nbytes)
            f.wrote = True
            stats = f.handle.write(
                FlatSegment(layout, 0, data, f.buffer if self.shared else None, d)
            )
            if plan is not None and stats is not None:
                f.flat_stats = {"paths": plan.paths, "numel": plan.numel, **stats}
        except BaseException as e:
            f.fail(e)  # the cause first: an aborted handle refuses the committer's objects
            discard(f)
            raise
        finally:
            self._pass(token)
            index, f.buffer = f.buffer, None
            self.steps.release(index)

    def _view(self, index: int, nbytes: int) -> memoryview:
        """The first ``nbytes`` of buffer ``index`` as bytes: the same view every step of a
        size (the sink keys what it keeps per buffer by it, and no view is built per step)."""
        view = self._views.get((index, nbytes))
        if view is None:
            assert self.steps is not None
            if len(self._views) >= 16:
                self._views.clear()
            # (numpy's stubs declare the buffer protocol from Python 3.12 only)
            view = memoryview(self.steps.buffers[index].numpy()).cast("B")[:nbytes]  # type: ignore[arg-type]
            self._views[(index, nbytes)] = view
        return view

    def ticket(self) -> int:
        """The next step's digest token: steps take them in the order they are queued for
        their write, and their digests run in that order (``_wait_turn``)."""
        with self._turn:
            return next(self._tokens)

    def _wait_turn(self, token: int) -> None:
        """Wait until every step queued before this one has digested (or sent its digest
        request to the flusher, which serves them in order): a step's exact update compares
        with the copy the previous digest kept, so two writer threads must not swap them."""
        with self._turn:
            while self._next_turn < token:
                self._turn.wait()

    def _pass(self, token: int) -> None:
        """This step's digest is done or sent (or the step has none): the next may go."""
        with self._turn:
            self._passed.add(token)
            while self._next_turn in self._passed:
                self._passed.discard(self._next_turn)
                self._next_turn += 1
            self._turn.notify_all()

    def close(self) -> None:
        """The ring first (its pinned pages unregistered), then the sink's shared memory."""
        self._views.clear()
        if self.steps is not None:
            self.steps.close()
        self.sink.close()

    def _digest_plan(self, plan: FlatPlan) -> DigestPlan:
        d = self._digests.get(id(plan))
        if d is None:
            d = self._digests[id(plan)] = flat_digest_plan(
                [
                    (a.path, a.dtype, a.offset, a.nbytes // a.plan.itemsize)
                    for a in plan.layout.arrays
                    if summarized(a.path)
                ]
            )
        return d
