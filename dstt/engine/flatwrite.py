"""The flat lane's side of the pipeline: plans, the ring of step buffers, the flusher, one write.

``flatlane.py`` holds the values (a ``FlatPlan``, the ``StepBuffers`` ring); this module holds
what the pipeline does with them: find the cached plan of a step's tensors (or say the chunk
lane must serve), allocate the ring once — in the flusher process's shared memory where it
can start — and write one sealed step from its buffer: by the flusher (two steps in flight,
normal priority while the ring runs dry), or from the calling writer thread where there is
no flusher or it died mid-write (the reserved range is the step's own, so it is written
again here and nothing is lost). Kept out of ``pipeline.py``, which orders the threads and
steps and knows nothing of buffers, shared memory or zip images.
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

from dstt.errors import StorageError
from dstt.store._internal import (
    DigestPlan,
    FlatImage,
    FlatStepWriter,
    Flusher,
    OffloadingWriter,
    StepWriter,
    digest,
)

from .flatlane import FlatPlan, StepBuffers, plan_key
from .summaries import flat_digest_plan, summarized

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.store._internal import FlatLayout

    from .dims import DimsOf
    from .flight import Flight

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
        writer: StepWriter,
        *,
        budget_bytes: int,
        dims: DimsOf | None,
        flusher: bool,
        summarize: bool,
    ) -> None:
        """``flusher``: write from a flusher process where it starts; ``summarize``: digest
        the parameters of every step (the write-time summaries). A ``writer`` that is no
        ``FlatStepWriter`` never gets a flat step (the pipeline checks)."""
        self.writer, self.budget_bytes, self.dims = writer, budget_bytes, dims
        #: the writer where it lays out whole steps, and where its commits can run in the
        #: flusher process (capabilities, ``dstt.store.protocols``)
        self.flat_writer = writer if isinstance(writer, FlatStepWriter) else None
        self.offloading = writer if isinstance(writer, OffloadingWriter) else None
        self.want_flusher, self.summarize = flusher, summarize
        self.steps: StepBuffers | None = None
        self.flusher: Flusher | None = None
        self._plans: dict[tuple[object, ...], FlatPlan] = {}
        self._digests: dict[int, DigestPlan] = {}
        self._images: dict[tuple[int, int], FlatImage] = {}  # (id(layout), start) -> sizes
        self._lock = threading.Lock()
        self._lost = False  # the flusher died (warned once)
        #: ids of the digested steps (``Flight.digest_token``, from ``ticket``): the
        #: committer calls a step's update exact only where the digest compared it with its
        #: parent's copy; digests run in token order (the next token due, those done early)
        self._tokens = itertools.count()
        self._turn = threading.Condition()
        self._next_turn = 0
        self._passed: set[int] = set()

    def plan(self, tensors: Mapping[str, torch.Tensor]) -> FlatPlan | None:
        """The cached flat plan of these tensors, or None where the chunk lane must serve
        (no tensors, or a step too large for two whole-step buffers in the budget)."""
        if not tensors:
            return None
        key = plan_key(tensors)
        plan = self._plans.get(key)
        if plan is None or not plan.fits(tensors):
            assert self.flat_writer is not None, "a flat step for a writer without flat_layout"
            plan = FlatPlan.build(self.flat_writer, tensors, self.dims)
            if len(self._plans) >= 4:  # a model that keeps changing: do not pile up plans
                self._plans.clear()
            self._plans[key] = plan
        if 2 * plan.nbytes > self.budget_bytes:
            return None
        if self.steps is not None and plan.nbytes > self.steps.nbytes:
            return None  # larger than the buffers already allocated: chunk lane
        return plan

    def ensure_steps(self, plan: FlatPlan) -> StepBuffers:
        """The ring of step buffers, allocated at the first flat step."""
        if self.steps is None:
            count = max(2, min(4, self.budget_bytes // plan.nbytes))
            pin = plan.cuda and torch.cuda.is_available()
            memory = None
            if self.want_flusher:
                try:
                    self.flusher = Flusher(plan.nbytes, count)
                    memory = self.flusher.buffers
                except (OSError, StorageError) as e:  # no memfd, no fork: writer threads
                    warnings.warn(
                        f"dstt: writing from threads, the flusher process could not start ({e})",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    self.flusher = None
            self.steps = StepBuffers(plan.nbytes, count, pin=pin, memory=memory)
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
