"""The single writer of a run and its transactions (one per committed step).

A ``Writer`` holds the run's lock and hands out ``Transaction`` objects, each writing its step
into two new files of a fresh *slot* (``stepfile.py``), so nothing visible is ever overwritten.
``commit`` alone makes a step visible: arrays table → zip directory → publish both files →
header → barrier → timeline ref (durable: the commit point). A crash before the ref moves
leaves garbage no reader looks at. A part writer (``exclusive=False``) takes no lock and
``prepare``s a part manifest the exclusive writer merges (``commit/parts.py``).

The parent is resolved *at commit time*, so step k+1 is staged while step k flushes, and a
skipped step does not break the chain. Rejected alternative: the parent fixed at ``begin`` — a
skipped step would leave its successor pointing at a slot that never committed.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from dstt.errors import DsttError, SchemaError, StorageError
from dstt.store.codec.delta import DeltaEncoder
from dstt.store.format.flat import ArraySpec, FlatLayout
from dstt.store.format.layout import (
    DEFAULT_CHUNK_BYTES,
    LOCK_KEY,
    STEPS_PREFIX,
    WRITTEN_PREFIXES,
    ChunkPlan,
    array_meta_key,
    check_array_path,
    group_meta_key,
    parse_step_file,
    part_key,
    plan_chunks,
    ref_key,
)
from dstt.store.format.manifest import TableTemplate, dump_arrays, dump_ref
from dstt.store.format.parts import Part, dump_part, remove_parts
from dstt.store.format.stepfile import Block, SideFile, StepFile
from dstt.store.format.zarr_meta import (
    array_document,
    consolidated_metadata,
    dtype_itemsize,
    dump,
    group_document,
    root_attributes,
)
from dstt.store.index.writer import EVERY, IndexWriter
from dstt.store.maintenance.gc import GcReport, gc

from .job import CommitJob, NotHandedOff, RemoteCommitter, run_commit, write_metadata
from .parts import merge_parts
from .transaction import Transaction

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence

    from dstt.store.codec.xor import DeltaPolicy
    from dstt.store.format.records import CommitHeader, Metric
    from dstt.store.maintenance.retention import Retention
    from dstt.store.read.reader import Reader
    from dstt.store.storage.base import Storage

__all__ = ["RunHandle", "Transaction", "Writer"]


class RunHandle(Protocol):
    """The run a writer writes (the store's ``Repository``; a protocol, so this room imports
    nothing above it): its storage and a reader of its committed state."""

    @property
    def storage(self) -> Storage: ...

    def reader(self) -> Reader: ...


class Writer:
    """Exclusive writer of one run; use as a context manager."""

    def __init__(
        self,
        repo: RunHandle,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        encoding: DeltaPolicy | None = None,
        exclusive: bool = True,
        inflight_bases: bool = False,
        rank: int | None = None,
        lazy_refs: bool = False,
        index_every: int = EVERY,
    ) -> None:
        """``inflight_bases``: a step may be encoded against the previous step before that
        one commits (for callers that overlap steps and commit them in order, like the
        engine); a step based on one that then fails to commit cannot commit either.
        ``rank``: names a part writer's files (``steps/<slot>.r00001.zip``).
        ``lazy_refs``: a commit moves the ref without syncing it; the next commit's barrier
        (or ``flush``/``close``) makes it durable. Visibility still implies durability (the
        ref is written only after the step's files and header are durable), but a power
        cut can lose the newest commit — never tear one. Two fewer syncs per commit: for
        per-iteration capture, where the next commit follows in a fraction of a second.
        ``index_every``: committed steps per new index segment (``index/writer.py``)."""
        self.repo = repo
        self.storage = repo.storage
        self.chunk_bytes = chunk_bytes
        self.exclusive = exclusive
        self.lazy_refs = lazy_refs
        self._unsynced = False  # a lazily written ref awaits a barrier
        self._head_steps: dict[str, int] = {}  # timeline -> step of the head this writer made
        #: suffix of this writer's step files: empty for the committer, the rank (or a random
        #: id) for a part writer, so every rank's files of one slot have their own names
        self.file_tag = (
            "" if exclusive else (f"r{rank:05d}" if rank is not None else secrets.token_hex(4))
        )
        self.storage.check_writable(WRITTEN_PREFIXES)
        if exclusive:
            self._lock_cm: Any = self.storage.lock(LOCK_KEY)
            self._lock_cm.__enter__()
        elif encoding is not None:
            raise ValueError(
                "a part writer (exclusive=False) cannot encode deltas: its bases "
                "would not be known to be committed"
            )
        else:
            self._lock_cm = None
        self._closed = False
        self._meta_lock = threading.Lock()
        self._commit_lock = threading.Lock()
        self.index: IndexWriter | None = None
        try:
            self.reader = repo.reader()
            self._next_slot = self._first_free_slot()
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
        #: the first block of each set of arrays, to move where a step's file is elsewhere
        self._meta_moved: dict[tuple[str, ...], tuple[Block, bytes]] = {}
        #: id(flat layout) -> (the layout, its arrays table's fixed columns)
        self._tables: dict[int, tuple[FlatLayout, TableTemplate]] = {}
        self._open: set[int] = set()
        self.encoder = DeltaEncoder(encoding) if encoding is not None else None
        self.inflight_bases = inflight_bases
        #: commits steps in another process where it can (the engine's flusher): None here
        self.committer: RemoteCommitter | None = None

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

    def check_open(self) -> None:
        if self._closed:
            raise DsttError("this writer is closed; open a new one with repo.writer()")

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        """Commits wait while inside (a gc under this writer, ``maintenance/gc.py``): on
        entry the writer is open, its background index job finished and every ref it
        wrote lazily durable."""
        with self._commit_lock:
            self.check_open()
            if self.index is not None:  # a background index job writes no segment now
                self.index.wait()
            if self._unsynced:  # the refs durable before anything is tombstoned
                self.storage.barrier()
                self._unsynced = False
            yield

    @property
    def in_flight(self) -> set[int]:
        """Slots of the transactions begun and not yet committed, prepared or aborted."""
        return set(self._open)

    def _first_free_slot(self) -> int:
        """Past every commit header; where step files are create-only (an object store),
        past every step file too: those a dead writer left uncommitted are not overwritten."""
        top = self.reader.max_slot()
        if self.storage.write_once_steps:
            for name in self.storage.list(STEPS_PREFIX):
                got = parse_step_file(name)
                if got is not None:
                    top = max(top, got[0])
        return top + 1

    def release_slot(self, slot: int) -> None:
        """An aborted transaction's slot: no longer in flight (it stays unused)."""
        self._open.discard(slot)

    @property
    def dims(self) -> Mapping[str, tuple[str, ...] | None]:
        """The dimension names of every declared array (None: ``<name>_<i>``)."""
        return self._dims

    def gc(self, retention: Retention | None = None, *, dry_run: bool = False) -> GcReport:
        """gc under this writer (it holds the run's lock; a second one would be refused): a
        live session's background retention. Commits wait only while the tombstones and the
        index are written; the slots in flight are left alone (``maintenance.gc``)."""
        self.check_open()
        if not self.exclusive:
            raise DsttError("a part writer (exclusive=False) holds no lock and cannot gc")
        return gc(self.repo, retention=retention, dry_run=dry_run, writer=self)

    @property
    def next_slot(self) -> int:
        """The slot the next ``begin`` without ``slot=`` takes."""
        return self._next_slot

    def begin(
        self, step: int, *, timeline: str | None = None, slot: int | None = None
    ) -> Transaction:
        """Start writing ``step`` into a fresh slot of ``timeline`` (default: current).

        ``slot`` picks the slot explicitly (multi-rank commits: every rank writes the same
        slot); it must not be below a slot this writer already handed out.
        """
        self.check_open()
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
                raise ValueError(f"slot {slot} is already used (next free slot: {self._next_slot})")
            self._next_slot = max(self._next_slot, slot + 1)
            self._open.add(slot)
        txn = Transaction(self, slot, step, name)
        if self.encoder is not None and self.inflight_bases:
            self.encoder.open(slot, name, txn.deps, lambda: txn.flat_pending)
        return txn

    # -- metadata -------------------------------------------------------------------------
    def _stored_schema(self) -> dict[str, tuple[str, tuple[int, ...], int]]:
        """dtype, shape and rows per chunk of every array at the head of the current
        timeline: a resuming session must match the first two and keeps the chunking."""
        if self._stored is None:
            head = self.reader.head()
            self._stored = (
                {}
                if head is None or head.pruned
                else {p: (a.dtype, a.shape, a.rows) for p, a in self.reader.arrays(head).items()}
            )
        return self._stored

    def declare(
        self, path: str, dtype: str, shape: tuple[int, ...], dims: Sequence[str] | None = None
    ) -> ChunkPlan:
        """Announce an array (its ``zarr.json`` is built once while dtype, shape and
        ``dims``, the dimension names, hold)."""
        shape = tuple(int(s) for s in shape)
        names = None if dims is None else tuple(dims)
        with self._meta_lock:
            known = self._arrays.get(path)
            if (
                known is not None
                and known[0] == dtype
                and known[1].shape == shape
                and self._dims.get(path) == names
            ):
                return known[1]
            check_array_path(path)
            itemsize = dtype_itemsize(dtype)
            was = (
                (known[0], known[1].shape, known[1].rows)
                if known is not None
                else self._stored_schema().get(path)
            )
            if was is not None and was[:2] != (dtype, shape):
                raise SchemaError(
                    f"array {path!r} is stored as {was[0]}{was[1]}, but this step has "
                    f"{dtype}{shape}; a tensor's dtype and shape must stay fixed within a run "
                    "(start a new run for a changed model)"
                )
            plan = (
                ChunkPlan(shape, itemsize, was[2])
                if was is not None
                else plan_chunks(shape, itemsize, self.chunk_bytes)
            )
            doc = dump(array_document(path, dtype, plan, dims=names))
            if known is not None:  # a document changed: the prebuilt blocks hold the old one
                self._meta_cache.clear()
                self._meta_moved.clear()
                self._tables.clear()
            self._arrays[path] = (dtype, plan, doc)
            self._dims[path] = names
            return plan

    def flat_layout(
        self,
        arrays: Sequence[ArraySpec],
    ) -> FlatLayout:
        """Declare ``arrays`` (path, dtype, shape[, dims]) for this writer and lay them out in
        one flat buffer (``flat.py``); reuse the result while the arrays do not change."""
        out = []
        for a in arrays:
            dims = a[3] if len(a) > 3 else None
            out.append((a[0], a[1], self.declare(a[0], a[1], tuple(a[2]), dims), dims))
        return FlatLayout.build(out)

    def table_template(
        self, layout: FlatLayout, sizes: Sequence[int] | None = None
    ) -> TableTemplate:
        """The arrays table's fixed columns for steps written whole from ``layout``
        (``sizes``: its raw chunks' sizes, computed from the layout when not given)."""
        with self._meta_lock:
            hit = self._tables.get(id(layout))
            if hit is not None and hit[0] is layout:
                return hit[1]
            if sizes is None:
                sizes = [c[5] + 4 for c in layout.chunks]
            arrays = layout.arrays
            tpl = TableTemplate(
                [a.path for a in arrays],
                [a.dtype for a in arrays],
                [a.shape for a in arrays],
                [a.plan.rows for a in arrays],
                [self._dims.get(a.path) for a in arrays],
                sizes,
            )
            if len(self._tables) > 8:
                self._tables.clear()
            self._tables[id(layout)] = (layout, tpl)
            return tpl

    def _metadata(self, txn: Transaction) -> tuple[Block, bytes]:
        """The zarr.json documents of a step file below the root (one prebuilt ``Block``
        per set of arrays and start offset — at every step of a steady run the same bytes
        at the same place) and their consolidated metadata (``job.write_metadata``
        writes them)."""
        paths = tuple(txn.columns.plans)
        start = txn.zip.cursor
        with self._meta_lock:
            cached = self._meta_cache.get((paths, start))
            if cached is None and paths in self._meta_moved:  # another place (an encoded
                block, consolidated = self._meta_moved[paths]  # step's keyframes vary)
                cached = (block.moved(start), consolidated)
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
                cached = (
                    Block(start, [k for k, _ in docs], [d for _, d in docs]),
                    consolidated_metadata(members),
                )
                if len(self._meta_cache) > 8:
                    self._meta_cache.clear()
                    self._meta_moved.clear()
                self._meta_cache[(paths, start)] = cached
                self._meta_moved.setdefault(paths, cached)
        return cached

    def _run(self, txn: Transaction, job: CommitJob, *, remote: bool) -> CommitHeader:
        """Write ``job``: in the flusher process where one is attached and the step's files
        can be handed over (``remote``), else — or if the flusher died during it — here."""
        rc = self.committer
        zs, ss = txn.zip.handoff(), txn.side.handoff()
        if remote and rc is not None and not rc.dead:
            root, durability = (
                getattr(self.storage, "location", None),
                getattr(self.storage, "durability", None),
            )
            if zs is not None and ss is not None and root is not None:
                try:
                    header = rc.commit(root, str(durability), zs, ss, job)
                except StorageError:
                    if not rc.dead:
                        raise  # it failed there (the disk): the step fails
                    # gone mid-commit: run it again here (the same bytes at the same places)
                except NotHandedOff:
                    pass  # the job could not travel (an object pickle refuses): run it here
                else:
                    txn.zip.handed_off()
                    txn.side.handed_off()
                    if job.lazy_ref:  # written there: this process's next barrier syncs it
                        self.storage.note_written(ref_key(job.timeline))  # type: ignore[attr-defined]
                    return header
        if zs is not None and ss is not None:
            # as the child would: on handles of its own, so a failed attempt (a full disk)
            # leaves the step's files as ``txn`` knows them and ``reopen`` may run it again
            zf, side = StepFile.adopt(self.storage, zs), SideFile.adopt(self.storage, ss)
            try:
                header = run_commit(self.storage, zf, side, job)
            except BaseException:
                for f in (zf, side):
                    f.handed_off()  # (the failed step's files are deleted through ``txn``)
                raise
            txn.zip.handed_off()
            txn.side.handed_off()
            return header
        txn.ran_here = True  # its files now hold this attempt's writes (no ``reopen``)
        return run_commit(self.storage, txn.zip, txn.side, job)

    # -- commit ---------------------------------------------------------------------------
    def prepare_step(
        self,
        txn: Transaction,
        *,
        rank: int,
        world: int,
        session: str,
        metrics: Mapping[str, Metric],
    ) -> Part:
        """Part writer: make this rank's share durable and vote for the slot (commit/parts.py)."""
        with self._commit_lock:
            self.check_open()
            txn.write_deferred()
            records = txn.columns.records()
            write_metadata(
                txn.zip,
                *self._metadata(txn),
                root_attributes(step=txn.step, timeline=txn.timeline, slot=txn.slot),
            )
            txn.zip.publish()
            txn.side.publish()
            self.storage.barrier()
            part = Part(
                slot=txn.slot,
                step=txn.step,
                rank=rank,
                world=world,
                session=session,
                arrays=records,
                objects=dict(txn.objects),
                metrics=dict(metrics),
            )
            self.storage.write_durable(part_key(txn.slot, rank), dump_part(part))
            self._open.discard(txn.slot)
            return part

    def commit_step(
        self, txn: Transaction, metrics: Mapping[str, Metric], parts: Sequence[Part] = ()
    ) -> CommitHeader:
        """Commit ``txn`` (its ``commit``; ``parts``: the other ranks' prepared parts of
        its slot, merged in)."""
        if not self.exclusive:
            raise DsttError(
                "a part writer (exclusive=False) cannot commit; prepare() its part "
                "and let the exclusive writer merge it"
            )
        with self._commit_lock:
            self.check_open()
            if self.encoder is not None:
                self.encoder.check_deps(txn.slot, txn.deps)
            st = self.storage
            if parts:
                txn.write_deferred()
                records, objects = merge_parts(txn.columns.records(), dict(txn.objects), parts)
                table: bytes | None = dump_arrays(txn.slot, records)
                spliced = None
            else:
                objects = dict(txn.objects)
                spliced = txn.columns.table_parts()
                table = txn.columns.arrays_table() if spliced is None else None
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
            moved = replace(ref, head=txn.slot)
            block, consolidated = self._metadata(txn)
            if txn.commit_time is None:  # a retry (``reopen``) writes the same header
                txn.commit_time = time.time()
            job = CommitJob(
                slot=txn.slot,
                step=txn.step,
                timeline=txn.timeline,
                parent=ref.head,
                time=txn.commit_time,
                ref=dump_ref(moved),
                lazy_ref=self.lazy_refs,
                metrics=dict(metrics),
                objects=objects,
                deferred=() if txn.deferred_stored else tuple(txn.deferred),
                table=table,
                template=None if spliced is None else spliced[0],
                offsets=() if spliced is None else spliced[1],
                crcs=() if spliced is None else spliced[2],
                block=block,
                consolidated=consolidated,
            )
            # an encoded step commits here, in order with its deltas' bases (promote below); a
            # raw one (nothing to promote, based on nothing) may commit in the flusher
            header = self._run(
                txn,
                job,
                remote=not parts
                and (self.encoder is None or not (txn.deps or txn.flat_pending is not None)),
            )
            txn.count_objects(header)
            if self.lazy_refs:
                self._unsynced = True
            self.reader.moved(moved)
            self._head_steps[txn.timeline] = txn.step
            if parts:  # merged: the votes are no longer needed (gc sweeps any left behind)
                remove_parts(st, txn.slot)
            self._open.discard(txn.slot)
            if self.encoder is not None:
                self.encoder.promote(txn.slot, txn.timeline, txn.flat_pending)
            if self.index is not None:
                # after the commit point: the index only ever holds committed rows. A failed
                # segment write keeps the rows pending (readers read their headers meanwhile)
                with contextlib.suppress(OSError):
                    self.index.add(header)
            return header
