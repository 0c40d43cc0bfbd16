"""The narrow seam the engine writes steps through: ``StepSink`` → ``StepHandle``, six members.

Call order per step (several in flight, a handle each; failure semantics: ``StepHandle``)::

    layout = sink.layout(arrays)           # once per set of arrays, reused while they hold
    h = sink.begin(step)                   # a fresh slot; nothing visible
    h.write(FlatSegment(layout, 0, buf))   # the step's bytes, in byte order, any pieces
    h.put_object("rng", state)             # any time before the commit
    header = h.commit(metrics)             # visible now (None: a share another commits)
    # or, on any failure before the commit returned:  h.abort()

``TransactionSink`` adapts the three writers. Rejected: driving the ~20-member transaction."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dstt.errors import CaptureError, SegmentError, StorageError

from .format.flat import FlatImage, FlatLayout, StepBytes, byte_view
from .format.records import CommitHeader
from .protocols import FlatStepWriter, OffloadingWriter, StepTransaction

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from .flusher.parent import Flusher
    from .format.records import Metric
    from .protocols import ArraySpec

__all__ = ["FlatSegment", "StepHandle", "StepSink", "TransactionSink"]


@dataclass(frozen=True)
class FlatSegment:
    """Bytes ``[start, start + len(data))`` of a step laid out by ``layout``: whole chunks
    (a cut inside an array falls between its chunks, ``layout.chunks``). ``shared``: the
    index of the flusher's shared buffer holding ``data`` (a whole step only), so the
    flusher process writes it. A writable ``data`` of a framed layout (``flat.py``) gets
    the zip framing written into it (a read-only one is copied)."""

    layout: FlatLayout
    start: int
    data: StepBytes
    shared: int | None = None


@runtime_checkable
class StepHandle(Protocol):
    """One step on its way to a commit (the call order: the module docstring).

    Failure semantics: a refused segment (out of order, overlapping, splitting a chunk,
    another layout) raises ``SegmentError`` and writes nothing; the handle stays open. Any
    other error in ``write`` or ``put_object`` fails the handle: ``commit`` then raises
    ``CaptureError`` and the caller aborts. A step is visible only once ``commit`` returned;
    it commits whole or not at all (a commit with chunks of its layout unwritten raises
    ``SegmentError``); a commit that raised is aborted by the caller. ``abort`` is idempotent
    and a no-op after a commit, so ``finally: h.abort()`` is safe. A flusher that dies
    mid-step costs nothing: its write or commit is done again here (same bytes, places).
    """

    @property
    def step(self) -> int: ...

    def write(self, segment: FlatSegment) -> None: ...

    def put_object(self, name: str, obj: object) -> None: ...

    def commit(self, metrics: Mapping[str, Metric] | None = None) -> CommitHeader | None: ...

    def abort(self) -> None: ...


@runtime_checkable
class StepSink(Protocol):
    """Where steps go: lays out a step's arrays and begins its handles."""

    def layout(self, arrays: Sequence[ArraySpec]) -> FlatLayout: ...

    def begin(self, step: int, *, encode: bool = True, keyframe: bool = False) -> StepHandle: ...


class TransactionSink:
    """``StepSink`` over a ``StepWriter``; ``flusher``: the store's flusher process for
    segments in its shared buffers (and the writer's committer, where it offloads)."""

    def __init__(self, writer: FlatStepWriter, flusher: Flusher | None = None) -> None:
        self.writer, self.flusher = writer, flusher
        self._encodes = writer.encoder is not None
        #: each layout's chunk starts, by id (segments are cut by bisecting them)
        self._starts: dict[int, tuple[FlatLayout, list[int]]] = {}
        if flusher is not None and isinstance(writer, OffloadingWriter):
            writer.committer = flusher

    def layout(self, arrays: Sequence[ArraySpec]) -> FlatLayout:
        return self.writer.flat_layout(arrays)

    def starts(self, layout: FlatLayout) -> list[int]:
        """Where each chunk of ``layout`` starts (built once per layout)."""
        hit = self._starts.get(id(layout))
        if hit is None or hit[0] is not layout:
            if len(self._starts) > 16:
                self._starts.clear()
            hit = self._starts[id(layout)] = (layout, [c[2] for c in layout.chunks])
        return hit[1]

    def begin(self, step: int, *, encode: bool = True, keyframe: bool = False) -> _Handle:
        txn = self.writer.begin(step)
        txn.encode, txn.keyframe = encode, keyframe
        return _Handle(self, txn, encode and self._encodes and not keyframe)


