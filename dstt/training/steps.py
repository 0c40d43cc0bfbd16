"""The per-step capture protocol of ``Session``: what its optimizer hooks do.

Post-step hook of step *k*: stage it (the copy starts, step state snapshotted); end of
iteration *k*: snapshot the boundary state; pre-step hook of step *k+1*: wait for the copies
(the only point that blocks training), run the version guard, seal step *k* for the committer.
``every="auto"`` stages a step only when the pipeline can take it, else records it as a light
step. Leaving the block commits the last step (on an exception only a finished iteration's).
``StepCapture`` is an object a ``Session`` holds, given what it drives; the session module
stays about construction, the public surface and the lifecycle. Rejected alternatives: a
base class of ``Session`` (one class split over two files); module-level functions taking the
session (the state would still live on it). Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

from dstt.engine.capture.light import light_record
from dstt.errors import DsttError, RaceError
from dstt.schema import BATCHES_OBJECT, LIGHT_OBJECT, METRICS_HISTORY_OBJECT, REPLAY_OBJECT

from .checks import capture_error, warn_skipped
from .metrics import MetricLog

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from dstt.engine.capture.pipeline import Flight, Pipeline
    from dstt.engine.state.torch_state import TorchState

    from .data import BatchLog
    from .options import SessionOptions
    from .retention import RetentionRunner

__all__ = ["StepCapture"]


class StepCapture:
    """The hooks' side of a ``Session``: stage, settle (race check, seal), the tail commit."""

    def __init__(
        self,
        state: TorchState,
        options: SessionOptions,
        *,
        scheduler: Any,
        batches: BatchLog,
        tail_on_error: bool,
        rank: int = 0,
    ) -> None:
        self.state, self.options, self.scheduler = state, options, scheduler
        self.batches = batches  # per-step batch fingerprints (dstt.training.data)
        #: rank 0's batch fingerprints go with the commits, another rank's under
        #: ``data/batches/r<rank>`` (a DDP light step's rebuild replays every rank's samples)
        self.rank = rank
        #: on an exception, commit the last step ``every`` skipped (not with several ranks:
        #: the other ranks may not be there to write their parts)
        self.tail_on_error = tail_on_error
        self.pipeline: Pipeline | None = None  # from ``start``
        self.log = MetricLog(0)
        self.retainer: RetentionRunner | None = None
        self.keyframe_next = False  # keyframe(): the next captured step is written whole
        self.flight: Flight | None = None
        self.boundary: Mapping[str, Any] | None = None  # boundary state of ``flight``
        self.step = 0  # optimizer steps taken (the restored step after a resume)
        self.taken = 0  # optimizer steps taken in this session
        self.in_step = False  # between the pre- and post-step hooks (tensors half-updated)
        self.last_staged = 0  # the newest step staged (or restored)
        #: step state of the last step ``every`` skipped, snapshotted after its optimizer
        #: step, and whether its iteration ended: what ``finish`` commits it with
        self.tail: Mapping[str, Any] | None = None
        self.tail_ended = False
        self.sched_offset: int | None = None  # scheduler.last_epoch - step, at start
        #: ``every="auto"``: light steps not yet recorded in a commit
        #: (``dstt.engine.capture.light``)
        self.light: list[int] = []
        #: a framework callback's loss of each step (``Session._fingerprint``), for the record
        self.fingerprints: dict[int, float | None] = {}
        #: several ranks: ``agree(step, ok)`` -> whether every rank can take ``step`` (each
        #: rank's ``Pipeline.can_take``), so all of them store the same steps
        self.agree: Callable[[int, bool], bool] | None = None
        #: ``replay="train.py:make"``: the factory each commit names (``dstt.open(replay=True)``)
        self.factory: dict[str, str] | None = None
        if options.replay is not None and rank == 0:
            file = options.replay.rpartition(":")[0]
            self.factory = {"factory": options.replay, "path": os.path.abspath(file)}

    def start(self, pipeline: Pipeline, log: MetricLog, retainer: RetentionRunner | None) -> None:
        """The session started (and restored ``step``): capture into ``pipeline`` from here."""
        self.pipeline, self.log, self.retainer = pipeline, log, retainer
        self.last_staged = self.step
        epoch = getattr(self.scheduler, "last_epoch", None)
        self.sched_offset = epoch - self.step if isinstance(epoch, int) else None

    def before_step(self) -> None:
        """Pre-step: finish the previous step's copies, check it, seal it; surface errors."""
        if self.flight is not None:
            self._settle(self.flight)  # clears ``flight`` once sealed or dropped
        self._surface_errors()
        self.in_step = True

    def after_step(self) -> None:
        """Post-step: one more optimizer step was taken; capture it if due (else remember
        its step state: ``close`` commits the last step whatever ``every`` says)."""
        self.in_step = False
        self.step += 1
        self.taken += 1
        if not self._due():
            self.tail = self.state.step_state.objects()
            self.tail_ended = False
            if self.options.every == "auto":
                self.light.append(self.step)
            return
        self.tail = None
        assert self.pipeline is not None
        if self.flight is not None:  # a step without the pre-hook (several optimizers?)
            self._settle(self.flight)
        tensors, objects = self.state.step_state.capture()
        self.boundary = None
        # built only for a step the pipeline encodes (~3 µs per tensor: raw steps skip it)
        predictions = (
            self.state.step_state.predictions
            if self.options.encoding is not None and self.options.encoding.predict
            else None
        )
        self.flight = self.pipeline.stage(
            self.step, tensors, objects, predictions, keyframe=self.keyframe_next
        )
        self.last_staged = self.step
        self.keyframe_next = False

    def _due(self) -> bool:
        """Is the step just taken captured? ``every=N``: every N-th. ``every="auto"``: when the
        engine can take it without blocking training and within its overhead budget
        (``Pipeline.can_take``), and always
        after ``max_gap`` light steps in a row (then it may block: a rebuild never replays
        more than ``max_gap`` steps)."""
        every = self.options.every
        if every != "auto":
            return self.step % every == 0
        assert self.pipeline is not None
        self.pipeline.tick()  # the interval that ended, charged to the overhead budget
        if self.step - 1 - self.last_staged >= self.options.max_gap:
            return True  # the same on every rank: they stored the same steps before
        ok = self.pipeline.can_take()
        return ok if self.agree is None else self.agree(self.step, ok)

    def _tail_due(self, exc: BaseException | None) -> bool:
        """Does ``close`` commit the last step ``every`` skipped? Always on a clean exit; on
        an exception only for a finished step (``_finished_on_error``)."""
        if self.tail is None or self.step <= self.last_staged:
            return False
        if exc is None:
            return True
        return self.tail_on_error and self._finished_on_error(exc, self.tail_ended)

    def _finished_on_error(self, exc: BaseException, ended: bool) -> bool:
        """On an exception: was the last step finished, so that ``close`` commits it? Not for
        a dstt error (the engine itself failed) nor inside an optimizer step (tensors half
        updated). Otherwise yes if its iteration ended (the loop asked for the next batch), or
        if its optimizer step is done and the LR scheduler has stepped with it (the boundary
        state is then snapshotted at ``close``: what raised came after the step's update,
        e.g. in logging, evaluation or the next forward). A step whose scheduler had not
        stepped yet is dropped: its resume would repeat the scheduler step."""
        if isinstance(exc, DsttError) or self.in_step:
            return False
        return ended or self._scheduler_in_step()

    def _scheduler_in_step(self) -> bool:
        """Whether the scheduler (if any) has stepped once per optimizer step taken."""
        epoch = getattr(self.scheduler, "last_epoch", None)
        if self.scheduler is None or not isinstance(epoch, int) or self.sched_offset is None:
            return True
        return epoch - self.step == self.sched_offset

    def _commit_tail(self) -> None:
        """Stage the last step now (its tensors are as the optimizer left them), with the
        step state snapshotted after its optimizer step, and seal it."""
        assert self.pipeline is not None
        assert self.tail is not None
        objects, self.tail = self.tail, None
        # built only for a step the pipeline encodes (~3 µs per tensor: raw steps skip it)
        predictions = (
            self.state.step_state.predictions
            if self.options.encoding is not None and self.options.encoding.predict
            else None
        )
        f = self.pipeline.stage(
            self.step,
            self.state.step_state.tensors(),
            objects,
            predictions,
            keyframe=self.keyframe_next,
        )
        self.last_staged = self.step
        self.flight, self.boundary = f, None
        try:
            self._settle(f, stacklevel=5)  # finish <- close
        finally:
            self.flight = None

    def finish(self, exc: BaseException | None) -> RaceError | None:
        """At ``close``: seal the step in flight — or, after an exception that left it
        unfinished, drop it — and commit the last step ``every`` skipped if due. Returns the
        ``RaceError`` a clean close raises once the engine is closed (None: none)."""
        clean = exc is None
        pending_error: RaceError | None = None
        f, self.flight = self.flight, None
        if f is not None:
            pipe = self.pipeline
            assert pipe is not None
            if (
                clean
                or self.boundary is not None
                or (exc is not None and self.tail_on_error and self._finished_on_error(exc, False))
            ):
                if self.boundary is None:  # its step finished; the iteration not
                    self.boundary = self.state.boundary_state.objects()
                try:
                    self._settle(f, stacklevel=5)  # <- close
                except RaceError as e:
                    pending_error = e if clean else None
            else:
                pipe.wait_copied(f)
                pipe.abort(f)
        if self._tail_due(exc):
            try:
                self._commit_tail()
            except RaceError as e:
                pending_error = pending_error or (e if clean else None)
        return pending_error

    def _settle(self, f: Flight, *, stacklevel: int = 4) -> None:
        """Wait for ``f``'s copies, check them (``race_policy``) and seal it; a race warning
        names the frame ``stacklevel`` up (from a hook: the optimizer's step)."""
        pipe = self.pipeline
        assert pipe is not None
        pipe.wait_copied(f)
        races = pipe.check(f) if not f.dead else []
        if races:
            names = ", ".join(f"{r.path} ({r.reason})" for r in races[:5])
            more = f" and {len(races) - 5} more" if len(races) > 5 else ""
            msg = (
                f"step {f.step}: tensors were modified in place while being copied: "
                f"{names}{more}. Something outside the optimizer writes them between "
                "optimizer steps (a forward hook, tied weights, a custom update); "
            )
            if self.options.race_policy == "raise":
                err = RaceError(
                    msg + "step not checkpointed. Use race_policy='recopy' to copy "
                    "them again at the next step, or 'warn' to accept the copy."
                )
                pipe.abort(f, err)
                self.flight = self.boundary = None
                raise err
            if self.options.race_policy == "recopy":
                pipe.recopy(f, [r.path for r in races])
            else:
                warnings.warn(
                    msg + "the checkpoint may mix old and new values.",
                    RuntimeWarning,
                    stacklevel=stacklevel,
                )
        boundary = dict(
            self.boundary if self.boundary is not None else self.state.boundary_state.objects()
        )
        own, history = self.log.take(f.step)
        if own:
            f.add_metrics(own)
        if history is not None:
            boundary[METRICS_HISTORY_OBJECT] = history
        light = [k for k in self.light if k < f.step]
        self.light = [k for k in self.light if k > f.step]
        if light and self.rank == 0:  # every="auto": the light steps since the last
            # commit, with their losses (with several ranks: rank 0's record, once)
            logged = dict(zip(history["steps"], history["metrics"], strict=True)) if history else {}
            boundary[LIGHT_OBJECT] = light_record(light, logged.get, self.fingerprints)
        for k in light:
            pipe.record_light(k)
        if self.factory is not None:
            boundary[REPLAY_OBJECT] = self.factory
        for k in [k for k in self.fingerprints if k <= f.step]:
            del self.fingerprints[k]
        batches = self.batches.take(f.step)
        if batches is not None and self.rank == 0:
            boundary[BATCHES_OBJECT] = batches  # with several ranks: rank 0's batches
        elif batches is not None and self.rank:  # and each other rank's own, beside them
            boundary[f"{BATCHES_OBJECT}/r{self.rank}"] = batches
        if self.retainer is not None:  # what background gcs pruned since the last commit
            done = self.retainer.take_metrics()
            if done:
                f.add_metrics(done)
        pipe.seal(f, boundary)
        if self.retainer is not None:
            self.retainer.sealed()
        if self.flight is f:
            self.flight = self.boundary = None

    def at_boundary(self) -> None:
        """End of an iteration (the loop asks for the next batch): snapshot boundary state."""
        if self.flight is not None and self.boundary is None:
            self.boundary = self.state.boundary_state.objects()
        if self.tail is not None:
            self.tail_ended = True

    def _surface_errors(self) -> None:
        assert self.pipeline is not None
        failed = self.pipeline.take_errors()
        if not failed:
            return
        if self.options.error_policy == "raise":
            raise capture_error(failed)
        for f in failed:
            warn_skipped(f)
