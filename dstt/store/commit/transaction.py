"""One step on its way to a commit: its chunks, objects, metrics and the two files it fills.

A ``Transaction`` belongs to the ``Writer`` (``writer.py``) that began it and holds a fresh slot:
the zip of Zarr chunks and the side file of objects and deltas (``format/stepfile.py``), which
no commit references yet. Chunks arrive one at a time (``put_chunk``; staged and encoded at
commit as one flat step when the writer encodes: one codec) or a whole step at once
(``put_flat``/``put_flat_chunks``; ``put_flat`` in two halves when the flusher process writes
the bytes); ``commit``/``prepare`` hand it back to the writer, which alone makes it visible.
Kept apart from the writer: the writer decides *when* and in which order things become
durable, the transaction only *what* a step holds (its columns: a ``StepTable``,
``step_table.py``). It sees the writer through ``StepOwner``, the narrow protocol below
(rejected: typing against ``Writer`` under ``TYPE_CHECKING``, a cycle between the modules).
"""

from __future__ import annotations

import struct
import threading
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dstt.errors import DsttError
from dstt.store.codec.delta import DeltaEncoder, EncodeStats
from dstt.store.codec.flatdelta import FlatShadow, seed_shadow
from dstt.store.codec.predict import Prediction
from dstt.store.format.envelope import checksum
from dstt.store.format.flat import ArraySpec, FlatImage, FlatLayout, StepBytes, byte_view
from dstt.store.format.layout import ChunkPlan, side_file_key, step_file_key, zarr_chunk_key
from dstt.store.format.objects import Encoded, Encoding, encode_object
from dstt.store.format.records import ChunkRecord, CommitHeader, Metric, ObjectRecord
from dstt.store.format.stepfile import SideFile, StepFile
from dstt.store.format.zipfmt import crc32

from .flat_encode import write_encoded
from .job import Deferred, encode_deferred
from .step_table import Columns, EncodedColumns, StepTable

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from dstt.store.format.manifest import TableTemplate
    from dstt.store.format.parts import Part
    from dstt.store.storage.base import Storage

__all__ = ["StepOwner", "Transaction"]

_ZERO = bytes(1 << 16)  # padding of edge chunks, written from here
_PACK = struct.Struct("<I").pack


class StepOwner(Protocol):
    """What a transaction needs of the writer that began it (``writer.py``'s ``Writer``)."""

    @property
    def storage(self) -> Storage: ...

    @property
    def file_tag(self) -> str: ...  # suffix of its step files ("" or a rank's)

    @property
    def encoder(self) -> DeltaEncoder | None: ...

    @property
    def dims(self) -> Mapping[str, tuple[str, ...] | None]: ...  # dimension names by path

    def declare(
        self, path: str, dtype: str, shape: tuple[int, ...], dims: Sequence[str] | None = None
    ) -> ChunkPlan: ...

    def flat_layout(
        self,
        arrays: Sequence[ArraySpec],
    ) -> FlatLayout: ...

    def table_template(
        self, layout: FlatLayout, sizes: Sequence[int] | None = None
    ) -> TableTemplate: ...

    def commit_step(
        self, txn: Transaction, metrics: Mapping[str, Metric], parts: Sequence[Part] = ()
    ) -> CommitHeader: ...

    def prepare_step(
        self,
        txn: Transaction,
        *,
        rank: int,
        world: int,
        session: str,
        metrics: Mapping[str, Metric],
    ) -> Part: ...

    def release_slot(self, slot: int) -> None: ...  # an aborted step's slot stays unused


