"""Several ranks, one run, from the training side: rank and world size from torch.distributed,
and opening the run on every rank together.

``open_ranks`` runs on the main thread of every rank at once: rank 0 creates the run, takes
the lock and removes part files a crashed session left; the others open part writers; one
``broadcast_object_list`` agrees the first slot and the session id, one ``all_gather_object``
checks every rank opened. Those are the only collectives dstt issues, and they run before any
background thread exists. What happens per step — parts, votes, rank 0's merged commit — is
the store's multi-rank commit protocol (``dstt.store.RankWriter``, store/commit.py), which
needs no torch.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from ..errors import RankError, TimelineError
from ..store import (
    DEFAULT_RANK_TIMEOUT,
    DeltaPolicy,
    RankInfo,
    RankTransaction,
    RankWriter,
    Repository,
    Storage,
    TransactionProxy,
    remove_parts,
)

__all__ = ["DEFAULT_RANK_TIMEOUT", "RankInfo", "RankTransaction", "RankWriter", "TransactionProxy",
           "dist_info", "open_ranks"]


def dist_info() -> RankInfo:
    """This process's rank and the world size (``0, 1`` without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size())
    return RankInfo(0, 1)


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
