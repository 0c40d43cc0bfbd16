"""The commit of one step as data: a ``CommitJob`` the writer builds, ``run_commit`` does.

The writer decides (the parent, the head check, the new ref) and describes all the commit
writes in one frozen value; ``run_commit`` writes it in ``commit/writer.py``'s commit order. The
same function runs in the writer's thread or, for a flat step, in the flusher process, where
the commit's Python runs off the training process's interpreter lock. It is idempotent: every
byte is fixed by the job (the header's time included) and lands at a fixed offset, so a commit
the flusher died in the middle of is simply run again here.

Rejected alternative: the child owning the whole writer (refs, lock, index) as DCP's async
process owns a save — two writers of one run's metadata, and every non-flat step (deltas,
multi-rank parts) would have to travel too.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from dstt.store.format.envelope import checksum
from dstt.store.format.layout import commit_key, group_meta_key, ref_key
from dstt.store.format.manifest import TableTemplate, dump_header
from dstt.store.format.objects import Encoded, Encoding, encode_object
from dstt.store.format.records import CommitHeader, Location, Metric, ObjectRecord
from dstt.store.format.zarr_meta import root_attributes, root_document_bytes

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from dstt.store.format.stepfile import Block, SideFile, StepFile, StepState
    from dstt.store.storage.base import Storage

__all__ = [
    "CommitJob",
    "Deferred",
    "NotHandedOff",
    "RemoteCommitter",
    "encode_deferred",
    "run_commit",
    "write_metadata",
]


class NotHandedOff(Exception):
    """The job could not be sent (e.g. an object pickle refuses): run it here instead."""


@dataclass(frozen=True)
class Deferred:
    """An object stored at commit: ``value`` encoded as ``encoding`` (an ``Encoded`` value
    as its own bytes); ``or_pickle``: pickle it where JSON cannot hold it."""

    name: str
    value: Any
    encoding: Encoding = "json"
    or_pickle: bool = False


@dataclass(frozen=True)
class CommitJob:
    """Everything one commit writes, decided by the writer (``commit/writer.py``)."""

    slot: int
    step: int
    timeline: str
    parent: int | None
    time: float
    ref: bytes  # the timeline's moved ref, sealed (``dump_ref``)
    lazy_ref: bool  # written without a sync (the next barrier makes it durable)
    metrics: Mapping[str, Metric] = field(default_factory=dict)
    objects: Mapping[str, ObjectRecord] = field(default_factory=dict)  # written already
    deferred: tuple[Deferred, ...] = ()
    #: the arrays table: its bytes, or the cached columns and this step's chunk columns
    table: bytes | None = None
    template: TableTemplate | None = None
    offsets: Sequence[int] = ()
    crcs: Sequence[int] = ()
    #: the zarr.json documents below the root (one prebuilt block) and their consolidated
    #: metadata, spliced into the root document
    block: Block | None = None
    consolidated: bytes = b""


class RemoteCommitter(Protocol):
    """Runs a job in another process (the flusher): ``commit`` returns its header, raises
    ``StorageError`` if it failed; ``dead`` once the process is gone (the job may have
    been half done: run it here)."""

    dead: bool

    def commit(
        self,
        root: str,
        durability: str,
        zip_state: StepState,
        side_state: StepState,
        job: CommitJob,
    ) -> CommitHeader: ...


def encode_deferred(d: Deferred) -> tuple[bytes, str]:
    if isinstance(d.value, Encoded):
        return d.value.data, d.value.encoding
    try:
        return encode_object(d.value, d.encoding), d.encoding
    except TypeError:
        if not d.or_pickle:
            raise
        return pickle.dumps(d.value, protocol=pickle.HIGHEST_PROTOCOL), "pickle"


def write_metadata(zf: StepFile, block: Block, consolidated: bytes, attrs: dict[str, Any]) -> None:
    """The zarr.json entries of a step file: the prebuilt block of every group and array
    (laid out anew where the file is not where the block was built for), then the root."""
    if not zf.add_block(block):
        zf.add_many(
            [e.name for e in block.entries],
            [[d] for d in block.iov[1::2]],
            [e.size for e in block.entries],
            [e.crc32 for e in block.entries],
        )
    zf.add_bytes(group_meta_key(""), root_document_bytes(attrs, consolidated))


def run_commit(storage: Storage, zf: StepFile, side: SideFile, job: CommitJob) -> CommitHeader:
    """Write ``job`` (module docstring: the order, and why running it twice is safe)."""
    objects = dict(job.objects)
    table = job.table
    if table is None:
        assert job.template is not None, "a job names its table or the table's template"
        table = job.template.dump(job.slot, zf.key, job.offsets, job.crcs)
    encoded = [encode_deferred(d) for d in job.deferred]
    # the objects, then the table: one write, each at the offset it would have alone
    at = side.append([data for data, _ in encoded] + [table])
    for d, (data, encoding) in zip(job.deferred, encoded, strict=True):
        objects[d.name] = ObjectRecord(side.key, len(data), checksum(data), encoding, at)
        at += len(data)
    where = Location(side.key, at, len(table), checksum(table))
    if job.block is not None:
        write_metadata(
            zf,
            job.block,
            job.consolidated,
            root_attributes(step=job.step, timeline=job.timeline, slot=job.slot),
        )
    zf.publish()
    side.publish()
    header = CommitHeader(
        slot=job.slot,
        step=job.step,
        timeline=job.timeline,
        parent=job.parent,
        time=job.time,
        metrics=dict(job.metrics),
        objects=objects,
        arrays=where,
    )
    # one barrier makes the step's files and its header durable together: nothing names
    # the header until the ref moves, so it needs no sync of its own; the ref, the
    # visibility point, moves only after it
    # create-only: a header is never written over another writer's (a stalled one's slot)
    storage.create(commit_key(job.slot), dump_header(header))
    storage.barrier()
    storage.evict([zf.key, side.key])  # durable now; nobody reads it soon
    if job.lazy_ref:  # durable with the next commit's barrier, or at close
        storage.write(ref_key(job.timeline), job.ref)
    else:
        storage.write_durable(ref_key(job.timeline), job.ref)
    return header
