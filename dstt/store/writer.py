"""The single writer of a run and its transactions (one per committed step).

A ``Writer`` holds the run's lock for its lifetime and hands out ``Transaction`` objects. A
transaction owns a fresh *slot* and writes its step into two new files no commit references yet
(``stepfile.py``: the zip of Zarr chunks, and the side file of objects and deltas), so nothing
visible is ever overwritten. ``commit`` is the only place that makes a step visible, in this
order: arrays table (into the side file) → zip central directory → publish both files →
commit header → barrier (files and header durable together) → timeline ref (durable: the
commit point). A crash anywhere before the ref moves leaves garbage no reader looks at — at
worst a complete commit that simply is not the head (gc removes such orphans).

Several ranks can write one commit (``parts.py``): a writer opened with ``exclusive=False``
takes no lock, writes only its own arrays into slots it is told, and ``prepare``s a part
manifest instead of committing; the exclusive writer merges the parts in ``commit(parts=...)``.

The parent of a commit is resolved *at commit time* (the timeline's head then), so the engine
can stage step k+1 while step k is still flushing, and a step that fails and is skipped does not
break the chain. Rejected alternative: parent fixed at ``begin`` — a skipped step would leave
its successor pointing at a slot that never committed.
"""

from __future__ import annotations

import contextlib
import secrets
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import DsttError, SchemaError
from .codec.delta import DeltaEncoder, EncodeStats, Shadow
from .codec.predict import Prediction
from .codec.xor import DeltaPolicy
from .format.flat import FlatImage, FlatLayout
from .format.layout import (
    DEFAULT_CHUNK_BYTES,
    LOCK_KEY,
    WRITTEN_PREFIXES,
    ChunkPlan,
    array_meta_key,
    check_array_path,
    commit_key,
    group_meta_key,
    part_key,
    plan_chunks,
    ref_key,
    side_file_key,
    step_file_key,
    zarr_chunk_key,
)
from .format.manifest import (
    ArrayRecord,
    ChunkRecord,
    CommitHeader,
    Location,
    Metric,
    ObjectRecord,
    TableBuilder,
    checksum,
    dump_arrays,
    dump_header,
    dump_ref,
)
from .format.objects import Encoding, encode_object
from .format.stepfile import Block, SideFile, StepFile
from .format.zarr_meta import (
    array_document,
    consolidated_metadata,
    dtype_itemsize,
    dump,
    group_document,
    root_attributes,
    root_document_bytes,
)
from .format.zipfmt import crc32
from .index import EVERY, IndexWriter
from .maintenance import GcReport, gc
from .parts import Part, dump_part, merge_parts, remove_parts
from .retention import Retention

if TYPE_CHECKING:
    from .repository import Repository

__all__ = ["Transaction", "Writer"]

_ZERO = bytes(1 << 16)


