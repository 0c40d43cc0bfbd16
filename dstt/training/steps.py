"""The per-step capture protocol of ``Session``: what its optimizer hooks do.

* post-step hook of step *k* → ``stage(k)``: the pipeline starts copying the model and optimizer
  tensors into the host cache and returns at once; RNG states, the data position and
  ``extra_state`` are snapshotted here;
* end of iteration *k* (the loop asks ``s.data(...)`` for the next batch; without it, the next
  pre-step hook) → snapshot the *boundary state*: optimizer hyperparameters, LR scheduler
  (stepped by now) and ``extra_state``;
* pre-step hook of step *k+1* → wait for step *k*'s copies (the only point that blocks
  training), run the version guard, then *seal* step *k*: hand it to the committer, which
  commits it with the metrics ``s.log`` attached once its chunks are on disk;
* leaving the block seals and drains the last step, and commits the last optimizer step
  even where ``every`` did not select it (its step state was snapshotted after its optimizer
  step), so training never loses its end. An exception or ``KeyboardInterrupt`` inside the
  block commits the last step only if its iteration had finished (the loop asked
  ``s.data(...)`` for the next batch) and no optimizer step was under way; else it drops it
  whole, and a dstt error of the engine commits nothing more. Already-sealed steps finish
  committing. What is visible is always a complete, consistent step.

``StepHooks`` is a base class of ``Session`` (``dstt.training.session``), which imports this
module and never the other way; the attributes it uses are declared here and set by
``Session.__init__``, and ``DeepSpeedSession`` installs the same methods on its engine. So the
session module stays about construction, the public surface and the lifecycle. Rejected
alternative: module-level functions taking the session — every call site and the DeepSpeed
session's hooks would change, for no gain over methods.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from dstt.errors import DsttError, RaceError

from .checks import capture_error, warn_skipped
from .data import BATCHES_OBJECT, BatchLog
from .metrics import METRICS_HISTORY_OBJECT, MetricLog

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.engine.pipeline import Flight, Pipeline
    from dstt.engine.torch_state import TorchState

    from .options import SessionOptions
    from .retention import RetentionRunner

__all__ = ["StepHooks"]


class StepHooks:
    """The hooks' side of a ``Session``: stage, settle (race check, seal), the tail commit."""

    _tail_on_error: bool
    options: SessionOptions
    scheduler: Any
    _sched_offset: int | None
    _state: TorchState
    _pipeline: Pipeline | None
    _flight: Flight | None
    _boundary: Mapping[str, Any] | None
    _step: int
    _taken: int
    _in_step: bool
    _last_staged: int
    _tail: Mapping[str, Any] | None
    _tail_ended: bool
    _keyframe_next: bool
    _log: MetricLog
    _batches: BatchLog
    _retainer: RetentionRunner | None

    def _before_step(self) -> None:
        """Pre-step: finish the previous step's copies, check it, seal it; surface errors."""
        if self._flight is not None:
            self._settle(self._flight)  # clears ``_flight`` once sealed or dropped
        self._surface_errors()
        self._in_step = True

    def _after_step(self) -> None:
        """Post-step: one more optimizer step was taken; capture it if due (else remember
        its step state: ``close`` commits the last step whatever ``every`` says)."""
        self._in_step = False
        self._step += 1
        self._taken += 1
        if self._step % self.options.every:
            self._tail = self._state.step_state.objects()
            self._tail_ended = False
            return
        self._tail = None
        assert self._pipeline is not None
        if self._flight is not None:  # a step without the pre-hook (several optimizers?)
            self._settle(self._flight)
        tensors, objects = self._state.step_state.capture()
        self._boundary = None
        # built only for a step the pipeline encodes (~3 µs per tensor: raw steps skip it)
        predictions = (self._state.step_state.predictions
                       if self.options.encoding is not None and self.options.encoding.predict
                       else None)
        self._flight = self._pipeline.stage(self._step, tensors, objects, predictions,
                                            keyframe=self._keyframe_next)
        self._last_staged = self._step
        self._keyframe_next = False

    def _tail_due(self, exc: BaseException | None) -> bool:
        """Does ``close`` commit the last step ``every`` skipped? Always on a clean exit; on
        an exception only for a finished step (``_finished_on_error``)."""
        if self._tail is None or self._step <= self._last_staged:
            return False
        if exc is None:
            return True
        return self._tail_on_error and self._finished_on_error(exc, self._tail_ended)

    def _finished_on_error(self, exc: BaseException, ended: bool) -> bool:
        """On an exception: was the last step finished, so that ``close`` commits it? Not for
        a dstt error (the engine itself failed) nor inside an optimizer step (tensors half
        updated). Otherwise yes if its iteration ended (the loop asked for the next batch), or
        if its optimizer step is done and the LR scheduler has stepped with it (the boundary
        state is then snapshotted at ``close``: what raised came after the step's update,
        e.g. in logging, evaluation or the next forward). A step whose scheduler had not
        stepped yet is dropped: its resume would repeat the scheduler step."""
        if isinstance(exc, DsttError) or self._in_step:
            return False
        return ended or self._scheduler_in_step()

    def _scheduler_in_step(self) -> bool:
        """Whether the scheduler (if any) has stepped once per optimizer step taken."""
        epoch = getattr(self.scheduler, "last_epoch", None)
        if self.scheduler is None or not isinstance(epoch, int) or self._sched_offset is None:
            return True
        return epoch - self._step == self._sched_offset

    def _commit_tail(self) -> None:
        """Stage the last step now (its tensors are as the optimizer left them), with the
        step state snapshotted after its optimizer step, and seal it."""
        assert self._pipeline is not None
        assert self._tail is not None
        objects, self._tail = self._tail, None
        # built only for a step the pipeline encodes (~3 µs per tensor: raw steps skip it)
        predictions = (self._state.step_state.predictions
                       if self.options.encoding is not None and self.options.encoding.predict
                       else None)
        f = self._pipeline.stage(self._step, self._state.step_state.tensors(), objects,
                                 predictions, keyframe=self._keyframe_next)
        self._last_staged = self._step
        self._flight, self._boundary = f, None
        try:
            self._settle(f)
        finally:
            self._flight = None

    def _settle(self, f: Flight) -> None:
        pipe = self._pipeline
        assert pipe is not None
        pipe.wait_copied(f)
        races = pipe.check(f) if not f.dead else []
        if races:
            names = ", ".join(f"{r.path} ({r.reason})" for r in races[:5])
            more = f" and {len(races) - 5} more" if len(races) > 5 else ""
            msg = (f"step {f.step}: tensors were modified in place while being copied: "
                   f"{names}{more}. Something outside the optimizer writes them between "
                   "optimizer steps (a forward hook, tied weights, a custom update); ")
            if self.options.race_policy == "raise":
                err = RaceError(msg + "step not checkpointed. Use race_policy='recopy' to copy "
                                "them again at the next step, or 'warn' to accept the copy.")
                pipe.abort(f, err)
                self._flight = self._boundary = None
                raise err
            if self.options.race_policy == "recopy":
                pipe.recopy(f, [r.path for r in races])
            else:
                warnings.warn(msg + "the checkpoint may mix old and new values.",
                              RuntimeWarning, stacklevel=4)
        boundary = dict(self._boundary if self._boundary is not None
                        else self._state.boundary_state.objects())
        own, history = self._log.take(f.step)
        if own:
            f.add_metrics(own)
        if history is not None:
            boundary[METRICS_HISTORY_OBJECT] = history
        batches = self._batches.take(f.step)
        if batches is not None and getattr(getattr(self, "info", None), "rank", 0) == 0:
            boundary[BATCHES_OBJECT] = batches  # under DeepSpeed: rank 0's batches, once
        if self._retainer is not None:  # what background gcs pruned since the last commit
            done = self._retainer.take_metrics()
            if done:
                f.add_metrics(done)
        pipe.seal(f, boundary)
        if self._retainer is not None:
            self._retainer.sealed()
        if self._flight is f:
            self._flight = self._boundary = None

    def _at_boundary(self) -> None:
        """End of an iteration (the loop asks for the next batch): snapshot boundary state."""
        if self._flight is not None and self._boundary is None:
            self._boundary = self._state.boundary_state.objects()
        if self._tail is not None:
            self._tail_ended = True

    def _surface_errors(self) -> None:
        assert self._pipeline is not None
        failed = self._pipeline.take_errors()
        if not failed:
            return
        if self.options.error_policy == "raise":
            raise capture_error(failed)
        for f in failed:
            warn_skipped(f)
