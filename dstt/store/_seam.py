"""The narrow seam the engine writes steps through: ``StepSink`` → ``StepHandle``. Per step
(several in flight, a handle each; failure semantics: ``StepHandle``)::

    layout = sink.layout(arrays)           # once per set of arrays, reused while they hold
    ring = sink.buffers(nbytes, count)     # once: shared memory the sink writes from, or None
    h = sink.begin(step)                   # a fresh slot; nothing visible
    h.write(FlatSegment(layout, 0, buf))   # the step's bytes, in byte order, any pieces
    h.put_object("rng", state)             # before the commit; stored with it
    header = h.commit(metrics)             # visible now (None: a share another commits)
    # or, on a failure before the commit returned: h.abort(); at the end: sink.close()

``TransactionSink`` adapts the writers, owns the flusher. Rejected: the engine driving both."""

from __future__ import annotations

import bisect
import os
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from dstt.analysis.summary_kernel import digest
from dstt.errors import CaptureError, ConfigError, SegmentError, StorageError

from .flusher.parent import Flusher
from .format.flat import FlatImage, FlatLayout, StepBytes, byte_view
from .format.records import CommitHeader
from .protocols import FlatStepWriter, OffloadingWriter, StepTransaction

if TYPE_CHECKING:
    import mmap
    from collections.abc import Callable, Mapping, Sequence

    from dstt.analysis.summary_kernel import DigestPlan

    from .codec.predict import Prediction
    from .format.records import Metric
    from .protocols import ArraySpec

__all__ = [
    "Digest",
    "FlatSegment",
    "SharedBuffers",
    "StepHandle",
    "StepSink",
    "StepStats",
    "TransactionSink",
]


@dataclass(frozen=True)
class Digest:
    """A whole step's write-time digest (``summary_kernel.digest``), taken by whoever
    writes its bytes: the flusher process (off this process's GIL) or this thread. Digests
    run in ``token`` order: ``turn`` waits for the earlier ones, ``sent`` releases the next."""

    plan: DigestPlan
    token: int
    turn: Callable[[], None]
    sent: Callable[[], None]


@dataclass(frozen=True)
class FlatSegment:
    """Bytes ``[start, start + len(data))`` of a step laid out by ``layout``: whole chunks
    (a cut inside an array falls between its chunks, ``layout.chunks``). ``shared``: the
    index of the sink's shared buffer holding ``data`` (a whole step only), so the flusher
    process writes it. A writable ``data`` of a framed layout (``flat.py``) gets the zip
    framing written into it (a read-only one is copied). ``digest``: a whole step's."""

    layout: FlatLayout
    start: int
    data: StepBytes
    shared: int | None = None
    digest: Digest | None = None


@dataclass(frozen=True)
class SharedBuffers:
    """Step buffers the sink's writer process shares (``FlatSegment.shared`` = an index);
    ``urgent(True)`` while the caller waits for a free one, ``urgent(False)`` once it does not."""

    buffers: list[mmap.mmap]
    urgent: Callable[[bool], None]


@dataclass(frozen=True)
class StepStats:
    """What a step's writes cost so far (bytes after deltas and dedup, objects included)."""

    written_bytes: int
    keyframes: int
    deltas: int
    dedups: int
    raw_fallback: bool


@runtime_checkable
class StepHandle(Protocol):
    """One step on its way to a commit (the call order: the module docstring).

    Failure semantics: a refused segment (out of order, overlapping, splitting a chunk,
    another layout) raises ``SegmentError`` and writes nothing; the handle stays open. Any
    other error in ``write`` or ``put_object`` fails the handle: ``commit`` then raises
    ``CaptureError`` and the caller aborts. A step is visible only once ``commit`` returned;
    it commits whole or not at all (a commit with chunks of its layout unwritten raises
    ``SegmentError``); a commit that raised is aborted by the caller, or run again at once
    where the store can and ``retry(error)`` says so (a full disk the caller made room on).
    ``abort`` is idempotent and a no-op after a commit, so ``finally: h.abort()`` is safe.
    A flusher that dies mid-step costs nothing: its write or commit is done again here.
    """

    @property
    def step(self) -> int: ...

    @property
    def stats(self) -> StepStats: ...

    def write(self, segment: FlatSegment) -> Mapping[str, object] | None:
        """Write ``segment``; returns its digest's columns where it asked for one."""
        ...

    def put_object(self, name: str, obj: object) -> None: ...

    def commit(
        self,
        metrics: Mapping[str, Metric] | None = None,
        *,
        retry: Callable[[BaseException], bool] | None = None,
    ) -> CommitHeader | None: ...

    def abort(self) -> None: ...