class Transaction:
    """The chunks, objects and metrics of one step on its way to a commit."""

    def __init__(self, writer: StepOwner, slot: int, step: int, timeline: str) -> None:
        self.writer, self.slot, self.step, self.timeline = writer, slot, step, timeline
        self.objects: dict[str, ObjectRecord] = {}
        #: the flat shadow this step leaves (``codec/flatdelta.py``), once written
        self.flat_pending: FlatShadow | None = None
        #: objects stored at commit (``defer_object``), in the order they came
        self.deferred: list[Deferred] = []
        self._deferred_names: set[str] = set()
        self.deferred_stored = False  # ``write_deferred`` stored them already (here)
        self.zip = StepFile(writer.storage, step_file_key(slot, writer.file_tag))
        self.side = SideFile(writer.storage, side_file_key(slot, writer.file_tag))
        #: what this step holds, as columns (guarded by ``_lock``), and its arrays table
        self.columns = StepTable(step, slot, self.zip.key, writer.dims, writer.table_template)
        self._lock = threading.Lock()
        self.state = "open"
        self._object_bytes = 0
        #: set False to write this step raw (e.g. when the encoder cannot keep up)
        self.encode = True
        #: set True to write this step whole on request: plain Zarr chunks, new chains
        self.keyframe = False
        self.stats = EncodeStats()
        #: chunks ``put_chunk`` staged for the encoder: path -> (its bytes, chunks put)
        self._staged: dict[str, tuple[np.ndarray, set[int]]] = {}
        self._predictions: dict[str, Prediction] = {}
        #: slots of steps in flight this step's deltas are based on (``inflight_bases``)
        self.deps: set[int] = set()
        #: the header's time, fixed at the first commit attempt (a retry writes the same
        #: bytes); ``ran_here``: an attempt wrote through this process's file handles
        self.commit_time: float | None = None
        self.ran_here = False

    @property
    def bytes_written(self) -> int:
        """Bytes this step wrote so far (after dedup and deltas), objects included."""
        return self.stats.written_bytes + self._object_bytes

    def _check(self) -> None:
        if self.state != "open":
            raise DsttError(f"transaction for step {self.step} is already {self.state}")

    def declare(
        self, path: str, dtype: str, shape: tuple[int, ...], dims: Sequence[str] | None = None
    ) -> ChunkPlan:
        """Announce a tensor of this step (``dims``: its dimension names, for ``zarr.json``);
        returns how to cut it into chunks."""
        self._check()
        plan = self.writer.declare(path, dtype, tuple(shape), dims)
        with self._lock:
            self.columns.declare(path, dtype, plan)
        return plan

    def predict(self, predictions: Mapping[str, Prediction]) -> None:
        """Arrays of this step to encode as predictions (``predict.py``) when the writer
        encodes; write each prediction's ``"cur"`` inputs before the arrays that use them."""
        self._check()
        for path, pred in predictions.items():
            if not isinstance(pred, Prediction):
                raise TypeError(f"predictions[{path!r}] must be a Prediction, not {pred!r}")
        with self._lock:
            self._predictions.update(predictions)

    def put_chunk(self, path: str, index: int, data: StepBytes) -> ChunkRecord | None:
        """Write chunk ``index`` of ``path`` (its exact byte range); thread-safe. Returns its
        record — or None when the writer encodes: the chunk is then staged (copied) and the
        step encoded at commit as one flat step of its arrays, by the one codec
        (``codec/flatdelta.py``; predictions need no order of writes then)."""
        self._check()
        try:
            _, plan = self.columns.plans[path]
        except KeyError:
            raise ValueError(f"array {path!r} was not declared in step {self.step}") from None
        start, stop = plan.byte_range(index)
        view = byte_view(data)
        if len(view) != stop - start:
            raise ValueError(
                f"chunk {index} of {path!r} needs {stop - start} bytes, got {len(view)}"
            )
        if self.writer.encoder is None:
            return self._put_raw(path, index, plan, view)
        with self._lock:
            staged = self._staged.get(path)
            if staged is None:
                staged = self._staged[path] = (np.empty(plan.nbytes, np.uint8), set())
        staged[0][start:stop] = np.frombuffer(view, np.uint8)
        with self._lock:
            staged[1].add(index)
        return None

    def _put_raw(self, path: str, index: int, plan: ChunkPlan, view: memoryview) -> ChunkRecord:
        """Chunk ``index`` of ``path`` as a plain Zarr chunk in this step's zip."""
        crc = checksum(view)
        pad = plan.chunk_nbytes - len(view)
        pads: list[Any] = []
        while pad > 0:  # zarr stores edge chunks full size
            z = memoryview(_ZERO)[: min(pad, len(_ZERO))]
            pads.append(z)
            crc = checksum(z, crc)
            pad -= len(z)
        trailer = struct.pack("<I", crc)
        zcrc = crc32(view)
        for z in pads:
            zcrc = crc32(z, zcrc)
        zcrc = crc32(trailer, zcrc)
        size = plan.chunk_nbytes + 4
        offset = self.zip.add(
            zarr_chunk_key(path, plan.index(index)), [view, *pads, trailer], size, zcrc
        )
        rec = ChunkRecord(self.zip.key, size, crc, offset=offset)
        self.stats.add_many(len(view), rec.nbytes, keyframes=1)
        with self._lock:
            self.columns.chunks[path][index] = rec
        return rec

    def _write_staged(self) -> None:
        """The chunks ``put_chunk`` staged, written as one flat step of the arrays they
        complete (``put_flat_chunks``: encoded, or raw when the step is); an array missing
        chunks keeps its chunks one by one, raw (the commit then refuses the step)."""
        with self._lock:
            staged, self._staged = self._staged, {}
            if not staged:  # a flat step: nothing staged, no per-array work at its commit
                return
            plans = self.columns.plans
            whole = [
                p
                for p, (_, plan) in plans.items()
                if len(staged[p][1] if p in staged else ()) == plan.n_chunks
            ]
        enc = self.writer.encoder
        assert enc is not None
        dims = self.writer.dims
        specs = tuple((p, plans[p][0], plans[p][1].shape, dims.get(p)) for p in whole)
        layout = enc.layout(specs, self.writer.flat_layout)
        buf = np.zeros(layout.nbytes, np.uint8)
        for a in layout.arrays:
            if a.nbytes:
                buf[a.offset : a.offset + a.nbytes] = staged[a.path][0]
        with self._lock:
            for p in whole:
                del self.columns.plans[p], self.columns.chunks[p]
        self._put_flat_chunks(layout, byte_view(buf))
        for p, (data, done) in staged.items():
            if p not in layout.plans:
                plan = plans[p][1]
                for i in sorted(done):
                    self._put_raw(p, i, plan, byte_view(data)[slice(*plan.byte_range(i))])

    def put_flat(
        self,
        layout: FlatLayout,
        buf: StepBytes,
        images: dict[int, FlatImage] | None = None,
        *,
        start: int | None = None,
    ) -> None:
        """Write every tensor of ``layout`` from the flat buffer ``buf`` (``flat.py``), raw:
        the hot path of the engine. ``images``: a cache of this buffer's ``FlatImage`` by
        start offset, kept by the caller with the buffer (headers are then built once).
        ``start``: the range ``reserve_flat`` already reserved for it (a write the flusher
        process did not finish, done again here)."""
        view = byte_view(buf)
        if len(view) < layout.nbytes:
            raise ValueError(f"flat buffer of {len(view)} bytes, layout needs {layout.nbytes}")
        if start is None:
            self._check_raw()
        self._write_flat(layout, view, images, start)

    def _write_flat(
        self,
        layout: FlatLayout,
        view: memoryview,
        images: dict[int, FlatImage] | None,
        start: int | None,
    ) -> None:
        cache = images if images is not None else {}

        def image_at(start: int) -> FlatImage:
            im = cache.get(start)
            if im is None or im.layout is not layout:
                im = cache[start] = FlatImage(layout, start, view)
            return im

        if start is None:
            start = self._reserve_flat(layout, lambda s: image_at(s).nbytes)
        image = image_at(start)
        crcs, _ = image.fill()
        self.zip.write_at(start, image.iov)
        self.complete_flat(layout, image.offsets, image.sizes, crcs, bytes(image.directory), view)

    def put_flat_chunks(self, layout: FlatLayout, buf: StepBytes) -> None:
        """Write every tensor of ``layout`` from the flat buffer ``buf``, delta-encoded,
        deduplicated or predicted when the writer encodes (``codec/flatdelta.py``) — a step
        the engine captured with one batched copy but the writer encodes."""
        self._check()
        view = byte_view(buf)
        if len(view) < layout.nbytes:
            raise ValueError(f"flat buffer of {len(view)} bytes, layout needs {layout.nbytes}")
        self._put_flat_chunks(layout, view)

    def _put_flat_chunks(self, layout: FlatLayout, view: memoryview) -> None:
        enc = self.writer.encoder
        if not layout.chunks:  # nothing to write: its (empty) arrays declared
            with self._lock:
                for path in self.columns.declare_layout(layout):
                    self.columns.chunks[path] = []
            return
        room = enc is not None and enc.flat_room(layout.nbytes, layout)
        if enc is not None and room and self.encode and not self.keyframe:
            self._write_encoded(enc, layout, view)
            return
        # raw, whole: with room, its copy becomes the next step's flat base
        fallback = self.stats.raw_fallback
        self._write_flat(layout, view, None, None)
        if enc is not None and not room:  # past the shadow budget: a keyframe, not a fallback
            self.stats.raw_fallback = fallback

    def _write_encoded(self, enc: DeltaEncoder, layout: FlatLayout, view: memoryview) -> None:
        """An encoded flat step, written by ``flat_encode.py``; its columns recorded here and
        its flat shadow left as the next step's base."""
        got = write_encoded(
            enc, self.zip, self.side, layout, view, self.slot, self.timeline, self._predictions
        )
        if got is None:  # nothing to encode against: a keyframe, written whole
            self._write_flat(layout, view, None, None)
            self.stats.raw_fallback = False
            return
        self._record_flat(layout, got.cols, (got.keys, got.codecs))
        self.stats.add_many(
            layout.raw_nbytes,
            got.written,
            keyframes=got.keyframes,
            deltas=got.deltas,
            dedups=got.dedups,
        )
        if got.dep is not None:
            with self._lock:
                self.deps.add(got.dep)
        self.flat_pending = self._flat_shadow(
            layout,
            view,
            got.keys,
            *got.cols,
            raw_crcs=got.raw_crcs,
            depth=got.depth,
            codecs=got.codecs,
        )

    def reserve_flat(self, layout: FlatLayout, nbytes_at: Callable[[int], int]) -> int:
        """First half of a flat write done elsewhere (the flusher process): declare the
        layout's arrays in this step and reserve their zip range; returns its start."""
        self._check_raw()
        return self._reserve_flat(layout, nbytes_at)

    def _check_raw(self) -> None:
        self._check()
        enc = self.writer.encoder
        if enc is not None and self.encode and not self.keyframe:
            raise DsttError(
                "a flat write is raw; set txn.encode = False (or keyframe) "
                "when the writer encodes, or use put_flat_chunks"
            )

    def _reserve_flat(self, layout: FlatLayout, nbytes_at: Callable[[int], int]) -> int:
        with self._lock:
            self.columns.declare_layout(layout)
        return self.zip.reserve(layout.names, nbytes_at)

    def complete_flat(
        self,
        layout: FlatLayout,
        offsets: list[int],
        sizes: list[int],
        crcs: list[int],
        directory: bytes,
        buf: StepBytes | None = None,
    ) -> None:
        """Second half: the chunks are written; record where (columns) and their zip
        central directory records. ``buf``: the flat buffer, for a writer that encodes (a
        raw step still seeds the next step's deltas: its chunks become their bases)."""
        self.zip.add_directory(directory, len(offsets))
        self._record_flat(layout, (offsets, sizes, crcs), None)
        self.stats.add_many(layout.raw_nbytes, sum(sizes), keyframes=len(sizes))
        enc = self.writer.encoder
        if enc is not None:
            self.stats.raw_fallback = not self.keyframe
            if buf is not None:  # its chunks become the next step's bases: one copy
                self.flat_pending = self._flat_shadow(
                    layout, byte_view(buf), [self.zip.key] * len(offsets), offsets, sizes, crcs
                )

    def _flat_shadow(
        self,
        layout: FlatLayout,
        view: memoryview,
        files: list[str],
        offsets: Sequence[int],
        sizes: Sequence[int],
        crcs: Sequence[int],
        **encoded: Any,
    ) -> FlatShadow | None:
        enc = self.writer.encoder
        if enc is None or not enc.flat_room(layout.nbytes, layout):
            return None
        data = enc.flat_copy(np.frombuffer(view[: layout.nbytes], dtype=np.uint8))
        return seed_shadow(
            layout,
            self.timeline,
            self.slot,
            data,
            np.asarray(files, dtype=object),
            offsets,
            sizes,
            crcs,
            **encoded,
        )

    def _record_flat(
        self, layout: FlatLayout, cols: Columns, encoded: EncodedColumns | None
    ) -> None:
        with self._lock:
            self.columns.record_flat(layout, cols, encoded)

    def put_object(self, name: str, obj: object, *, encoding: Encoding = "json") -> ObjectRecord:
        """Store a Python object for this step (tagged JSON unless told otherwise; an
        ``Encoded`` value as its bytes, in its own encoding)."""
        self._check()
        if isinstance(obj, Encoded):
            return self._put_object_bytes(name, obj.data, obj.encoding)
        return self._put_object_bytes(name, encode_object(obj, encoding), encoding)

    def defer_object(
        self, name: str, obj: object, *, encoding: Encoding = "json", or_pickle: bool = False
    ) -> None:
        """Store ``obj`` as ``name`` when the step commits (encoded then, by whoever
        commits: this process or the flusher's, ``commit/job.py``); ``or_pickle``: with
        pickle where JSON cannot hold it (the header's record then says ``"pickle"``)."""
        self._check()
        with self._lock:
            if name in self.objects or name in self._deferred_names:
                raise ValueError(f"object {name!r} stored twice in step {self.step}")
            self._deferred_names.add(name)
            self.deferred.append(Deferred(name, obj, encoding, or_pickle))

    def count_objects(self, header: CommitHeader) -> None:
        """Count the deferred objects' bytes, now that the commit stored them."""
        if self.deferred_stored:
            return  # counted as they were stored
        n = sum(header.objects[d.name].nbytes for d in self.deferred if d.name in header.objects)
        with self._lock:
            self._object_bytes += n

    def write_deferred(self) -> None:
        """Store the deferred objects now, here (a part's vote, a merged commit: their
        records must be known before the commit). ``deferred`` keeps listing them."""
        with self._lock:
            if self.deferred_stored:
                return
            self.deferred_stored = True
        for d in self.deferred:
            data, encoding = encode_deferred(d)
            self._put_object_bytes(d.name, data, encoding, deferred=True)  # type: ignore[arg-type]

    def _put_object_bytes(
        self, name: str, data: bytes, encoding: Encoding, *, deferred: bool = False
    ) -> ObjectRecord:
        """``deferred``: storing an object ``defer_object`` took (its name is known)."""
        with self._lock:
            if name in self.objects or (name in self._deferred_names and not deferred):
                raise ValueError(f"object {name!r} stored twice in step {self.step}")
            # reserved before writing: two threads storing one name would both write
            self.objects[name] = ObjectRecord("", 0, 0, encoding)
        try:
            offset = self.side.append(data)
        except BaseException:
            with self._lock:
                del self.objects[name]
            raise
        rec = ObjectRecord(self.side.key, len(data), checksum(data), encoding, offset)
        with self._lock:
            self.objects[name] = rec
            self._object_bytes += len(data)
        return rec

    def commit(
        self, metrics: Mapping[str, Metric] | None = None, *, parts: Sequence[Part] = ()
    ) -> CommitHeader:
        """Make the step durable and visible; returns its header. ``parts``: the other ranks'
        prepared parts of this slot, merged into this commit (``parts.collect_parts``)."""
        self._check()
        self._seal()
        self.state = "committing"
        try:
            header = self.writer.commit_step(self, metrics or {}, parts)
        except BaseException:
            self.state = "failed"
            raise
        self.state = "committed"
        return header

    def _seal(self) -> None:
        """Write what ``put_chunk`` staged; a failure here fails the commit for good (the
        step's files were written here: a retry could not tell what they hold)."""
        try:
            self._write_staged()
        except BaseException:
            self.state, self.ran_here = "failed", True
            raise

    @property
    def retryable(self) -> bool:
        """A failed commit that ran in another process (the flusher's), leaving this
        process's view of the files as it was: ``reopen`` may run it again."""
        return self.state == "failed" and not self.ran_here

    def reopen(self) -> None:
        """Let a failed ``commit`` run again (after room was made on a full disk). The
        retry writes the same job — the same time, so the same bytes at the same places —
        so whatever the failed attempt left is written over or, published already,
        recognised as the same file (``LocalStorage.adopt_blob``)."""
        if not self.retryable:
            raise DsttError(
                f"the commit of step {self.step} cannot be tried again ({self.state}"
                f"{', written here' if self.ran_here else ''})"
            )
        self.state = "open"

    def prepare(
        self, *, rank: int, world: int, session: str, metrics: Mapping[str, Metric] | None = None
    ) -> Part:
        """Part writers: make this rank's chunks and objects durable, then write its part
        manifest (the "prepared" vote the exclusive writer waits for). Returns the part."""
        self._check()
        self._seal()
        self.state = "committing"
        try:
            part = self.writer.prepare_step(
                self, rank=rank, world=world, session=session, metrics=metrics or {}
            )
        except BaseException:
            self.state = "failed"
            raise
        self.state = "prepared"
        return part

    def abort(self) -> None:
        """Drop the step; its slot stays unused (gc removes stray step files)."""
        if self.state in ("open", "failed"):
            self.state = "aborted"
            self.writer.release_slot(self.slot)
            self.zip.discard()  # unpublished files vanish; published ones are gc's garbage
            self.side.discard()
            with self._lock:
                self._staged.clear()
            if self.writer.encoder is not None:
                self.writer.encoder.discard(self.slot)
