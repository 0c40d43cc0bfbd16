"""``Session``: capture every optimizer step of a plain PyTorch loop, lazily, and resume it.

The session attaches to the optimizer through its step hooks and drives the capture engine;
what each hook does is ``dstt.training.steps`` (``StepCapture``, which a ``Session`` holds).
This module is construction, the public surface, the lifecycle and resume; ``s.log`` is
``dstt.training.metrics``. Background errors surface on the training thread at the next
optimizer step (``error_policy="raise"``: ``CaptureError``) or as a warning (``"skip"``).
Rejected alternative: wrapping ``optimizer.step`` — it breaks ``LRScheduler``'s own wrapper,
``torch.compile``d steps and anyone else who patches it; the hooks are the supported seam.
Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dstt import schema
from dstt.engine.capture.pipeline import SUMMARIES_OBJECT, Pipeline, StepMetrics
from dstt.engine.distributed.sharding import check_layout
from dstt.engine.state.data_position import DataPosition, TrackedData
from dstt.engine.state.dims import DimsOf, ModelDims
from dstt.engine.state.optimizers import optimizers_of
from dstt.engine.state.providers import RankObject, StoreSource
from dstt.engine.state.torch_state import ONE_RANK, Stateful, TorchState, discover
from dstt.errors import CaptureError, NotARunError, TimelineError
from dstt.store._internal import DEFAULT_CHUNK_BYTES, GcReport, Repository

from .checks import capture_error, check_optimizer, warn_skipped
from .data import BatchLog, RecordedData, SkipSet, read_skips
from .imported import imported_gaps
from .metrics import MetricLog, metric_value
from .options import DEFAULT_BUDGET, CopyMode, ErrorPolicy, RacePolicy, SessionOptions
from .retention import RetentionRunner, store_writer
from .steps import StepCapture
from .stopping import finish_before_interrupt

if TYPE_CHECKING:
    from dstt.store._internal import Reader

__all__ = [
    "DEFAULT_BUDGET",
    "CopyMode",
    "ErrorPolicy",
    "OptimizerArg",
    "RacePolicy",
    "Session",
    "SessionOptions",
]

#: one optimizer, a list of them, or a dict of them by name
OptimizerArg = (
    torch.optim.Optimizer
    | Sequence[torch.optim.Optimizer]
    | Mapping[str, torch.optim.Optimizer]
    | None
)


class Session:
    """A capturing session over one model/optimizer and one run; use ``dstt.session(...)``."""

    #: read and verify the whole step before restoring anything (a damaged step then leaves
    #: the live model untouched); the DeepSpeed session reads per-rank partitions instead
    _prefetch_restore = True
    #: on an exception, commit the last step ``every`` skipped (the DeepSpeed session does not:
    #: the other ranks may not be there to write their parts)
    _tail_on_error = True

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: OptimizerArg = None,
        *,
        options: SessionOptions,
        scheduler: Any = None,
        extra_state: Mapping[str, Stateful] | None = None,
    ) -> None:
        if not isinstance(options, SessionOptions):
            raise TypeError(f"options must be a dstt.SessionOptions, not {options!r}")
        self.options = options
        self._retainer: RetentionRunner | None = None  # dstt.training.retention
        #: the optimizers by key (``{"": opt}`` for one; ``engine.state.torch_state.optimizers_of``)
        self.optimizers = optimizers_of(optimizer)
        self.model, self.scheduler = model, scheduler
        #: the optimizer (the first of several)
        self.optimizer = next(iter(self.optimizers.values()), None)
        if model is not None and self.optimizers:
            check_optimizer(model, self.optimizers)
        self.summaries_object = SUMMARIES_OBJECT  # per rank when several ranks write
        self.repo: Repository | None = None
        self._state = self._discover(scheduler, extra_state)
        self._writer: Any = None
        self._pipeline: Pipeline | None = None
        self._hooks: list[Any] = []
        self._log = MetricLog(0)
        self._position = DataPosition()
        self._tracked: TrackedData | None = None
        self._skip = 0
        self._batches = BatchLog()  # per-step batch fingerprints (dstt.training.data)
        self._skips = SkipSet()  # what this timeline drops (run.rollback(skip_samples=...))
        self._loader_state: Any = None  # a stateful loader's saved state, with its batch count
        self._started = self._closed = False
        #: what the hooks do per step, and the step counters (``dstt.training.steps``); with
        #: several ranks only rank 0's batch fingerprints go with the commits
        self._capture = StepCapture(
            self._state,
            options,
            scheduler=scheduler,
            batches=self._batches,
            rank=getattr(getattr(self, "info", None), "rank", 0),
            tail_on_error=self._tail_on_error,
        )

    # -- public ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        """Optimizer steps already taken (the restored step after a resume; 0 for a new run)."""
        return self._capture.step

    @property
    def epoch(self) -> int:
        """Epoch of the data position (passes completed through ``data()``)."""
        return self._current_position().epoch

    @property
    def metrics(self) -> tuple[StepMetrics, ...]:
        """Engine metrics of every finished (committed or dropped) step, oldest first, and of
        every light step of ``every="auto"`` (``stored=False``), filed when the commit that
        records it is sealed."""
        return self._pipeline.metrics if self._pipeline else ()

    @property
    def retention_runs(self) -> tuple[tuple[GcReport, float], ...]:
        """Each background gc of ``retention`` so far: (its report, the seconds it took)."""
        return tuple(self._retainer.runs) if self._retainer is not None else ()

    def data(self, loader: Iterable[Any]) -> TrackedData:
        """Wrap an iterable so the session records (and on resume restores) the data position.

        One pass over the wrapper is one epoch; after a resume the first pass skips the batches
        the restored step had consumed: by restoring the loader's saved state when it has
        ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``), else by
        drawing and dropping them. Each batch's fingerprint (its sample indices, else a hash)
        is recorded under its step (``run.batches()``), and the samples and batches the
        timeline skips (``run.rollback(skip_samples=..., skip_batches=...)``) are dropped; see
        :mod:`dstt.training.data`. Call it inside the ``with`` block (after the restore).
        """
        if not self._started:
            raise CaptureError(
                "call s.data(...) inside the `with dstt.session(...)` block, "
                "after the session has restored its data position"
            )
        skip = self._skip
        if self._loader_state is not None and callable(getattr(loader, "load_state_dict", None)):
            state, consumed = self._loader_state
            loader.load_state_dict(state)  # type: ignore[attr-defined]
            skip -= consumed  # only the rollback's skip_data is still drawn and dropped
        self._loader_state = None
        cap = self._capture
        self._tracked = RecordedData(
            loader,
            self._current_position(),
            skip=skip,
            on_next=cap.at_boundary,
            step=lambda: cap.step,
            log=self._batches,
            skips=self._skips,
        )
        self._skip = 0
        return self._tracked

    def log(self, step: int | None = None, **metrics: Any) -> None:
        """Record scalar metrics (``loss=..., lr=...``) of the current iteration's step.

        A call belongs to the optimizer step of its iteration, before or after
        ``optimizer.step()`` alike: the session learns the placement from the first call (made
        before any optimizer step of this session: each call belongs to the next step; else to
        the step just taken). ``step=k`` names the step explicitly. Metrics of steps that
        ``every`` does not capture are carried by the next commit; ``dstt.open(run).metrics()``
        shows every step's.
        """
        clean = {k: metric_value(k, v) for k, v in metrics.items()}
        if not self._keeps_metrics():
            return
        if step is None:
            step = self._log.target(self._capture.step, self._capture.taken)
        elif not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise TypeError(f"s.log(step=...) takes a positive int, not {step!r}")
        self._log.add(step, clean)

    def wait(self) -> None:
        """Wait for the last staged step's copies and seal it (what the pre-step hook does).

        Only needed without an optimizer: call it before changing captured tensors yourself.
        """
        self._capture.before_step()

    def keyframe(self) -> None:
        """Write the next captured step whole, whatever ``encoding`` says: every chunk a plain
        Zarr chunk (readable without dstt; a cheap starting point for reads), and the next
        steps' deltas chain from it. Use it at milestones (an eval, a learning-rate change)."""
        self._capture.keyframe_next = True

    def mark_step(self) -> None:
        """Count one step and capture it (for loops without an optimizer to hook)."""
        self._capture.before_step()
        self._capture.after_step()

    def _fingerprint(self, step: int, loss: float | None) -> None:
        """The loss of light step ``step`` as a framework callback took it (its training
        step's own, which a rebuild recomputes; None: no loss a rebuild can check), recorded
        in place of the ``loss`` the step logged (``dstt.engine.capture.light``)."""
        self._capture.fingerprints[int(step)] = loss

    def _at_boundary(self) -> None:
        """End of an iteration (the loop asks for the next batch; the framework callbacks of
        ``dstt.integrations`` call it after the optimizer and scheduler stepped)."""
        self._capture.at_boundary()

    # -- seams (DeepSpeedSession overrides these) ----------------------------------------
    def _keeps_metrics(self) -> bool:
        """Whether ``s.log`` on this process reaches a commit."""
        return True

    def _dims_of(self) -> DimsOf:
        """Dimension names of the captured arrays (from the model's module types)."""
        return ModelDims(self.model)

    def _discover(self, scheduler: Any, extra_state: Mapping[str, Stateful] | None) -> TorchState:
        return discover(
            self.model,
            self.optimizers_arg(),
            scheduler=scheduler,
            extra_state=extra_state,
            extra=[RankObject(schema.DATA_OBJECT, ONE_RANK, self._data_state, self._set_data)],
        )

    def _open(self, chunk: int) -> tuple[Any, Any, Any]:
        """Open the run for writing: ``(writer, reader, head to restore or None)``."""
        run = self.options.run
        if isinstance(run, (str, os.PathLike)) and os.path.isfile(run):
            raise NotARunError(
                f"run={os.fspath(run)!r} is a file; a run is a directory: pass "
                "an existing run's directory or a new path"
            )
        self.repo = run if isinstance(run, Repository) else Repository.create(run)
        writer = self.repo.writer(
            chunk_bytes=chunk, encoding=self.options.encoding, inflight_bases=True, lazy_refs=True
        )
        try:
            reader = self.repo.reader()
            head = reader.head()
            if head is not None and not self.options.resume:
                raise TimelineError(
                    f"run {self.repo.storage.location} already has committed steps (timeline "
                    f"{reader.current_timeline!r} is at step {head.step}); pass resume=True to "
                    "continue it, or choose a new run path"
                )
        except BaseException:
            writer.close()
            raise
        return writer, reader, head

    def _restore_state(self, source: StoreSource) -> None:
        check_layout(source, None, world=1)  # a pipeline's stages resume only as a pipeline
        self._state.step_state.restore(source)
        self._state.boundary_state.restore(source)

    def optimizers_arg(self) -> Any:
        """The optimizer(s) as ``optimizers_of`` takes them back (None, one, or a dict)."""
        if not self.optimizers:
            return None
        return self.optimizer if "" in self.optimizers else dict(self.optimizers)

    def _attach(self) -> list[Any]:
        """Install the step hooks; returns handles with ``remove()``.

        With several optimizers, the first of them to step in an iteration waits for the last
        step's copies (every pre-step hook does, and only the first finds any), and a step is
        counted once every optimizer has stepped since the last one (the last post-step hook
        captures it): one iteration of ``a.step(); b.step()`` is one step, and no optimizer
        updates a tensor while its copy is in flight."""
        opts = list(self.optimizers.values())
        cap = self._capture
        stepped: set[int] = set()  # (one optimizer: each of its steps is one step)

        def post(opt: torch.optim.Optimizer, *_: Any) -> None:
            stepped.add(id(opt))
            if len(stepped) == len(opts):
                stepped.clear()
                cap.after_step()

        return [
            h
            for o in opts
            for h in (
                o.register_step_pre_hook(lambda *_: cap.before_step()),
                o.register_step_post_hook(post),
            )
        ]

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> Session:
        self.start()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        with finish_before_interrupt(again=isinstance(exc, KeyboardInterrupt)):
            self.close(exc)

    def start(self) -> None:
        if self._started:
            raise CaptureError("this session was already started")
        self._started = True
        o = self.options
        chunk = min(DEFAULT_CHUNK_BYTES, max(4096, o.budget_bytes // 4))
        self._writer, reader, head = self._open(chunk)
        try:
            if head is not None:
                self._restore(reader, head)
            self._pipeline = Pipeline(
                self._writer,
                budget_bytes=o.budget_bytes,
                writers=o.writer_threads,
                verify=o.verify,
                max_backlog=o.max_backlog,
                summaries=o.summaries,
                summaries_object=self.summaries_object,
                copy=o.copy,
                dims=self._dims_of(),
            )
            self._log = MetricLog(self._capture.step)
            if head is not None:  # the first step's update is measured from the parent's
                self._pipeline.seed_summaries(self._state.step_state.tensors())
            self._hooks = self._attach()
            gc_writer = store_writer(self._writer)
            if o.retention is not None and o.retention.prunes and gc_writer is not None:
                self._retainer = RetentionRunner(gc_writer, o.retention)
            self._capture.start(self._pipeline, self._log, self._retainer)
        except BaseException:
            self._writer.close()
            raise

    def close(self, exc: BaseException | None = None) -> None:
        """Seal and commit the last step, stop the engine, release the run's lock."""
        if self._closed or not self._started:
            return
        self._closed = True
        pipe = self._pipeline
        clean = exc is None
        pending_error: BaseException | None = None
        aborted = False
        if clean:  # metrics logged after the last step (an eval) join the last step's
            self._log.fold_future(self._capture.step)
        try:
            if pipe is not None:
                pending_error = self._capture.finish(exc)
                for g in pipe.pending():  # safety net: nothing may wait for a seal forever
                    if not g.sealed:
                        pipe.abort(g)
                pipe.drain()
        except BaseException:  # interrupted while finishing (a second Ctrl-C): drop the rest
            aborted = True
            raise
        finally:
            for h in self._hooks:
                h.remove()
            self._hooks = []
            try:
                if self._retainer is not None:  # a running gc finishes under the writer
                    self._retainer.close(final=clean and not aborted)
                if pipe is not None:
                    pipe.close(abort=aborted)
            finally:
                self._writer.close()
        if pipe is not None:
            failed = pipe.take_errors()
            if failed:
                if clean and self.options.error_policy == "raise" and pending_error is None:
                    pending_error = capture_error(failed)
                else:
                    for f in failed:
                        warn_skipped(f, continuing=False)
        if pending_error is not None:
            raise pending_error

    # -- data position and resume ---------------------------------------------------------
    def _current_position(self) -> DataPosition:
        return self._tracked.position if self._tracked is not None else self._position

    def _data_state(self) -> dict[str, Any]:
        p = self._current_position()
        out: dict[str, Any] = {"epoch": p.epoch, "batch": p.batch, "total": p.total}
        loader = self._tracked.loader if self._tracked is not None else None
        if callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        ):
            out["loader"] = loader.state_dict()  # type: ignore[union-attr]
        return out

    def _set_data(self, state: Mapping[str, Any]) -> None:
        self._position = DataPosition(int(state["epoch"]), int(state["batch"]), int(state["total"]))
        self._skip = self._position.batch
        self._loader_state = (
            (state["loader"], self._position.batch) if state.get("loader") is not None else None
        )
        self._tracked = None

    def _restore(self, reader: Reader, head: Any) -> None:
        # one's own run: pickled user state is trusted, as torch.load of one's own
        # checkpoint; only the objects a provider restores are decoded at all
        source = StoreSource(reader, head, prefetch=self._prefetch_restore, trusted=True)
        with imported_gaps(
            source,
            self._state.step_state,
            optimizer=bool(self.optimizers),
            scheduler=self.scheduler is not None,
        ):
            self._restore_state(source)
        source.unused_damage()
        self._capture.step = head.step
        ref = reader.ref()
        self._skips = read_skips(reader.storage, reader.timelines, ref.name)
        if ref.skip_data and head.slot == ref.base_slot:  # fresh rollback: skip bad batches
            p = self._position
            self._position = DataPosition(p.epoch, p.batch + ref.skip_data, p.total + ref.skip_data)
            self._skip += ref.skip_data