@runtime_checkable
class StepSink(Protocol):
    """Where steps go: lays out a step's arrays, lends shared buffers, begins handles."""

    def layout(self, arrays: Sequence[ArraySpec]) -> FlatLayout: ...

    def buffers(self, nbytes: int, count: int) -> SharedBuffers | None: ...

    def begin(
        self,
        step: int,
        *,
        encode: bool = True,
        keyframe: bool = False,
        predictions: Mapping[str, Prediction] | None = None,
    ) -> StepHandle: ...

    def close(self) -> None: ...


#: seconds after a sink's first step before its flusher process starts (env
#: ``DSTT_FLUSHER_START_S``): the child's start takes ~0.1-0.2 s of CPU, most of a short
#: run's fixed cost on a machine whose cores train, and a run shorter than this gains
#: nothing from it (docs/performance.md, "A session's fixed start and close")
FLUSHER_START_S = 1.0
#: a ring of step buffers this large starts its flusher at once: written here, a step of
#: 100 MB took 0.4-0.8 s of this process's CPU, against ~0.1 s in the child (measured)
FLUSHER_AT_ONCE_BYTES = 16 << 20


def flusher_start_s() -> float:
    """``FLUSHER_START_S``, or ``DSTT_FLUSHER_START_S`` where set (0: at once)."""
    raw = os.environ.get("DSTT_FLUSHER_START_S")
    if raw is None:
        return FLUSHER_START_S
    try:
        return max(0.0, float(raw))
    except ValueError:
        raise ConfigError(
            f"DSTT_FLUSHER_START_S must be a number of seconds, got {raw!r}"
        ) from None


