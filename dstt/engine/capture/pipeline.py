"""The flush pipeline: one copy thread, a pool of writer threads, one committer, per-step metrics.

A staged step is a ``Flight``: the training thread only snapshots references, versions and
small objects (``stage``) and later waits for the copies (``wait_copied``). The copy thread
takes a ring buffer and copies the step (a segment at a time when it is larger); writers hand
each ``FlatSegment`` to ``handle.write``; the committer (``committer.py``) commits in step
order once a step is copied, sealed and written, or aborts it. Errors are recorded on the
flight and handed to the training thread (``take_errors``); a thread never raises into the
void. Rejected alternative: ``concurrent.futures`` executors (non-daemon workers keep a
process with a hung filesystem alive, and ordered commits need a second mechanism). The walk
through: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import errno
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dstt import schema
from dstt.engine.tensors._convert import flat_bytes
from dstt.errors import CaptureError, ConfigError, RaceError, StorageError
from dstt.store._internal import (
    EncodingWriter,
    FlatStepWriter,
    LocalStorage,
    Prediction,
    StoredWriter,
    TransactionSink,
    flusher_supported,
)

from .budget import OverheadBudget, cpu_seconds
from .committer import Committer, out_of_room
from .flatwrite import FlatLane, discard
from .flight import Flight, StepMetrics, _Aborted, _encode_metrics
from .governor import EncodeGovernor
from .staging import Copier, RaceReport, VersionGuard
from .summaries import SummaryBook, summarized

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from dstt.engine.state.dims import DimsOf

    from .flatlane import FlatPlan, StepBuffers

__all__ = ["Flight", "Pipeline", "StepMetrics"]

SUMMARIES_OBJECT = schema.SUMMARIES_OBJECT
METRICS_KEPT = 100_000  # per-step metrics kept in memory (the newest)


class Pipeline:
    """Copies staged steps into a fixed ring of host buffers and flushes them to a writer."""

    def __init__(
        self,
        writer: FlatStepWriter,
        *,
        budget_bytes: int,
        writers: int = 4,
        verify: bool = False,
        max_backlog: int = 16,
        summaries: bool = True,
        summaries_object: str = SUMMARIES_OBJECT,
        min_slab_bytes: int = 0,
        flusher: bool | None = None,
        copy: str = "async",
        dims: DimsOf | None = None,
    ) -> None:
        """``flusher``: write flat steps from a child process (``store/flusher/parent.py``): None
        (default) where the storage is local files and the platform allows, ``False``
        never (writer threads), ``True`` always where possible. ``dims`` names the
        dimensions of a step's arrays (``dims.py``; None: the store's default names)."""
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        if max_backlog < 1:
            raise ValueError(f"max_backlog must be at least 1, got {max_backlog}")
        if not isinstance(writer, FlatStepWriter):
            raise ConfigError(
                f"{type(writer).__name__} cannot take flat steps: a capture writer needs "
                "begin(step), encoder and flat_layout(arrays) (dstt.store.protocols)"
            )
        self.writer = writer
        self.dims = dims
        self.budget_bytes = budget_bytes
        self.max_backlog = max_backlog
        self.verify = verify
        self._book = SummaryBook() if summaries else None
        self.summaries_object = summaries_object
        if copy not in ("async", "sync", "auto"):
            raise ValueError(f"copy must be 'async', 'sync' or 'auto', not {copy!r}")
        self.copy = copy
        if flusher is None:  # DSTT_FLUSHER=0 turns it off without touching the code
            flusher = os.environ.get("DSTT_FLUSHER", "1") != "0"
        self._want_flusher = (
            flusher
            and flusher_supported()
            and isinstance(writer, StoredWriter)
            and isinstance(writer.storage, LocalStorage)
        )
        #: where the steps go: the one seam to the store (``dstt.store._seam``)
        self.sink = TransactionSink(writer, start_flusher=self._want_flusher)
        #: the lane (``flatwrite.py``): one batched copy of a step into a buffer of a fixed
        #: ring; ``min_slab_bytes``: buffers at least this large, for callers whose first
        #: step is not the largest (one DeepSpeed checkpoint file per flight)
        self.flat = FlatLane(
            self.sink,
            budget_bytes=budget_bytes,
            dims=dims,
            book=self._book,
            min_bytes=min(min_slab_bytes, budget_bytes),
        )
        self._copier = Copier()
        self._flights: list[Flight] = []
        self._lock = threading.Lock()
        self._errors: list[Flight] = []
        self._metrics: deque[StepMetrics] = deque(maxlen=METRICS_KEPT)
        self._copy_q: queue.SimpleQueue[Flight | None] = queue.SimpleQueue()
        self._write_q: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._closed = False
        #: what storing may cost training under ``every="auto"`` (``tick``, ``can_take``)
        self.budget = OverheadBudget()
        self._waited_s = 0.0  # the training thread's copies at stage and waits for copies
        self._writer_cpu_s = 0.0  # the writer threads' CPU, where /proc cannot tell
        #: the newest step that failed for want of room while no later step committed
        #: (None: the disk has room). Meanwhile a step starts its copy and write only once
        #: every older step has committed or failed, so steps stop competing for the room
        #: left and the oldest take it (``_wait_older``)
        self._full_step: int | None = None
        #: the writer's delta encoder (None: it never encodes), fixed for its life
        self._encoder = enc = writer.encoder if isinstance(writer, EncodingWriter) else None
        self._governor = (
            EncodeGovernor(
                max(1, writers),
                enabled=enc.policy.raw_when_busy,
                retry_every=enc.policy.retry_every,
            )
            if enc is not None
            else None
        )
        self._copy_thread = self._spawn(self._copy_loop, "dstt-copy")
        self._committer = Committer(
            book=self._book,
            summaries_object=summaries_object,
            governor=self._governor,
            record=self._record,
            make_room=self._make_room,
        )
        # with the flusher, a writer thread mostly waits for the child: two of them keep two
        # steps in the child, one being checksummed while the disk takes the other (not
        # for an encoding writer: predictions need their inputs written first, in order)
        n_writers = max(1, writers, 2 if self._want_flusher and self._encoder is None else 1)
        self._writers = [self._spawn(self._write_loop, f"dstt-write-{i}") for i in range(n_writers)]

    @property
    def steps(self) -> StepBuffers | None:
        """The flat lane's ring of step buffers (None until the first flat step)."""
        return self.flat.steps

    @staticmethod
    def _spawn(target: Callable[[], object], name: str) -> threading.Thread:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        return t

    # -- training thread ----------------------------------------------------------------
    def stage(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        objects: Mapping[str, Any],
        predictions: Mapping[str, Prediction]
        | Callable[[], Mapping[str, Prediction]]
        | None = None,
        *,
        keyframe: bool = False,
    ) -> Flight:
        """Start capturing ``step``; returns at once (copies run in the background).
        ``predictions``: encoding hints for the store (used when the writer encodes; a
        callable is called, now, only for a step that will be encoded);
        ``keyframe``: write every chunk whole (plain Zarr) even when the writer encodes."""
        if self._closed:
            raise CaptureError("the capture pipeline is closed")
        # encoding costs writer CPU: the governor decides now whether this step has it to
        # spare (a raw step is reported as raw_fallback in the metrics)
        encode = self._governor.decide() if self._governor is not None else False
        if callable(predictions):
            predictions = predictions() if encode and not keyframe else None
        plan = self.flat.plan(tensors)
        f = Flight(step, tensors, objects, self.verify, predictions, flat=plan)
        if plan is not None and self._copy_now(plan) and self.flat.whole(plan):
            # copied here, on the training thread, before it returns: no copy window (the
            # version guard has nothing to watch) and no thread hand-off
            steps = self.flat.ensure_steps(plan)
            t0 = time.perf_counter()
            index, waited = steps.acquire()
            try:
                with torch.no_grad():
                    torch._foreach_copy_(
                        plan.views(index, steps.buffers[index]), plan.sources(f.tensors)
                    )
            except BaseException:
                steps.release(index)
                raise
            f.buffer, f.stall_s, f.precopied = index, waited, True
            f.blocked_s += time.perf_counter() - t0  # training waited for this copy
            self._waited_s += time.perf_counter() - t0
            f.guard = VersionGuard({}, {}, verify=False)
            if self.verify:  # the copy is done: compare it with the source now
                f.guard = _verified(f, plan, steps.buffers[index])
        with self._lock:
            self._flights = [x for x in self._flights if not x.done.is_set()]
            f.backlog = len(self._flights)
            self._flights.append(f)
        f.cache_bytes = self.steps.in_use * self.steps.nbytes if self.steps else 0
        f.encode = encode
        f.keyframe = keyframe
        self._copy_q.put(f)
        self._committer.put(f)
        return f

    def _copy_now(self, plan: FlatPlan) -> bool:
        """Copy on the training thread? Only host tensors, and only where training already
        uses every core (``copy="auto"``): a copy thread then buys no overlap, only
        contention and GIL hand-offs. With a core to spare, or from CUDA, copy lazily."""
        if plan.cuda or self.copy == "async":
            return False
        return self.copy == "sync" or torch.get_num_threads() >= (os.cpu_count() or 1)

    def tick(self) -> None:
        """A step ended (``every="auto"``, each optimizer step): charge what storing cost
        since the last one to the overhead budget."""
        self.budget.tick(time.perf_counter(), self.engine_cost_s())

    def engine_cost_s(self) -> float:
        """What storing has cost so far: the CPU of the engine's threads and of the flusher
        process, and the training thread's copies and waits."""
        threads = [self._copy_thread, *self._writers, self._committer.thread]
        proc = getattr(self.sink.flusher, "proc", None)
        cpu = cpu_seconds((t.native_id for t in threads), [] if proc is None else [proc.pid])
        return self._waited_s + (self._writer_cpu_s if cpu is None else cpu)

    def can_take(self) -> bool:
        """Would a step staged now be written without costing training anything? (``every=
        "auto"``.) Yes once every earlier step has committed or failed, and the host memory a
        copy needs is free (a buffer of the ring). So the run stores at the disk's pace, as
        continuous checkpointing does — and while storing has cost training no more than
        its share of the run's time so far (``budget.py``: on cores that all train, a disk's
        pace alone slowed training 1.3-1.7x).
        Rejected: "fewer than ``max_backlog`` steps pending" — on a machine whose cores train,
        the copies and flushes of a backlog slow every step though none of them blocks
        (measured in bench/auto_bench.py: 1.65x none with every step stored)."""
        if self._closed or self.pending() or not self.budget.allows():
            return False
        steps = self.steps
        return steps is None or steps.in_use < steps.count

    def record_light(self, step: int) -> None:
        """File a light step (``every="auto"``: not stored) in ``metrics``."""
        m = StepMetrics(
            step=step,
            committed=False,
            bytes=0,
            blocked_s=0.0,
            copy_s=0.0,
            stall_s=0.0,
            flush_s=0.0,
            cache_bytes=0,
            cache_peak_bytes=0,
            cache_capacity=0,
            backlog=0,
            stored=False,
        )
        with self._lock:
            self._metrics.append(m)

    def wait_copied(self, f: Flight) -> float:
        """Block until every chunk of ``f`` is on the host and fewer than ``max_backlog``
        earlier steps await their commit; returns the seconds blocked."""
        t0 = time.perf_counter()
        f.copied.wait()
        while True:  # a disk slower than training: stall here rather than pile up steps
            older = [x for x in self.pending() if x is not f]
            if len(older) < self.max_backlog:
                break
            older[0].done.wait()
        blocked = time.perf_counter() - t0
        f.blocked_s += blocked
        self._waited_s += blocked
        return blocked

    def check(self, f: Flight) -> list[RaceReport]:
        """Tensors of ``f`` written in place since ``stage`` (call after ``wait_copied``)."""
        return f.guard.check(f.tensors)

    def recopy(self, f: Flight, paths: list[str]) -> None:
        """Synchronously copy and write ``paths`` of ``f`` again (after a detected race)."""
        if f.flat is not None and not f.whole:  # its segments are written already
            f.fail(
                RaceError(
                    f"step {f.step}: {', '.join(paths)} changed in place while the step was "
                    "written; a state larger than half of budget_bytes is written segment by "
                    "segment as it is copied, so it cannot be copied again. The step is not "
                    "checkpointed; raise budget_bytes above twice the state to recopy races"
                )
            )
            return
        if f.flat is not None:  # its buffer is written only once sealed: copy into it again
            if f.dead or f.buffer is None:
                return
            assert self.steps is not None
            views = f.flat.views(f.buffer, self.steps.buffers[f.buffer])
            where = {p: i for i, p in enumerate(f.flat.order)}
            for path in paths:
                t = f.tensors[path]
                views[where[path]].copy_(t.detach())
                f.guard.reset(path, t)
                if self.verify:
                    f.guard.add_copy(path, flat_bytes(views[where[path]]))

    def seal(self, f: Flight, objects: Mapping[str, Any]) -> None:
        """Declare ``f`` clean and complete; it commits once its writes are done."""
        f.seal(objects)

    def abort(
        self, f: Flight, error: BaseException | None = None, *, reported: bool = True
    ) -> None:
        """Drop ``f``: it will never be committed."""
        f.fail(error or _Aborted(f"step {f.step} dropped"), reported=reported)

    def seed_summaries(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Remember the probes of ``tensors`` (the parameters a resume loaded from the parent
        step) so the first step's update is measured against the parent's."""
        if self._book is not None:
            for path, t in tensors.items():
                if summarized(path):
                    self._book.seed(path, t)

    def take_errors(self) -> list[Flight]:
        """Failed flights not yet reported to the training thread (each returned once)."""
        with self._lock:
            out, self._errors = self._errors, []
            for f in out:
                f.reported = True
        return out

    @property
    def metrics(self) -> tuple[StepMetrics, ...]:
        with self._lock:
            return tuple(self._metrics)

    def pending(self) -> list[Flight]:
        with self._lock:
            return [f for f in self._flights if not f.done.is_set()]

    def drain(self) -> None:
        """Wait until every staged step is committed or dropped."""
        for f in self.pending():
            f.done.wait()

    def close(self, *, abort: bool = False) -> None:
        """Stop the threads; unsealed steps (all steps with ``abort``) are dropped."""
        if self._closed:
            return
        self._closed = True
        for f in self.pending():
            if abort or not f.sealed:
                self.abort(f, reported=True)
        self._copy_q.put(None)
        self._copy_thread.join()
        self._committer.close()
        for _ in self._writers:
            self._write_q.put(None)
        for t in self._writers:
            t.join()
        self.flat.close()

    # -- copy thread --------------------------------------------------------------------
    def _copy_loop(self) -> None:
        while True:
            f = self._copy_q.get()
            if f is None:
                return
            try:
                if self._full_step is not None:
                    self._wait_older(f)
                if not f.dead:  # (dropped while it waited)
                    self._copy(f)
            except BaseException as e:  # recorded; surfaced on the training thread
                f.fail(e)
            finally:
                if f.buffer is not None and not f.flat_queued and self.steps is not None:
                    self.steps.release(f.buffer)  # failed before its write: free the buffer
                    f.buffer = None
                f.t_copied = time.perf_counter()
                f.sources = {}
                f.copied.set()

    def _copy(self, f: Flight) -> None:
        f.handle = h = self.sink.begin(
            f.step, encode=f.encode, keyframe=f.keyframe, predictions=f.predictions
        )
        for name, obj in f.objects.items():  # stored with the commit (maybe by the flusher)
            h.put_object(name, obj)
        plan = f.flat
        if plan is None:  # objects only: nothing to copy
            return
        if f.precopied:
            self._queue_flat(f)
            return
        steps = self.flat.ensure_steps(plan)
        if plan.nbytes > steps.nbytes:
            self._copy_segments(f, plan)
            return
        index, waited = steps.acquire()
        f.stall_s += waited
        try:
            dst = plan.views(index, steps.buffers[index])
            self._copier.begin(f.marks)
            self._copier.copy_all(dst, plan.sources(f.tensors)).wait()
            if self.verify:
                for path, v in zip(plan.order, dst, strict=True):
                    f.guard.add_copy(path, flat_bytes(v))
        except BaseException:
            steps.release(index)  # the step fails; its buffer goes back to the ring
            raise
        f.buffer = index
        self._queue_flat(f)

    def _queue_flat(self, f: Flight) -> None:
        """Hand a whole step in its buffer to a writer thread (written once sealed)."""
        f.add_pending()
        f.flat_queued = True
        f.digest_token = self.flat.ticket()  # digests run in this (queue) order
        self._write_q.put((f, "flat"))

    def _copy_segments(self, f: Flight, plan: FlatPlan) -> None:
        """A step larger than a buffer: copy each segment of its layout into a buffer of
        the ring (waiting for a free one: the budget) and hand it to a writer thread."""
        f.whole = False
        steps = self.flat.ensure_steps(plan)
        segs = self.flat.segments(plan, steps.nbytes)
        f.sources = {
            p: flat_bytes(t if t.is_contiguous() else t.contiguous()) for p, t in f.tensors.items()
        }
        self.flat.start_summaries(f, plan)
        self._copier.begin(f.marks)
        for n, seg in enumerate(segs):
            if f.dead:
                return
            index, waited = steps.acquire()
            f.stall_s += waited
            try:
                self.flat.copy_segment(f, plan, seg, index, self._copier)
            except BaseException:
                steps.release(index)
                raise
            f.add_pending()
            self._write_q.put((f, "segment", seg, index, n))

    # -- writer threads -----------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            task = self._write_q.get()
            if task is None:
                return
            f = task[0]
            t0, w0 = time.thread_time(), time.perf_counter()
            try:
                if task[1] == "segment":
                    self.flat.write_segment(f, f.flat, task[2], task[3], task[4])
                else:
                    self.flat.write(f)
            except BaseException as e:
                f.fail(e)
                self._failed(f)
            finally:
                f.add_cpu(time.thread_time() - t0, time.perf_counter() - w0)
                f.task_done()

    # -- a disk with no room left -------------------------------------------------------
    def _failed(self, f: Flight) -> None:
        """``f`` failed: surface its error at the training thread's next step (not once the
        committer reaches it, after every older step), and where the disk has no room
        left, write the steps staged from now on one at a time (``_wait_older``)."""
        with self._lock:
            if out_of_room(f.error):
                self._full_step = max(f.step, self._full_step or f.step)
            if not f.reported and not isinstance(f.error, _Aborted) and f not in self._errors:
                self._errors.append(f)

    def _wait_older(self, f: Flight) -> None:
        """Copy thread, while the disk has no room left: let every step staged before ``f``
        commit or fail first (each was sealed before ``f`` was staged, so none waits for
        ``f``); then ``f`` alone meets the room left."""
        with self._lock:
            flights = self._flights
            older = flights[: flights.index(f)] if f in flights else list(flights)
        for g in older:
            g.done.wait()

    def _make_room(self, f: Flight) -> bool:
        """Committer thread: ``f``'s commit found no room. Write the steps staged from now
        on one at a time, free the space of newer steps — the files of those that failed
        already, else those of the newest one still alive that holds or is writing files,
        dropped — and say whether anything was freed (the commit is then tried again).
        Oldest first: a step committed is worth more than a newer one in flight."""
        with self._lock:
            self._full_step = max(f.step, self._full_step or f.step)
            flights = list(self._flights)
        newer = flights[flights.index(f) + 1 :] if f in flights else []
        newer = [g for g in newer if not g.done.is_set()]
        freed = False
        for g in newer:  # failed already: their writes end, their files go
            if g.dead:
                g.wait_writes()
                freed = g.wrote or freed
                discard(g)
        if freed:
            return True
        for g in reversed(newer):
            if not g.dead and (g.pending or g.wrote):
                g.fail(
                    StorageError(
                        errno.ENOSPC,
                        f"step {g.step} was dropped to make room for step {f.step}, staged "
                        "before it: the disk has no room left for both",
                    )
                )
                self._failed(g)
                g.wait_writes()
                discard(g)
                return True
        return False

    def _record(self, f: Flight) -> None:
        now = time.perf_counter()
        self._writer_cpu_s += f.cpu_s
        steps = self.steps
        m = StepMetrics(
            step=f.step,
            committed=f.committed,
            bytes=f.nbytes,
            blocked_s=f.blocked_s,
            copy_s=f.t_copied - f.t_stage,
            stall_s=f.stall_s,
            flush_s=now - f.t_stage,
            cache_bytes=f.cache_bytes,
            cache_peak_bytes=steps.peak_bytes if steps else 0,
            cache_capacity=steps.capacity if steps else 0,
            backlog=f.backlog,
            error=None if f.error is None else f"{type(f.error).__name__}: {f.error}",
            writer_cpu_s=f.cpu_s,
            **_encode_metrics(f.handle),
        )
        with self._lock:
            self._metrics.append(m)
            if f.header is not None and self._full_step is not None and f.step > self._full_step:
                self._full_step = None  # a step after the failure committed: room again
        if f.dead:
            self._failed(f)


def _verified(f: Flight, plan: FlatPlan, buf: torch.Tensor) -> VersionGuard:
    """A verify-mode guard of ``f``, with its copy in ``buf`` accounted (``precopied``)."""
    guard = VersionGuard(
        f.tensors, {p: t.element_size() for p, t in f.tensors.items()}, verify=True
    )
    for path, v in zip(plan.order, plan.views(f.buffer or 0, buf), strict=True):
        guard.add_copy(path, flat_bytes(v))
    return guard