class _Handle:
    """A ``StepHandle`` over one ``StepTransaction``."""

    def __init__(self, sink: TransactionSink, txn: StepTransaction, encoded: bool) -> None:
        self._sink, self._txn, self._encoded = sink, txn, encoded
        self._lock = threading.Lock()
        self._layout: FlatLayout | None = None
        self._end = 0  # bytes of the layout written so far (segments come in order)
        self._written = 0  # chunks of the layout written so far
        self._failed: BaseException | None = None
        self._state = "open"

    @property
    def step(self) -> int:
        return self._txn.step

    def _open(self, what: str) -> None:
        if self._state != "open":
            raise CaptureError(f"step {self.step} is {self._state}: cannot {what}")

    def write(self, segment: FlatSegment) -> None:
        try:
            self._write(segment)
        except SegmentError:
            raise  # refused: nothing written, the step stays open
        except BaseException as e:
            if self._state == "open":
                self._failed = e
            raise

    def _write(self, segment: FlatSegment) -> None:
        with self._lock:
            self._open("write a segment")
            layout, start = segment.layout, segment.start
            view = byte_view(segment.data)
            stop = start + len(view)
            if self._layout is not None and layout is not self._layout:
                raise SegmentError(
                    f"step {self.step} was begun with another layout: write every segment "
                    "of a step from the one layout ``sink.layout`` gave"
                )
            if start < self._end:
                raise SegmentError(
                    f"segment [{start}, {stop}) of step {self.step} overlaps or precedes the "
                    f"bytes written (up to {self._end}): write segments once, in byte order"
                )
            whole = start == 0 and stop == layout.nbytes
            lo, hi = (0, len(layout.chunks)) if whole else self._chunks(layout, start, stop)
            if not whole and self._layout is None:  # written chunk by chunk: declare all
                for a in layout.arrays:
                    self._txn.declare(a.path, a.dtype, a.shape, a.dims)
            self._layout, self._end = layout, stop
            self._written += hi - lo
        if not whole:
            arrays = layout.arrays
            for k, i, s, e, _, _ in layout.chunks[lo:hi]:
                self._txn.put_chunk(arrays[k].path, i, view[s - start : e - start])
            return
        shared = segment.shared
        if shared is not None and self._via_flusher(layout, shared, view):
            return
        if layout.framed and view.readonly:  # the zip framing is written into the buffer
            view = memoryview(bytearray(view))
        if self._encoded:
            self._txn.put_flat_chunks(layout, view)
        else:
            self._txn.put_flat(layout, view)

    def _chunks(self, layout: FlatLayout, start: int, stop: int) -> tuple[int, int]:
        """The chunks ``[lo, hi)`` of ``layout`` in bytes ``[start, stop)``; ``SegmentError``
        where a chunk straddles an end (segments cut an array only between its chunks)."""
        if not 0 <= start < stop <= layout.nbytes:
            raise SegmentError(
                f"segment [{start}, {stop}) is outside the step's {layout.nbytes} bytes"
            )
        chunks = layout.chunks
        starts = self._sink.starts(layout)
        lo, hi = bisect.bisect_left(starts, start), bisect.bisect_left(starts, stop)
        for j in (lo - 1, hi - 1):
            if j >= 0 and (chunks[j][3] > start if j < lo else chunks[j][3] > stop):
                k = chunks[j][0]
                raise SegmentError(
                    f"segment [{start}, {stop}) of step {self.step} splits a chunk of array "
                    f"{layout.arrays[k].path!r} [{chunks[j][2]}, {chunks[j][3]}): cut "
                    "segments between chunks"
                )
        if lo == hi:
            raise SegmentError(f"segment [{start}, {stop}) holds no chunk of the step")
        return lo, hi

    def _via_flusher(self, layout: FlatLayout, shared: int, view: memoryview) -> bool:
        """Write a whole step from the flusher's shared buffer ``shared`` there; if the
        flusher died meanwhile, write the reserved range again here. False: not sent."""
        fl, txn = self._sink.flusher, self._txn
        if fl is None or fl.dead or self._encoded:
            return False
        start = txn.reserve_flat(layout, lambda s: FlatImage(layout, s, None).nbytes)
        path = txn.zip.local_path  # (the reserve opened it)
        if path is None:  # not a local file (an object store): written here
            txn.put_flat(layout, view, None, start=start)
            return True
        try:
            crcs, directory, _ = fl.write(shared, layout, start, path, None)
        except StorageError:
            if not fl.dead:
                raise  # the write itself failed (the disk): the step fails
            txn.put_flat(layout, view, None, start=start)  # the child died mid-write
            return True
        im = FlatImage(layout, start, None)
        txn.complete_flat(layout, im.offsets, im.sizes, crcs, directory, None)
        return True

    def put_object(self, name: str, obj: object) -> None:
        self._open("store an object")
        try:
            self._txn.put_object(name, obj)
        except BaseException as e:
            self._failed = e
            raise

    def commit(self, metrics: Mapping[str, Metric] | None = None) -> CommitHeader | None:
        with self._lock:
            self._open("commit")
            if self._failed is not None:
                raise CaptureError(
                    f"step {self.step} failed before its commit ({self._failed!r}): abort it"
                ) from self._failed
            layout = self._layout
            if layout is not None and self._written < len(layout.chunks):
                raise SegmentError(
                    f"step {self.step} has {len(layout.chunks) - self._written} chunks of its "
                    "layout unwritten: write the remaining segments, or abort the step"
                )
            self._state = "committing"
        try:
            got = self._txn.commit(metrics)
        except BaseException as e:
            self._failed, self._state = e, "open"
            raise
        self._state = "committed"
        return got if isinstance(got, CommitHeader) else None

    def abort(self) -> None:
        with self._lock:
            if self._state == "committed":
                return
            self._state = "aborted"
        self._txn.abort()