class TransactionSink:
    """``StepSink`` over a ``StepWriter``. ``flusher``: a flusher process to write shared
    buffers (and, where the writer offloads, commit); ``start_flusher``: start one sized
    to the caller's ring at ``buffers``. Where it cannot start or dies, steps are written
    from the callers' threads (warned once; a write it died in is done again here)."""

    def __init__(
        self,
        writer: FlatStepWriter,
        flusher: Flusher | None = None,
        *,
        start_flusher: bool = False,
    ) -> None:
        self.writer, self.flusher = writer, flusher
        self._start, self._own, self._lost = start_flusher, False, False
        self._start_after = flusher_start_s() if start_flusher else 0.0
        self._encodes = writer.encoder is not None
        self._mu = threading.Lock()
        #: each layout's chunk starts, by id (segments are cut by bisecting them)
        self._starts: dict[int, tuple[FlatLayout, list[int]]] = {}
        #: zip images by (layout, start) without a buffer, and per buffer by start
        self._sizes: dict[tuple[int, int], FlatImage] = {}
        self._images: dict[tuple[int, int], dict[int, FlatImage]] = {}
        #: each caller's view seen so far, by id: its memory's key in ``_images`` (a ring
        #: hands the same view of a buffer every step; its address is found once)
        self._keys: dict[int, tuple[memoryview, tuple[int, int]]] = {}
        if flusher is not None:
            self._attach(flusher)

    def _attach(self, fl: Flusher) -> None:
        self.flusher = fl
        # its commits there too: their Python off this process's GIL (DSTT_FLUSHER_COMMIT=0:
        # commit in this process, e.g. to compare)
        if (
            isinstance(self.writer, OffloadingWriter)
            and os.environ.get("DSTT_FLUSHER_COMMIT", "1") != "0"
        ):
            self.writer.committer = fl

    def layout(self, arrays: Sequence[ArraySpec]) -> FlatLayout:
        return self.writer.flat_layout(arrays)

    def buffers(self, nbytes: int, count: int) -> SharedBuffers | None:
        if self.flusher is None and self._start:
            self._start = False
            try:
                # not waiting for the child's start: until it is ready, the handle
                # serves the writes here; started only after FLUSHER_START_S, so a short
                # run never pays for its interpreter and imports
                # a large step costs more to write here than the child's start: at once
                after = 0.0 if nbytes >= FLUSHER_AT_ONCE_BYTES else self._start_after
                self._attach(Flusher(nbytes, count, wait=False, start_after=after))
                self._own = True
            except (OSError, StorageError) as e:  # no memfd, no fork: writer threads
                warnings.warn(
                    f"dstt: writing from threads, the flusher process could not start ({e})",
                    RuntimeWarning,
                    stacklevel=3,
                )
        fl = self.live()
        if fl is None or fl.nbytes < nbytes or fl.count < count:
            return None
        return SharedBuffers(fl.buffers[:count], fl.urgent)

    def live(self) -> Flusher | None:
        """The flusher while it runs (None: write here; its death is warned about once)."""
        fl = self.flusher
        if fl is None or not fl.dead:
            return fl
        with self._mu:
            first, self._lost = not self._lost, True
        if first:
            warnings.warn(
                "dstt: the flusher process died; steps are written from threads "
                "from now on (no step was lost)",
                RuntimeWarning,
                stacklevel=4,
            )
        return None

    def close(self) -> None:
        fl = self.flusher
        if fl is None:
            return
        w = self.writer
        if isinstance(w, OffloadingWriter) and w.committer is fl:
            w.committer = None
        self._images.clear()
        self._keys.clear()
        if self._own:
            fl.close()

    def starts(self, layout: FlatLayout) -> list[int]:
        """Where each chunk of ``layout`` starts (built once per layout)."""
        hit = self._starts.get(id(layout))
        if hit is None or hit[0] is not layout:
            if len(self._starts) > 16:
                self._starts.clear()
            hit = self._starts[id(layout)] = (layout, [c[2] for c in layout.chunks])
        return hit[1]

    def image(self, layout: FlatLayout, start: int) -> FlatImage:
        """Where the entries of ``layout`` land when placed at ``start`` (no buffer)."""
        key = (id(layout), start)
        im = self._sizes.get(key)
        if im is None or im.layout is not layout:
            if len(self._sizes) > 16:
                self._sizes.clear()
            im = self._sizes[key] = FlatImage(layout, start, None)
        return im

    def images(self, view: memoryview) -> dict[int, FlatImage] | None:
        """The zip images bound to the buffer ``view`` by start (headers built once per
        buffer of a ring); None for a read-only one (a caller's bytes, not a ring's)."""
        if view.readonly:
            return None
        hit = self._keys.get(id(view))
        if hit is not None and hit[0] is view:  # (the view is kept: its id is not reused)
            key = hit[1]
        else:
            key = (int(np.frombuffer(view, np.uint8).ctypes.data), len(view))
            if len(self._keys) > 16:
                self._keys.clear()
            self._keys[id(view)] = (view, key)
        got = self._images.get(key)
        if got is None:
            if len(self._images) > 16:
                self._images.clear()
            got = self._images[key] = {}
        return got

    def begin(
        self,
        step: int,
        *,
        encode: bool = True,
        keyframe: bool = False,
        predictions: Mapping[str, Prediction] | None = None,
    ) -> _Handle:
        txn = self.writer.begin(step)
        txn.encode, txn.keyframe = encode, keyframe
        if predictions and self._encodes:
            txn.predict(predictions)
        return _Handle(self, txn, encode and self._encodes and not keyframe, keyframe)


