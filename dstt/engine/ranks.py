"""Several ranks, one run: who writes what, which slot each step takes, and the global commit.

Every rank runs its own capture pipeline. The pipeline talks to a ``RankWriter`` instead of a
store ``Writer``; its transactions behave like store transactions except for ``commit``:

* rank 0 holds the run's lock (the store's exclusive writer). Its ``commit`` waits, on its
  committer thread, for the *part manifests* of every other rank for the same slot (polling
  the store, ``dstt.store.parts``), checks they are votes for the same step of the same session,
  and merges them into one ordinary commit. ``latest``-style pointers move only after it.
* every other rank opens a part writer (no lock) and its ``commit`` *prepares*: barrier, then
  its part manifest, written durably. Nothing of it is visible until rank 0 merges it.

Slots: each rank's n-th staged step takes slot ``base + n``, where ``base`` is rank 0's next
free slot, agreed once in ``open_ranks`` on the main thread (one ``broadcast_object_list`` on
the default process group). That is the only collective dstt issues, and it runs before any
background thread exists; background threads coordinate only through the store.
Rejected alternative: a gloo barrier per step on a side group from the committer thread — a
rank that stops checkpointing (error, shutdown) would hang every other rank's committer, and
per-step collectives serialise the ranks' flushes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import RankError, TimelineError
from ..store import DeltaPolicy, Repository, Storage, abort_vote, collect_parts, remove_parts

__all__ = ["RankInfo", "RankTransaction", "RankWriter", "dist_info", "open_ranks"]

DEFAULT_RANK_TIMEOUT = 600.0


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int


def dist_info() -> RankInfo:
    """This process's rank and the world size (``0, 1`` without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size())
    return RankInfo(0, 1)


class TransactionProxy:
    """Passes what the pipeline uses (declare, put_chunk, put_object, abort) to a store
    transaction; subclasses change how the step is committed."""

    def __init__(self, txn: Any) -> None:
        self._txn = txn
        self.slot: int = txn.slot
        self.step: int = txn.step

    def declare(self, path: str, dtype: str, shape: tuple[int, ...]) -> Any:
        return self._txn.declare(path, dtype, shape)

    def put_chunk(self, path: str, index: int, data: Any) -> Any:
        return self._txn.put_chunk(path, index, data)

    def put_object(self, name: str, obj: Any, **kw: Any) -> Any:
        return self._txn.put_object(name, obj, **kw)

    def put_encoded(self, name: str, data: bytes, encoding: Any = "json") -> Any:
        return self._txn.put_encoded(name, data, encoding)

    def put_flat(self, layout: Any, buf: Any, images: Any = None) -> None:
        self._txn.put_flat(layout, buf, images)

    def reserve_flat(self, layout: Any, nbytes_at: Any) -> int:
        return int(self._txn.reserve_flat(layout, nbytes_at))

    def complete_flat(self, *args: Any) -> None:
        self._txn.complete_flat(*args)

    def predict(self, predictions: Any) -> None:
        self._txn.predict(predictions)

    @property
    def zip(self) -> Any:
        return self._txn.zip

    @property
    def keyframe(self) -> bool:
        return bool(self._txn.keyframe)

    @keyframe.setter
    def keyframe(self, value: bool) -> None:
        self._txn.keyframe = value

    def abort(self) -> None:
        self._txn.abort()


class RankTransaction(TransactionProxy):
    """A store transaction of one rank; ``commit`` merges (rank 0) or prepares (others)."""

    def __init__(self, owner: RankWriter, txn: Any) -> None:
        super().__init__(txn)
        self._owner = owner
        self.slot, self.step, self.rank = txn.slot, txn.step, owner.info.rank

    def abort(self) -> None:
        super().abort()
        o = self._owner
        if o.info.rank != 0 and not o.cancel.is_set():  # rank 0 should not wait for us
            with contextlib.suppress(Exception):
                abort_vote(o.storage, slot=self.slot, step=self.step, rank=o.info.rank,
                           world=o.info.world, session=o.session,
                           error=f"rank {o.info.rank} dropped the step")

    @property
    def encode(self) -> bool:
        return bool(self._txn.encode)

    @encode.setter
    def encode(self, value: bool) -> None:
        self._txn.encode = value

    @property
    def stats(self) -> Any:
        return self._txn.stats

    @property
    def bytes_written(self) -> int:
        return int(self._txn.bytes_written)

    def commit(self, metrics: Mapping[str, Any] | None = None) -> Any:
        o = self._owner
        for hook in o.before_commit:
            hook(self)
        if o.info.rank != 0:
            return self._txn.prepare(rank=o.info.rank, world=o.info.world, session=o.session,
                                     metrics=metrics)
        parts = collect_parts(o.storage, slot=self.slot, step=self.step,
                              ranks=range(1, o.info.world), world=o.info.world,
                              session=o.session, timeout=o.timeout, cancel=o.cancel)
        header = self._txn.commit(metrics, parts=parts)
        for hook in o.after_commit:
            hook(header)
        return header


