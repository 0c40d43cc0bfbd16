"""The capture lane's side of the pipeline: plans, the ring of step buffers, the flusher, writes.

``flatlane.py`` holds the values (a ``FlatPlan``, the ``StepBuffers`` ring, ``Segment``s);
this module holds what the pipeline does with them: find the cached plan of a step's
tensors, allocate the ring once — in the flusher process's shared memory where it
can start — and write one sealed step from its buffer: by the flusher (two steps in flight,
normal priority while the ring runs dry), or from the calling writer thread where there is
no flusher or it died mid-write (the reserved range is the step's own, so it is written
again here and nothing is lost). A step larger than a buffer goes in segments of its layout,
each written chunk by chunk from a ring buffer the next segment then reuses. Kept out of
``pipeline.py``, which orders the threads and steps and knows nothing of buffers or zips.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

import torch

from dstt.analysis.summary_kernel import DigestPlan, digest
from dstt.errors import StorageError
from dstt.store._internal import (
    FlatImage,
    FlatStepWriter,
    Flusher,
    OffloadingWriter,
)

from .flatlane import FlatPlan, Segment, StepBuffers, plan_key, segments, write_order
from .summaries import flat_digest_plan, summarized

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from dstt.store._internal import FlatLayout

    from .dims import DimsOf
    from .flight import Flight
    from .staging import Copier
    from .summaries import SummaryBook

__all__ = ["FlatLane", "discard_files"]


def discard_files(f: Flight) -> None:
    """Delete the unpublished files of a step that will not commit (a failed or dropped
    one whose writes are over); its transaction's ``abort`` later finds nothing left."""
    txn = f.txn
    if txn is None:
        return
    for part in (getattr(txn, "zip", None), getattr(txn, "side", None)):
        if part is not None:
            with contextlib.suppress(OSError):
                part.discard()