class Writer:
    """Exclusive writer of one run; use as a context manager."""

    def __init__(self, repo: Repository, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 encoding: DeltaPolicy | None = None, exclusive: bool = True,
                 inflight_bases: bool = False, rank: int | None = None,
                 lazy_refs: bool = False, index_every: int = EVERY) -> None:
        """``inflight_bases``: a step may be encoded against the previous step before that
        one commits (for callers that overlap steps and commit them in order, like the
        engine); a step based on one that then fails to commit cannot commit either.
        ``rank``: names a part writer's files (``steps/<slot>.r00001.zip``).
        ``lazy_refs``: a commit moves the ref without syncing it; the next commit's barrier
        (or ``flush``/``close``) makes it durable. Visibility still implies durability (the
        ref is written only after the step's files and header are durable), but a power
        cut can lose the newest commit — never tear one. Two fewer syncs per commit: for
        per-iteration capture, where the next commit follows in a fraction of a second.
        ``index_every``: committed steps per new index segment (``index.py``)."""
        self.repo = repo
        self.storage = repo.storage
        self.chunk_bytes = chunk_bytes
        self.exclusive = exclusive
        self.lazy_refs = lazy_refs
        self._unsynced = False  # a lazily written ref awaits a barrier
        self._head_steps: dict[str, int] = {}  # timeline -> step of the head this writer made
        #: suffix of this writer's step files: empty for the committer, the rank (or a random
        #: id) for a part writer, so every rank's files of one slot have their own names
        self.file_tag = "" if exclusive else (f"r{rank:05d}" if rank is not None
                                              else secrets.token_hex(4))
        self.storage.check_writable(WRITTEN_PREFIXES)
        if exclusive:
            self._lock_cm: Any = self.storage.lock(LOCK_KEY)
            self._lock_cm.__enter__()
        elif encoding is not None:
            raise ValueError("a part writer (exclusive=False) cannot encode deltas: its bases "
                             "would not be known to be committed")
        else:
            self._lock_cm = None
        self._closed = False
        self._meta_lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self.index: IndexWriter | None = None
        try:
            self.reader = repo.reader()
            self._next_slot = self.reader.max_slot() + 1
            #: the index's rows of this writer's commits (and any tail a crash left)
            self.index = IndexWriter(self.reader, every=index_every) if exclusive else None
        except BaseException:  # a damaged run: release the lock now, not when gc collects us
            self.close()
            raise
        #: path -> (dtype, plan, zarr.json bytes): documents built once while shapes hold
        self._arrays: dict[str, tuple[str, ChunkPlan, bytes]] = {}
        #: path -> the dimension names its document carries (None: ``<name>_<i>``)
        self._dims: dict[str, tuple[str, ...] | None] = {}
        self._stored: dict[str, tuple[str, tuple[int, ...], int]] | None = None
        #: (paths, start) -> the groups' and arrays' documents, and their consolidated metadata
        self._meta_cache: dict[tuple[tuple[str, ...], int], tuple[Block, bytes]] = {}
        self._open: set[int] = set()
        self.encoder = DeltaEncoder(encoding) if encoding is not None else None
        self.inflight_bases = inflight_bases

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(index=exc[0] is None)  # leaving on an error: the next writer indexes

    def flush(self) -> None:
        """Make every commit so far durable (lazily written refs included)."""
        with self._commit_lock:
            if self._unsynced:
                self.storage.barrier()
                self._unsynced = False

    def close(self, *, index: bool = True) -> None:
        """Release the run; ``index``: write the session's pending index rows (if half a
        segment's worth, ``IndexWriter.close``)."""
        if not self._closed:
            try:
                if self._unsynced:
                    self.flush()
                if index and self.index is not None:  # the session's last rows
                    with contextlib.suppress(OSError), self._commit_lock:
                        self.index.close()
            finally:
                self._closed = True
                if self._lock_cm is not None:
                    self._lock_cm.__exit__(None, None, None)

    def _check_open(self) -> None:
        if self._closed:
            raise DsttError("this writer is closed; open a new one with repo.writer()")

    def gc(self, retention: Retention | None = None, *, dry_run: bool = False) -> GcReport:
        """gc under this writer (it holds the run's lock; a second one would be refused): a
        live session's background retention. Commits wait only while the tombstones and the
        index are written; the slots in flight are left alone (``maintenance.gc``)."""
        self._check_open()
        if not self.exclusive:
            raise DsttError("a part writer (exclusive=False) holds no lock and cannot gc")
        return gc(self.repo, retention=retention, dry_run=dry_run, writer=self)

    @property
    def next_slot(self) -> int:
        """The slot the next ``begin`` without ``slot=`` takes."""
        return self._next_slot

    def begin(self, step: int, *, timeline: str | None = None,
              slot: int | None = None) -> Transaction:
        """Start writing ``step`` into a fresh slot of ``timeline`` (default: current).

        ``slot`` picks the slot explicitly (multi-rank commits: every rank writes the same
        slot); it must not be below a slot this writer already handed out.
        """
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if not self.exclusive:  # the lock holder may have moved refs; we hold no lock
            self.reader.refresh()
        name = timeline or self.reader.current_timeline
        self.reader.ref(name)  # validates the timeline exists
        with self._meta_lock:
            if slot is None:
                slot = self._next_slot
            elif slot < self._next_slot and self.exclusive:
                raise ValueError(f"slot {slot} is already used (next free slot: "
                                 f"{self._next_slot})")
            self._next_slot = max(self._next_slot, slot + 1)
            self._open.add(slot)
        txn = Transaction(self, slot, step, name)
        if self.encoder is not None and self.inflight_bases:
            self.encoder.open(slot, name, txn._pending, txn.deps)
        return txn

    # -- metadata -------------------------------------------------------------------------
    def _stored_schema(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """dtype, shape and rows per chunk of every array at the head of the current
        timeline: a resuming session must match the first two and keeps the chunking."""
        if self._stored is None:
            head = self.reader.head()
            self._stored = {} if head is None or head.pruned else {
                p: (a.dtype, a.shape, a.rows) for p, a in self.reader.arrays(head).items()}
        return self._stored

    def declare(self, path: str, dtype: str, shape: tuple[int, ...],
                dims: Sequence[str] | None = None) -> ChunkPlan:
        """Announce an array (its ``zarr.json`` is built once while dtype, shape and
        ``dims``, the dimension names, hold)."""
        shape = tuple(int(s) for s in shape)
        names = None if dims is None else tuple(dims)
        with self._meta_lock:
            known = self._arrays.get(path)
            if (known is not None and known[0] == dtype and known[1].shape == shape
                    and self._dims.get(path) == names):
                return known[1]
            check_array_path(path)
            itemsize = dtype_itemsize(dtype)
            was = (known[0], known[1].shape, known[1].rows) if known is not None else \
                self._stored_schema().get(path)
            if was is not None and was[:2] != (dtype, shape):
                raise SchemaError(
                    f"array {path!r} is stored as {was[0]}{was[1]}, but this step has "
                    f"{dtype}{shape}; a tensor's dtype and shape must stay fixed within a run "
                    "(start a new run for a changed model)"
                )
            plan = (ChunkPlan(shape, itemsize, was[2]) if was is not None
                    else plan_chunks(shape, itemsize, self.chunk_bytes))
            doc = dump(array_document(path, dtype, plan, dims=names))
            if known is not None:  # a document changed: the prebuilt blocks hold the old one
                self._meta_cache.clear()
            self._arrays[path] = (dtype, plan, doc)
            self._dims[path] = names
            return plan

    def flat_layout(self, arrays: Sequence[tuple[str, str, tuple[int, ...]]
                                           | tuple[str, str, tuple[int, ...],
                                                   Sequence[str] | None]]) -> FlatLayout:
        """Declare ``arrays`` (path, dtype, shape[, dims]) for this writer and lay them out in
        one flat buffer (``flat.py``); reuse the result while the arrays do not change."""
        out = []
        for a in arrays:
            dims = a[3] if len(a) > 3 else None  # type: ignore[misc]
            out.append((a[0], a[1], self.declare(a[0], a[1], tuple(a[2]), dims), dims))
        return FlatLayout.build(out)

    def _metadata(self, txn: Transaction) -> None:
        """The zarr.json entries of a step file: every group, every array, then the root.
        The groups' and arrays' documents are one prebuilt ``Block`` per set of arrays and
        start offset — at every step of a steady run the same bytes at the same place."""
        paths = tuple(txn._plans)
        start = txn.zip.cursor
        with self._meta_lock:
            cached = self._meta_cache.get((paths, start))
            if cached is None:
                groups: set[str] = set()
                for path in paths:
                    parts = path.split("/")
                    groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
                gdoc = dump(group_document())
                docs = [(group_meta_key(g), gdoc) for g in sorted(groups)]
                docs += [(array_meta_key(p), self._arrays[p][2]) for p in paths]
                members = [(g, "group", gdoc) for g in sorted(groups)]
                members += [(p, "array", self._arrays[p][2]) for p in paths]
                cached = (Block(start, [k for k, _ in docs], [d for _, d in docs]),
                          consolidated_metadata(members))
                if len(self._meta_cache) > 8:
                    self._meta_cache.clear()
                self._meta_cache[(paths, start)] = cached
        block, consolidated = cached
        if not txn.zip.add_block(block):  # another thread moved the cursor: lay it out anew
            txn.zip.add_many([e.name for e in block.entries],
                             [[d] for d in block.iov[1::2]],
                             [e.size for e in block.entries], [e.crc32 for e in block.entries])
        attrs = root_attributes(step=txn.step, timeline=txn.timeline, slot=txn.slot)
        txn.zip.add_bytes(group_meta_key(""), root_document_bytes(attrs, consolidated))

    # -- commit ---------------------------------------------------------------------------
    def _prepare(self, txn: Transaction, *, rank: int, world: int, session: str,
                 metrics: Mapping[str, Metric]) -> Part:
        """Part writer: make this rank's share durable and vote for the slot (parts.py)."""
        with self._commit_lock:
            self._check_open()
            records = txn.records()
            self._metadata(txn)
            txn.zip.publish()
            txn.side.publish()
            self.storage.barrier()
            part = Part(slot=txn.slot, step=txn.step, rank=rank, world=world, session=session,
                        arrays=records, objects=dict(txn.objects), metrics=dict(metrics))
            self.storage.write_durable(part_key(txn.slot, rank), dump_part(part))
            self._open.discard(txn.slot)
            return part

    def _commit(self, txn: Transaction, metrics: Mapping[str, Metric],
                parts: Sequence[Part] = ()) -> CommitHeader:
        if not self.exclusive:
            raise DsttError("a part writer (exclusive=False) cannot commit; prepare() its part "
                            "and let the exclusive writer merge it")
        with self._commit_lock:
            self._check_open()
            if self.encoder is not None:
                self.encoder.check_deps(txn.slot, txn.deps)
            st = self.storage
            objects = dict(txn.objects)
            if parts:
                records, objects = merge_parts(txn.records(), objects, parts)
                table = dump_arrays(txn.slot, records)
            else:
                table = dump_arrays(txn.slot, txn.table())
            # refs and HEAD change only under the run's lock, which this writer holds: its
            # reader's copy is current (no re-read per commit), and it keeps each timeline's
            # head step itself (no header read per commit)
            ref = self.reader.ref(txn.timeline)
            head_step = self._head_steps.get(txn.timeline)
            if head_step is None and ref.head is not None:
                head_step = self.reader.header(ref.head).step
            if head_step is not None and txn.step <= head_step:
                raise ValueError(
                    f"step {txn.step} is not after the head of timeline {txn.timeline!r} "
                    f"(step {head_step}); steps must increase along a timeline — use "
                    "rollback to go back"
                )
            where = Location(txn.side.key, txn.side.append(table), len(table), checksum(table))
            self._metadata(txn)
            txn.zip.publish()
            txn.side.publish()
            header = CommitHeader(
                slot=txn.slot, step=txn.step, timeline=txn.timeline, parent=ref.head,
                time=time.time(), metrics=dict(metrics), objects=objects, arrays=where,
            )
            # one barrier makes the step's files and its header durable together: nothing
            # names the header until the ref moves, so it needs no sync of its own (two
            # fewer fsyncs per commit); the ref, the visibility point, moves only after it
            st.write(commit_key(txn.slot), dump_header(header))
            st.barrier()
            st.evict([txn.zip.key, txn.side.key])  # durable now; nobody reads it soon
            moved = replace(ref, head=txn.slot)
            new_ref = dump_ref(moved)
            if self.lazy_refs:  # durable with the next commit's barrier, or at close
                st.write(ref_key(txn.timeline), new_ref)
                self._unsynced = True
            else:
                st.write_durable(ref_key(txn.timeline), new_ref)
            self.reader._refs[txn.timeline] = moved
            self._head_steps[txn.timeline] = txn.step
            if parts:  # merged: the votes are no longer needed (gc sweeps any left behind)
                remove_parts(st, txn.slot)
            self._open.discard(txn.slot)
            if self.encoder is not None:
                self.encoder.promote(txn.slot, txn.timeline, txn.pending)
            if self.index is not None:
                # after the commit point: the index only ever holds committed rows. A failed
                # segment write keeps the rows pending (readers read their headers meanwhile)
                with contextlib.suppress(OSError):
                    self.index.add(header)
            return header


class Transaction:
    """The chunks, objects and metrics of one step on its way to a commit."""

    def __init__(self, writer: Writer, slot: int, step: int, timeline: str) -> None:
        self.writer, self.slot, self.step, self.timeline = writer, slot, step, timeline
        self._plans: dict[str, tuple[str, ChunkPlan]] = {}
        self._chunks: dict[str, list[ChunkRecord | None]] = {}
        self.objects: dict[str, ObjectRecord] = {}
        #: chunks written by ``put_flat``: per call (offsets, sizes, crc32c), and per array
        #: its span of them — columns, not a record object per chunk
        self._flat: list[tuple[list[int], list[int], list[int]]] = []
        self._flat_span: dict[str, tuple[int, int, int]] = {}
        self.zip = StepFile(writer.storage, step_file_key(slot, writer.file_tag))
        self.side = SideFile(writer.storage, side_file_key(slot, writer.file_tag))
        self._lock = threading.Lock()
        self.state = "open"
        self._object_bytes = 0
        #: set False to write this step raw (e.g. when the encoder cannot keep up)
        self.encode = True
        #: set True to write this step whole on request: plain Zarr chunks, new chains
        self.keyframe = False
        self.stats = EncodeStats()
        self.pending: dict[tuple[str, int], Shadow] = {}
        self._predictions: dict[str, Prediction] = {}
        #: slots of steps in flight this step's deltas are based on (``inflight_bases``)
        self.deps: set[int] = set()

    @property
    def bytes_written(self) -> int:
        """Bytes this step wrote so far (after dedup and deltas), objects included."""
        return self.stats.written_bytes + self._object_bytes

    def _check(self) -> None:
        if self.state != "open":
            raise DsttError(f"transaction for step {self.step} is already {self.state}")

    def declare(self, path: str, dtype: str, shape: tuple[int, ...],
                dims: Sequence[str] | None = None) -> ChunkPlan:
        """Announce a tensor of this step (``dims``: its dimension names, for ``zarr.json``);
        returns how to cut it into chunks."""
        self._check()
        plan = self.writer.declare(path, dtype, tuple(shape), dims)
        with self._lock:
            if path in self._plans:
                raise ValueError(f"array {path!r} declared twice in step {self.step}")
            self._plans[path] = (dtype, plan)
            self._chunks[path] = [None] * plan.n_chunks
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

    def _pending(self, path: str, index: int) -> Shadow | None:
        with self._lock:
            return self.pending.get((path, index))

    def put_chunk(self, path: str, index: int, data: Any) -> ChunkRecord:
        """Write chunk ``index`` of ``path`` (its exact byte range); thread-safe."""
        self._check()
        try:
            _, plan = self._plans[path]
        except KeyError:
            raise ValueError(f"array {path!r} was not declared in step {self.step}") from None
        start, stop = plan.byte_range(index)
        view = memoryview(data).cast("B")
        if len(view) != stop - start:
            raise ValueError(f"chunk {index} of {path!r} needs {stop - start} bytes, "
                             f"got {len(view)}")
        crc = checksum(view)
        pad = plan.chunk_nbytes - len(view)
        pads: list[Any] = []
        while pad > 0:  # zarr stores edge chunks full size
            z = memoryview(_ZERO)[: min(pad, len(_ZERO))]
            pads.append(z)
            crc = checksum(z, crc)
            pad -= len(z)
        enc = self.writer.encoder
        pending = None
        if enc is not None and (self.keyframe or not self.encode):
            self.stats.raw_fallback = not self.keyframe
            pending = enc.keep(path, index, self.timeline, view, crc, self.slot)
        elif enc is not None:
            rec, pending = enc.encode(self._side_write, path=path, index=index,
                                      plan=plan, slot=self.slot, timeline=self.timeline,
                                      data=view, raw_crc=crc, stats=self.stats,
                                      prediction=self._predictions.get(path),
                                      pending=self._pending, deps=self.deps)
            if rec is not None:
                return self._record(path, index, rec, pending)
        trailer = struct.pack("<I", crc)
        zcrc = crc32(view)
        for z in pads:
            zcrc = crc32(z, zcrc)
        zcrc = crc32(trailer, zcrc)
        size = plan.chunk_nbytes + 4
        offset = self.zip.add(zarr_chunk_key(path, plan.index(index)), [view, *pads, trailer],
                              size, zcrc)
        rec = ChunkRecord(self.zip.key, size, crc, offset=offset)
        self.stats.add(len(view), rec.nbytes, "key")
        if pending is not None:
            pending = replace(pending, record=rec)
        return self._record(path, index, rec, pending)

    def put_flat(self, layout: FlatLayout, buf: Any,
                 images: dict[int, FlatImage] | None = None) -> None:
        """Write every tensor of ``layout`` from the flat buffer ``buf`` (``flat.py``), raw:
        the hot path of the engine. ``images``: a cache of this buffer's ``FlatImage`` by
        start offset, kept by the caller with the buffer (headers are then built once)."""
        view = memoryview(buf).cast("B")
        if len(view) < layout.nbytes:
            raise ValueError(f"flat buffer of {len(view)} bytes, layout needs {layout.nbytes}")
        cache = images if images is not None else {}

        def image_at(start: int) -> FlatImage:
            im = cache.get(start)
            if im is None or im.layout is not layout:
                im = cache[start] = FlatImage(layout, start, view)
            return im

        start = self.reserve_flat(layout, lambda s: image_at(s).nbytes)
        image = image_at(start)
        crcs, _ = image.fill()
        self.zip.write_at(start, image.iov)
        self.complete_flat(layout, image.offsets, image.sizes, crcs, bytes(image.directory))
        enc = self.writer.encoder
        if enc is not None:  # a raw step of an encoding writer still seeds the next deltas
            key, arrays = self.zip.key, layout.arrays
            for (k, i, s, e, _, _), off, size, crc in zip(layout.chunks, image.offsets,
                                                          image.sizes, crcs, strict=True):
                a = arrays[k]
                sh = enc.keep(a.path, i, self.timeline, view[s:e], crc, self.slot)
                if sh is not None:
                    rec = ChunkRecord(key, size, crc, offset=off)
                    self.pending[(a.path, i)] = replace(sh, record=rec)

    def reserve_flat(self, layout: FlatLayout, nbytes_at: Any) -> int:
        """First half of a flat write done elsewhere (the flusher process): declare the
        layout's arrays in this step and reserve their zip range; returns its start."""
        self._check()
        enc = self.writer.encoder
        if enc is not None and self.encode and not self.keyframe:
            raise DsttError("a flat write is raw; set txn.encode = False (or keyframe) "
                            "when the writer encodes, or use put_chunk")
        plans = {a.path: (a.dtype, a.plan) for a in layout.arrays}
        with self._lock:
            if not self._plans.keys().isdisjoint(plans):
                dup = sorted(self._plans.keys() & plans.keys())
                raise ValueError(f"array {dup[0]!r} declared twice in step {self.step}")
            self._plans.update(plans)
        return self.zip.reserve(layout.names, nbytes_at)

    def complete_flat(self, layout: FlatLayout, offsets: list[int], sizes: list[int],
                      crcs: list[int], directory: bytes) -> None:
        """Second half: the chunks are written; record where (columns) and their zip
        central directory records."""
        self.zip.add_directory(directory, len(offsets))
        with self._lock:
            put = len(self._flat)
            self._flat.append((offsets, sizes, crcs))
            self._flat_span.update({p: (put, lo, hi) for p, lo, hi in layout.spans})
        self.stats.add_many(layout.raw_nbytes, sum(sizes), keyframes=len(sizes))
        if self.writer.encoder is not None:
            self.stats.raw_fallback = not self.keyframe

    def put_encoded(self, name: str, data: bytes, encoding: Encoding = "json") -> ObjectRecord:
        """Store an object already encoded (e.g. JSON built by the caller) as ``name``."""
        self._check()
        return self._put_object_bytes(name, data, encoding)

    def _side_write(self, parts: list[Any]) -> tuple[str, int]:
        return self.side.key, self.side.append(parts)

    def _record(self, path: str, index: int, rec: ChunkRecord,
                pending: Shadow | None) -> ChunkRecord:
        with self._lock:
            self._chunks[path][index] = rec
            if pending is not None:
                self.pending[(path, index)] = pending
        return rec

    def put_object(self, name: str, obj: Any, *, encoding: Encoding = "json") -> ObjectRecord:
        """Store a Python object for this step (tagged JSON unless told otherwise)."""
        self._check()
        return self._put_object_bytes(name, encode_object(obj, encoding), encoding)

    def _put_object_bytes(self, name: str, data: bytes, encoding: Encoding) -> ObjectRecord:
        with self._lock:
            if name in self.objects:
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

    def table(self) -> TableBuilder:
        """The columnar arrays table of this step (``manifest.TableBuilder``)."""
        b = TableBuilder()
        zip_id = b.file_id(self.zip.key)
        for path, (dtype, plan) in self._plans.items():
            b.add_array(path, dtype, plan.shape, plan.rows, self.writer._dims.get(path))
            span = self._flat_span.get(path)
            if span is not None:
                offs, sizes, crcs = self._flat[span[0]]
                lo, hi = span[1], span[2]
                b.add_chunks(zip_id, offs[lo:hi], sizes[lo:hi], crcs[lo:hi])
                continue
            for c in self._complete(path):
                b.add_record(c)
        return b

    def _complete(self, path: str) -> list[ChunkRecord]:
        span = self._flat_span.get(path)
        if span is not None:
            offs, sizes, crcs = self._flat[span[0]]
            return [ChunkRecord(self.zip.key, sizes[k], crcs[k], offset=offs[k])
                    for k in range(span[1], span[2])]
        chunks = self._chunks[path]
        missing = [i for i, c in enumerate(chunks) if c is None]
        if missing:
            raise DsttError(f"step {self.step}: chunks {missing[:8]} of {path!r} were "
                            "never written; refusing to commit an incomplete step")
        return chunks  # type: ignore[return-value]

    def records(self) -> dict[str, ArrayRecord]:
        out = {}
        for path, (dtype, plan) in self._plans.items():
            if path in self._flat_span:
                out[path] = ArrayRecord(path, dtype, plan.shape, plan.rows,
                                        tuple(self._complete(path)),
                                        self.writer._dims.get(path))
                continue
            chunks = self._chunks[path]
            missing = [i for i, c in enumerate(chunks) if c is None]
            if missing:
                raise DsttError(f"step {self.step}: chunks {missing[:8]} of {path!r} were "
                                "never written; refusing to commit an incomplete step")
            out[path] = ArrayRecord(path, dtype, plan.shape, plan.rows,
                                    tuple(c for c in chunks if c is not None),
                                    self.writer._dims.get(path))
        return out

    def commit(self, metrics: Mapping[str, Metric] | None = None, *,
               parts: Sequence[Part] = ()) -> CommitHeader:
        """Make the step durable and visible; returns its header. ``parts``: the other ranks'
        prepared parts of this slot, merged into this commit (``parts.collect_parts``)."""
        self._check()
        self.state = "committing"
        try:
            header = self.writer._commit(self, metrics or {}, parts)
        except BaseException:
            self.state = "failed"
            raise
        self.state = "committed"
        return header

    def prepare(self, *, rank: int, world: int, session: str,
                metrics: Mapping[str, Metric] | None = None) -> Part:
        """Part writers: make this rank's chunks and objects durable, then write its part
        manifest (the "prepared" vote the exclusive writer waits for). Returns the part."""
        self._check()
        self.state = "committing"
        try:
            part = self.writer._prepare(self, rank=rank, world=world, session=session,
                                        metrics=metrics or {})
        except BaseException:
            self.state = "failed"
            raise
        self.state = "prepared"
        return part

    def abort(self) -> None:
        """Drop the step; its slot stays unused (gc removes stray step files)."""
        if self.state in ("open", "failed"):
            self.state = "aborted"
            self.writer._open.discard(self.slot)
            self.zip.discard()  # unpublished files vanish; published ones are gc's garbage
            self.side.discard()
            if self.writer.encoder is not None:
                self.writer.encoder.discard(self.slot)