class RankWriter:
    """The pipeline-facing writer of one rank (see the module docstring)."""

    def __init__(self, writer: Any, info: RankInfo, *, base_slot: int, session: str,
                 timeout: float = DEFAULT_RANK_TIMEOUT) -> None:
        self.writer, self.info = writer, info
        self.storage: Storage = writer.storage
        self.base_slot, self.session, self.timeout = base_slot, session, timeout
        self.cancel = threading.Event()
        self._n = 0
        self._lock = threading.Lock()
        #: called on the committer thread: before a commit/prepare (with the transaction) and,
        #: on rank 0, after the global commit (with its header)
        self.before_commit: list[Callable[[RankTransaction], None]] = []
        self.after_commit: list[Callable[[Any], None]] = []

    @property
    def repo(self) -> Repository:
        return self.writer.repo  # type: ignore[no-any-return]

    @property
    def encoder(self) -> Any:
        """The store writer's delta encoder (None without ``DeltaPolicy``): the pipeline
        decides per step from it whether to encode (it read ``None`` here before, so a
        one-rank DeltaPolicy run wrote every step raw)."""
        return getattr(self.writer, "encoder", None)

    def flat_layout(self, arrays: Any) -> Any:
        return self.writer.flat_layout(arrays)

    def begin(self, step: int) -> RankTransaction:
        with self._lock:
            slot = self.base_slot + self._n
            self._n += 1
        return RankTransaction(self, self.writer.begin(step, slot=slot))

    def close(self) -> None:
        self.cancel.set()
        self.writer.close()


def _broadcast(obj: Any, info: RankInfo) -> Any:
    if info.world == 1:
        return obj
    import torch.distributed as dist

    box = [obj if info.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_ok(ok: bool, msg: str, info: RankInfo) -> None:
    got: list[Any] = [(ok, msg)]
    if info.world > 1:
        import torch.distributed as dist

        got = [None] * info.world
        dist.all_gather_object(got, (ok, msg))
    bad = [(r, m) for r, (k, m) in enumerate(got) if not k]
    if bad:
        raise RankError("could not open the run on every rank: " +
                        "; ".join(f"rank {r}: {m}" for r, m in bad))


def open_ranks(run: str | os.PathLike[str] | Repository | Storage, info: RankInfo, *,
               resume: bool, chunk_bytes: int, encoding: DeltaPolicy | None = None,
               timeout: float = DEFAULT_RANK_TIMEOUT,
               lazy_refs: bool = False) -> tuple[RankWriter, Any]:
    """Open ``run`` on every rank (call on the main thread of all ranks together).

    Returns this rank's ``RankWriter`` and the commit header every rank restores from (rank 0's
    head of the current timeline, or None for a new run). Rank 0 creates the run, takes the
    lock and removes part files a crashed session left; the others open part writers.
    ``lazy_refs``: rank 0's ref is synced by the next barrier (``Writer(lazy_refs=...)``);
    not for callers that publish a pointer of their own after each commit (``latest``).
    """
    if encoding is not None and info.world > 1:
        raise ValueError("encoding (XOR deltas) is not supported with several ranks yet; "
                         "pass encoding=None")
    payload: dict[str, Any]
    writer: Any = None
    if info.rank == 0:
        try:
            repo = run if isinstance(run, Repository) else Repository.create(run)
            writer = repo.writer(chunk_bytes=chunk_bytes, encoding=encoding,
                                 lazy_refs=lazy_refs)
            remove_parts(repo.storage)
            reader = repo.reader()
            head = reader.head()
            if head is not None and not resume:
                raise TimelineError(
                    f"run {repo.storage.location} already has committed steps (timeline "
                    f"{reader.current_timeline!r} is at step {head.step}); pass resume=True to "
                    "continue it, or choose a new run path")
            payload = {"error": None, "base": writer.next_slot, "session": uuid.uuid4().hex,
                       "head": None if head is None else head.slot}
        except BaseException as e:
            if writer is not None:
                writer.close()
            _broadcast({"error": f"{type(e).__name__}: {e}"}, info)
            raise
        _broadcast(payload, info)
    else:
        payload = _broadcast(None, info)
        if payload["error"] is not None:
            raise RankError(f"rank 0 could not open the run: {payload['error']}")
    ok, msg = True, ""
    try:
        if info.rank != 0:
            repo = run if isinstance(run, Repository) else Repository.open(run)
            writer = repo.writer(chunk_bytes=chunk_bytes, exclusive=False, rank=info.rank)
        head = None if payload["head"] is None else writer.reader.header(payload["head"])
    except Exception as e:
        ok, msg = False, f"{type(e).__name__}: {e}"
    try:
        _all_ok(ok, msg, info)
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    rw = RankWriter(writer, info, base_slot=int(payload["base"]), session=payload["session"],
                    timeout=timeout)
    return rw, head