class FlatLane:
    """Plans, step buffers and the flusher of one pipeline's flat lane."""

    def __init__(
        self,
        writer: FlatStepWriter,
        *,
        budget_bytes: int,
        dims: DimsOf | None,
        flusher: bool,
        book: SummaryBook | None,
        min_bytes: int = 0,
    ) -> None:
        """``flusher``: write from a flusher process where it starts; ``book``: the
        write-time summaries (None: none); ``min_bytes``: buffers at least this large (a
        caller whose first step is not its largest, one DeepSpeed file per step)."""
        self.writer, self.budget_bytes, self.dims = writer, budget_bytes, dims
        self.flat_writer = writer
        #: the writer where its commits can run in the flusher process (a capability,
        #: ``dstt.store.protocols``)
        self.offloading = writer if isinstance(writer, OffloadingWriter) else None
        self.want_flusher, self.book, self.min_bytes = flusher, book, min_bytes
        self.summarize = book is not None
        self._segments: dict[tuple[int, int], tuple[FlatLayout, list[Segment]]] = {}
        self.steps: StepBuffers | None = None
        self.flusher: Flusher | None = None
        self._plans: dict[tuple[object, ...], FlatPlan] = {}  # (also write-order plans)
        self._digests: dict[int, DigestPlan] = {}
        self._images: dict[tuple[int, int], FlatImage] = {}  # (id(layout), start) -> sizes
        self._lock = threading.Lock()
        self._alloc = threading.Lock()  # the ring is allocated once
        self._lost = False  # the flusher died (warned once)
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
            plan = FlatPlan.build(self.flat_writer, tensors, self.dims)
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
            return self._allocate(plan)

    def _allocate(self, plan: FlatPlan) -> StepBuffers:
        if self.steps is None:
            half = self.budget_bytes // 2
            nbytes = max(plan.nbytes, min(self.min_bytes, half))
            count = max(2, min(4, self.budget_bytes // nbytes)) if nbytes <= half else 2
            nbytes = min(nbytes, max(half, 1))
            pin = plan.cuda and torch.cuda.is_available()
            memory = None
            if self.want_flusher:
                try:
                    # not waiting for the child's start: until it is ready, the
                    # handle serves the writes here (a short run never waits for it)
                    self.flusher = Flusher(nbytes, count, wait=False)
                    memory = self.flusher.buffers
                except (OSError, StorageError) as e:  # no memfd, no fork: writer threads
                    warnings.warn(
                        f"dstt: writing from threads, the flusher process could not start ({e})",
                        RuntimeWarning,
                        stacklevel=4,
                    )
                    self.flusher = None
            self.steps = StepBuffers(nbytes, count, pin=pin, memory=memory)
            if self.flusher is not None:
                self.steps.on_pressure = self.flusher.urgent
                # and commits there: the commit's Python off this process's GIL
                # (DSTT_FLUSHER_COMMIT=0: commit in this process, e.g. to compare)
                if (
                    self.offloading is not None
                    and os.environ.get("DSTT_FLUSHER_COMMIT", "1") != "0"
                ):
                    self.offloading.committer = self.flusher
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

    def segment_plan(self, f: Flight, plan: FlatPlan) -> FlatPlan:
        """The plan a segmented step is copied by: ``plan``, or for a step with predictions
        one in ``write_order`` (cached): its segments are then written in order, each
        prediction's ``"cur"`` inputs before the array predicted from them."""
        if not f.txn_predicts:
            return plan
        order = write_order(f.tensors, f.predictions)
        if order == plan.order:
            return plan
        key = ("write_order", *order)
        got = self._plans.get(key)
        if got is None or not got.fits(f.tensors):
            assert self.flat_writer is not None
            got = FlatPlan.build(self.flat_writer, f.tensors, self.dims, order)
            if len(self._plans) >= 4:
                self._plans.clear()
            self._plans[key] = got
        return got

    def declare(self, f: Flight, plan: FlatPlan) -> None:
        """Declare the arrays of a segmented step (written chunk by chunk, ``put_chunk``)
        and start their write-time summaries."""
        for a in plan.layout.arrays:
            f.txn.declare(a.path, a.dtype, a.shape, a.dims)
            if self.book is not None and summarized(a.path):
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
        """Write the chunks of ``seg``, the ``n``-th segment of ``f``, from buffer ``index``
        (encoded where the step is), add them to the write-time summaries, then free the
        buffer for the next segment. A step with predictions writes its segments in order
        (``segment_plan``); others in parallel."""
        assert self.steps is not None
        ordered = f.txn_predicts
        try:
            if ordered:
                f.wait_segment(n)
            if f.dead:
                return
            buf = self.steps.buffers[index]
            self._put_chunks(f, plan, plan.layout.chunks[seg.lo : seg.hi], buf, seg.start)
        except BaseException:
            discard_files(f)
            raise
        finally:
            if ordered:
                f.segment_done()
            self.steps.release(index)

    def _put_chunks(
        self,
        f: Flight,
        plan: FlatPlan,
        chunks: Sequence[tuple[int, int, int, int, str, int]],
        buf: torch.Tensor,
        start: int,
    ) -> None:
        arrays, raw = plan.layout.arrays, buf.numpy()
        for k, i, s, e, _, _ in chunks:
            a = arrays[k]
            f.txn.put_chunk(a.path, i, raw[s - start : e - start])
            acc = f.summaries.get(a.path)
            if acc is not None:  # on the host copy, off the training thread
                dtype = f.tensors[a.path].dtype
                acc.add((s - a.offset) // a.plan.itemsize, buf[s - start : e - start].view(dtype))

    def write(self, f: Flight) -> None:
        """Write a flat step once sealed (a detected race may still recopy into its buffer
        until then), summarise it from the same buffer, then free the buffer."""
        assert self.steps is not None
        assert f.flat is not None
        assert f.buffer is not None
        token = f.digest_token
        try:
            t0 = time.perf_counter()
            f.wait_sealed()
            f.add_cpu(0.0, t0 - time.perf_counter())  # waiting for training is not disk time
            if f.dead:
                return
            buf = self.steps.buffers[f.buffer]
            layout = f.flat.layout
            plan = self._digest_plan(f.flat) if self.summarize else None
            fl = self.flusher
            if fl is not None and fl.dead:
                self._flusher_lost()  # (it may have died between steps, or in a commit)
            if f.encode and not f.keyframe:  # the writer encodes it: chunk by chunk, here
                f.txn.put_flat_chunks(layout, buf.numpy())
                self._wait_turn(token, plan)
                stats = self._digest_here_or_there(f, plan, token)
            elif fl is not None and not fl.dead and getattr(f.txn, "zip", None) is not None:
                start = f.txn.reserve_flat(layout, lambda s: self._image(layout, s).nbytes)
                path = f.txn.zip.local_path
                assert path is not None  # (reserved: its temporary file is open)
                # the child owns the zip framing in this buffer: should this process write
                # from it later (the flusher died), its images bind it anew
                self.steps.images[f.buffer].clear()
                self._wait_turn(token, plan)
                try:
                    crcs, directory, stats = fl.write(
                        f.buffer, layout, start, path, plan, token, lambda: self._pass(token)
                    )
                except StorageError:
                    if not fl.dead:
                        raise  # the write itself failed (the disk): the step fails
                    # the child is gone, maybe mid-write: the range is still this step's
                    # (the file is unpublished), write it again from here
                    self._flusher_lost()
                    f.txn.put_flat(layout, buf.numpy(), self.steps.images[f.buffer], start=start)
                    stats = digest(plan, buf.numpy(), token) if plan is not None else None
                else:
                    im = self._image(layout, start)
                    # a keyframe the session asked for starts the next deltas' chains (its
                    # chunks become their bases: a copy each, ~15 µs per chunk); a step
                    # the governor wrote raw leaves the bases where they were (older
                    # committed chunks: deltas against them are as valid, if larger)
                    f.txn.complete_flat(
                        layout,
                        im.offsets,
                        im.sizes,
                        crcs,
                        directory,
                        buf.numpy() if f.keyframe else None,
                    )
            else:
                f.txn.put_flat(layout, buf.numpy(), self.steps.images[f.buffer])
                self._wait_turn(token, plan)
                stats = digest(plan, buf.numpy(), token) if plan is not None else None
            if plan is not None and stats is not None:
                f.flat_stats = {"paths": plan.paths, "numel": plan.numel, **stats}
        except BaseException:
            # the step fails: its files go now, not once the committer reaches it after
            # the older steps — on a full disk, they need that room to commit
            discard_files(f)
            raise
        finally:
            self._pass(token)
            index, f.buffer = f.buffer, None
            self.steps.release(index)

    def ticket(self) -> int:
        """The next step's digest token: steps take them in the order they are queued for
        their write, and their digests run in that order (``_wait_turn``)."""
        with self._turn:
            return next(self._tokens)

    def _wait_turn(self, token: int, plan: DigestPlan | None) -> None:
        """Wait until every step queued before this one has digested (or sent its digest
        request to the flusher, which serves them in order): a step's exact update compares
        with the copy the previous digest kept, so two writer threads must not swap them."""
        if plan is None:
            return
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

    def _digest_here_or_there(
        self, f: Flight, plan: DigestPlan | None, token: int
    ) -> dict[str, Any] | None:
        """The digest of a step this process writes (encoded): in the flusher where one runs
        (where the previous steps' copy is, and off this process's GIL), else here."""
        if plan is None:
            return None
        assert self.steps is not None
        assert f.buffer is not None
        fl = self.flusher
        if fl is not None and not fl.dead:
            try:
                return fl.digest(f.buffer, plan, token, lambda: self._pass(token))
            except StorageError:
                if not fl.dead:
                    raise
                self._flusher_lost()
        return digest(plan, self.steps.buffers[f.buffer].numpy(), token)

    def close(self) -> None:
        if self.steps is not None:
            self.steps.close()
        if self.flusher is not None:
            if self.offloading is not None and self.offloading.committer is self.flusher:
                self.offloading.committer = None
            self.flusher.close()

    def _flusher_lost(self) -> None:
        with self._lock:
            first, self._lost = not self._lost, True
        if first:
            warnings.warn(
                "dstt: the flusher process died; steps are written from threads "
                "from now on (no step was lost)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _image(self, layout: FlatLayout, start: int) -> FlatImage:
        """Where the entries of ``layout`` land when placed at ``start`` (no buffer)."""
        key = (id(layout), start)
        im = self._images.get(key)
        if im is None or im.layout is not layout:
            if len(self._images) > 16:
                self._images.clear()
            im = self._images[key] = FlatImage(layout, start, None)
        return im

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
