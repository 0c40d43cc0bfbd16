"""One staged step (``Flight``) and what capturing it cost (``StepMetrics``).

A flight carries a step from the training thread's ``stage`` to the committer: its tensors
and version snapshot, its flat plan and step buffer (or, for a step larger than a buffer, the
byte views its segments are copied from), its objects, its ``StepHandle``, and the events and
counters the pipeline's threads coordinate through. Kept apart from ``pipeline.py`` (the
threads that move flights) so each module has one job.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .staging import Copier, VersionGuard

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from dstt.store._internal import CommitHeader, Prediction, StepHandle

    from .flatlane import FlatPlan
    from .summaries import SummaryAccumulator

__all__ = ["Flight", "StepMetrics"]


@dataclass(frozen=True)
class StepMetrics:
    """What capturing one step cost (times in seconds, sizes in bytes)."""

    step: int
    committed: bool
    bytes: int  # tensor bytes staged
    blocked_s: float  # training thread waited for this step's copies
    copy_s: float  # stage → last chunk on the host
    stall_s: float  # copy thread waited for a free buffer (backpressure of the budget)
    flush_s: float  # stage → commit returned (or the step was dropped)
    cache_bytes: int  # ring bytes held when the step was staged
    cache_peak_bytes: int  # peak held bytes so far
    cache_capacity: int
    backlog: int  # earlier steps not yet committed when this one was staged
    error: str | None = None
    #: CPU seconds the writer threads spent on this step: on a machine with few cores this,
    #: not ``blocked_s``, is what slows training (it competes for cores and the GIL)
    writer_cpu_s: float = 0.0
    written_bytes: int = 0  # bytes the step put on disk (after deltas and dedup)
    keyframes: int = 0  # chunks written whole
    deltas: int = 0  # chunks written as XOR deltas (DeltaPolicy)
    dedups: int = 0  # unchanged chunks referenced, not written
    raw_fallback: bool = False  # encoding skipped: the flush was behind (DeltaPolicy)
    #: False for a *light* step of ``every="auto"``: not stored (the engine was busy), only
    #: its metrics, sample indices and loss fingerprint ride with the next commit
    stored: bool = True


def _encode_metrics(handle: StepHandle | None) -> dict[str, Any]:
    if handle is None:  # failed before its step began
        return {}
    st = handle.stats
    return {
        "written_bytes": st.written_bytes,
        "keyframes": st.keyframes,
        "deltas": st.deltas,
        "dedups": st.dedups,
        "raw_fallback": st.raw_fallback,
    }


class _Aborted(Exception):
    """Marker cause of a flight the session dropped on purpose."""


class Flight:
    """One staged step on its way to a commit."""

    def __init__(
        self,
        step: int,
        tensors: Mapping[str, torch.Tensor],
        objects: Mapping[str, Any],
        verify: bool,
        predictions: Mapping[str, Prediction] | None = None,
        *,
        flat: FlatPlan | None = None,
    ) -> None:
        self.step = step
        #: the step's flat plan (None: objects only, ``flatlane.py``)
        self.flat = flat
        #: written from one buffer (else in segments, ``flatlane.Segment``; the copy thread
        #: decides once the ring exists)
        self.whole = True
        self.buffer: int | None = None  # the step buffer of a whole step, while held
        self.precopied = False  # copied on the training thread at stage
        self.flat_queued = False  # its write task (which frees the buffer) is queued
        self.flat_stats: dict[str, Any] = {}
        #: the id of this step's digest (``summary_kernel.digest``), -1 for none
        self.digest_token = -1
        #: a segmented step's tensors as flat bytes (set by the copy thread)
        self.sources: dict[str, torch.Tensor] = {}
        # hints for an encoding writer (none otherwise): each needs its whole group captured
        self.predictions: dict[str, Prediction] = (
            {p: x for p, x in predictions.items() if all(g in tensors for g in x.group)}
            if predictions
            else {}
        )
        self.segments_done = 0  # segments written (they go in byte order)
        # the hot path: nothing per tensor but the version snapshot (verify: a checksum)
        self.tensors = dict(tensors)
        self.nbytes = flat.nbytes if flat is not None else 0
        sizes = {p: t.element_size() for p, t in self.tensors.items()} if verify else {}
        self.guard = VersionGuard(self.tensors, sizes, verify=verify)
        self.marks = Copier.mark(self.tensors.values()) if flat is not None and flat.cuda else {}
        self.objects = dict(objects)
        #: where the step goes (``dstt.store._seam``; set by the copy thread)
        self.handle: StepHandle | None = None
        self.wrote = False  # it wrote bytes that a discard would free
        self.summaries: dict[str, SummaryAccumulator] = {}
        self.copied = threading.Event()
        self.done = threading.Event()
        self._cond = threading.Condition()
        self.pending = 0
        self.sealed = False
        self.seal_objects: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.reported = False  # the training thread already raised/warned about ``error``
        self.header: CommitHeader | None = None  # (None for a share another commits)
        self.committed = False
        self.t_stage = time.perf_counter()
        self.t_copied = self.t_stage
        self.blocked_s = self.stall_s = 0.0
        self.cpu_s = 0.0  # CPU the writer threads spent on this step (competes with training)
        self.wall_s = 0.0  # wall time of the writer tasks of this step
        self._cpu_lock = threading.Lock()
        self.cache_bytes = self.backlog = 0
        self.encode = False  # the writers encode this step (DeltaPolicy; see governor.py)
        self.keyframe = False  # written whole on request (Session.keyframe)

    def __repr__(self) -> str:
        state = (
            "committed"
            if self.committed
            else f"failed: {self.error!r}"
            if self.error is not None
            else "in flight"
        )
        return f"<Flight step={self.step} {state}>"

    # -- state --------------------------------------------------------------------------
    @property
    def dead(self) -> bool:
        return self.error is not None

    def fail(self, error: BaseException, *, reported: bool = False) -> None:
        with self._cond:
            if self.error is None:
                self.error, self.reported = error, reported
            self._cond.notify_all()

    def add_pending(self) -> None:
        with self._cond:
            self.pending += 1

    def add_cpu(self, seconds: float, wall: float = 0.0) -> None:
        with self._cpu_lock:
            self.cpu_s += seconds
            self.wall_s += wall

    def task_done(self) -> None:
        with self._cond:
            self.pending -= 1
            if self.pending == 0:
                self._cond.notify_all()

    def wait_writes(self) -> None:
        with self._cond:
            while self.pending:
                self._cond.wait()

    def wait_segment(self, n: int) -> None:
        """Wait until the segments before the ``n``-th are written (or the step failed)."""
        with self._cond:
            while self.segments_done < n and not self.dead:
                self._cond.wait()

    def segment_done(self) -> None:
        with self._cond:
            self.segments_done += 1
            self._cond.notify_all()

    def seal(self, objects: Mapping[str, Any]) -> None:
        with self._cond:
            self.seal_objects = dict(objects)
            self.sealed = True
            self._cond.notify_all()

    def wait_sealed(self) -> None:
        with self._cond:
            while not (self.sealed or self.dead):
                self._cond.wait()

    def add_metrics(self, metrics: Mapping[str, Any]) -> None:
        with self._cond:
            self.metrics.update(metrics)

    def metrics_now(self) -> dict[str, Any]:
        """A copy of the metrics given so far (``add_metrics`` may run on another thread)."""
        with self._cond:
            return dict(self.metrics)