class _Handle:
    """A ``StepHandle`` over one ``StepTransaction``."""

    def __init__(
        self, sink: TransactionSink, txn: StepTransaction, encoded: bool, keyframe: bool
    ) -> None:
        self._sink, self._txn, self._encoded, self._keyframe = sink, txn, encoded, keyframe
        self._lock = threading.Lock()
        self._layout: FlatLayout | None = None
        self._end = 0  # bytes of the layout written so far (segments come in order)
        self._written = 0  # chunks of the layout written so far
        self._failed: BaseException | None = None
        self._state = "open"

    @property
    def step(self) -> int:
        return self._txn.step

    @property
    def stats(self) -> StepStats:
        st = self._txn.stats
        return StepStats(
            self._txn.bytes_written, st.keyframes, st.deltas, st.dedups, st.raw_fallback
        )

    def _open(self, what: str) -> None:
        if self._state != "open":
            raise CaptureError(f"step {self.step} is {self._state}: cannot {what}")

    def write(self, segment: FlatSegment) -> Mapping[str, object] | None:
        try:
            return self._write(segment)
        except SegmentError:
            raise  # refused: nothing written, the step stays open
        except BaseException as e:
            if self._state == "open":
                self._failed = e
            raise

    def _write(self, segment: FlatSegment) -> Mapping[str, object] | None:
        with self._lock:
            self._open("write a segment")
            layout, start = segment.layout, segment.start
            view = _bytes(segment.data)
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
        if whole:
            return self._whole(layout, view, segment.shared, segment.digest)
        arrays = layout.arrays
        for k, i, s, e, _, _ in layout.chunks[lo:hi]:
            self._txn.put_chunk(arrays[k].path, i, view[s - start : e - start])
        return None

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

    def _whole(
        self, layout: FlatLayout, view: memoryview, shared: int | None, d: Digest | None
    ) -> Mapping[str, object] | None:
        """A whole step: encoded here (its digest in the flusher, where the previous
        step's copy is); raw from a shared buffer by the flusher; else raw here."""
        sink, txn = self._sink, self._txn
        fl = sink.live() if shared is not None else None
        if self._encoded:
            txn.put_flat_chunks(layout, view)
            if d is not None and fl is not None:
                d.turn()
                try:
                    return fl.digest(shared, d.plan, d.token, d.sent)  # type: ignore[arg-type]
                except StorageError:
                    if not fl.dead:
                        raise
                    sink.live()  # (warns)
            return _digest_here(d, view)
        if fl is not None:
            start = txn.reserve_flat(layout, lambda s: sink.image(layout, s).nbytes)
            path = txn.zip.local_path  # (the reserve opened it)
            images = sink.images(view)
            if path is None:  # not a local file (an object store): written here
                txn.put_flat(layout, view, images, start=start)
                return _digest_here(d, view)
            if images is not None:  # the child writes the zip framing into this buffer:
                images.clear()  # written here later, its images bind it anew
            if d is not None:
                d.turn()
            try:
                crcs, directory, stats = fl.write(
                    shared,  # type: ignore[arg-type]
                    layout,
                    start,
                    path,
                    None if d is None else d.plan,
                    None if d is None else d.token,
                    None if d is None else d.sent,
                )
            except StorageError:
                if not fl.dead:
                    raise  # the write itself failed (the disk): the step fails
                sink.live()  # (warns) the child died, maybe mid-write: the range is
                txn.put_flat(layout, view, images, start=start)  # still ours, written here
                return _digest_here(d, view)
            im = sink.image(layout, start)
            # a keyframe starts the next deltas' chains (its chunks become their bases)
            txn.complete_flat(
                layout, im.offsets, im.sizes, crcs, directory, view if self._keyframe else None
            )
            return stats
        if layout.framed and view.readonly:  # the zip framing is written into the buffer
            view = memoryview(bytearray(view))
        txn.put_flat(layout, view, sink.images(view))
        return _digest_here(d, view)

    def put_object(self, name: str, obj: object) -> None:
        self._open("store an object")
        try:  # stored with the commit (by the flusher, where it commits)
            self._txn.defer_object(name, obj, or_pickle=True)
        except BaseException as e:
            self._failed = e
            raise

    def commit(
        self,
        metrics: Mapping[str, Metric] | None = None,
        *,
        retry: Callable[[BaseException], bool] | None = None,
    ) -> CommitHeader | None:
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
        while True:
            try:
                got = self._txn.commit(metrics)
                break
            except BaseException as e:
                if retry is not None and self._txn.retryable and retry(e):
                    self._txn.reopen()  # the same job again: the same bytes, places
                    continue
                with self._lock:
                    self._failed, self._state = e, "open"
                raise
        self._state = "committed"
        return got if isinstance(got, CommitHeader) else None

    def abort(self) -> None:
        with self._lock:
            if self._state in ("committed", "aborted"):
                return
            self._state = "aborted"
        self._txn.abort()


def _bytes(data: StepBytes) -> memoryview:
    """``byte_view(data)``; a view of bytes already (a ring's, kept per buffer) as it is, so
    ``TransactionSink.images`` finds it by identity rather than by its address each step."""
    if type(data) is memoryview and data.format == "B" and data.ndim == 1 and data.c_contiguous:
        return data
    return byte_view(data)


def _digest_here(d: Digest | None, view: memoryview) -> Mapping[str, object] | None:
    """``d`` taken in this thread, in its turn (None without one)."""
    if d is None:
        return None
    d.turn()
    try:
        return digest(d.plan, view, d.token)
    finally:
        d.sent()
