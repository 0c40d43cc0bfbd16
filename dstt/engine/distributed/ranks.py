"""Several ranks, one run, from the training side: rank and world size, the ranks' channel,
and opening the run on every rank together.

Ranks talk through a ``RankChannel``: small JSON messages in the default group's key-value
store, each read with a deadline, so a missing or late rank is a ``RankError`` naming it, never
a hang, and nothing uses the communicator. ``open_ranks`` runs on every rank at once: the
ranks must agree on the run and options, rank 0 creates and locks it, every rank learns the
first slot, the session id and the commit to restore. Per step the store's ``RankWriter``
protocol takes over. Rejected alternative: ``broadcast_object_list`` on the default group (a
rank that never joins blocks the others for the group's timeout; NCCL needs a device).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
import uuid
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dstt.errors import DsttWarning, RankError, TimelineError
from dstt.store._internal import (
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

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

__all__ = [
    "DEFAULT_RANK_TIMEOUT",
    "DEFAULT_START_TIMEOUT",
    "RankChannel",
    "RankInfo",
    "RankTransaction",
    "RankWriter",
    "TransactionProxy",
    "dist_info",
    "open_ranks",
    "run_identity",
]

#: a wait longer than this says whom it waits for (then goes on waiting until its deadline)
_NOTICE_S = 30.0
#: how long the ranks wait for each other to start a session (a session on some ranks only)
DEFAULT_START_TIMEOUT = 60.0
#: a rank beats this often; one silent for ``_STALE_S`` (or half ``rank_timeout``) is gone
_BEAT_S = 1.0
_STALE_S = 30.0
_channels = itertools.count()  # every process opens its sessions in the same order


def dist_info() -> RankInfo:
    """This process's rank and the world size (``0, 1`` without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size())
    return RankInfo(0, 1)


class RankChannel:
    """JSON messages between the ranks of one session (see the module docstring).

    ``gather(key, value)`` posts this rank's value and returns every rank's, by rank;
    ``share(key, value)`` posts rank 0's value (others pass None) and returns it on every
    rank. Each key is used once per channel. A channel of one rank needs no store.
    """

    def __init__(
        self,
        info: RankInfo,
        *,
        timeout: float = DEFAULT_RANK_TIMEOUT,
        store: Any = None,
        name: str | None = None,
    ) -> None:
        self.info, self.timeout = info, float(timeout)
        self._store = None
        if info.world > 1:
            if store is None:
                store = _default_store()
            import torch.distributed as dist

            self._store = dist.PrefixStore(f"dstt/{name or next(_channels)}/", store)

        self._beat: threading.Thread | None = None
        self._stop = threading.Event()
        self._seen: dict[int, tuple[bytes, float]] = {}

    def gather(
        self, key: str, value: Any, *, what: str = "answer", timeout: float | None = None
    ) -> list[Any]:
        if self._store is None:
            return [value]
        self._store.set(f"{key}/{self.info.rank}", json.dumps(value))
        keys = [f"{key}/{r}" for r in range(self.info.world)]
        self._wait(keys, what, timeout=timeout)
        return [json.loads(v) for v in self._store.multi_get(keys)]

    # -- liveness: a heartbeat per rank, a mark when a rank leaves --------------------------
    def start_heartbeat(self) -> None:
        """Beat every ``_BEAT_S`` on a daemon thread until ``leave`` (a rank killed stops)."""
        if self._store is None or self._beat is not None:
            return
        store, key = self._store, f"beat/{self.info.rank}"

        def beat() -> None:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    store.set(key, str(n))
                except Exception:  # the store went away (the process group ended)
                    return
                self._stop.wait(_BEAT_S)

        self._beat = threading.Thread(target=beat, name="dstt-heartbeat", daemon=True)
        self._beat.start()

    def leave(self, why: str) -> None:
        """Stop beating and say this rank's session ended (``why``), so a committer waiting
        for this rank's parts gives up at once instead of at its timeout."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5.0)
        if self._store is not None:
            with contextlib.suppress(Exception):
                self._store.set(f"left/{self.info.rank}", json.dumps(why))

    def lost(self, ranks: Sequence[int]) -> dict[int, str]:
        """Which of ``ranks`` are gone: they left their session, or their heartbeat has not
        changed for ``min(_STALE_S, timeout / 2)`` seconds (killed, or the host is gone), so a
        killed rank is noticed before a wait for it times out. A rank that never beat counts
        from the first time it was asked about."""
        if self._store is None or not ranks:
            return {}
        store = self._store
        out = {
            r: f"its session ended: {json.loads(store.get(f'left/{r}'))}"
            for r in ranks
            if store.check([f"left/{r}"])
        }
        stale = min(_STALE_S, self.timeout / 2)
        now = time.monotonic()
        for r in ranks:
            if r in out:
                continue
            key = f"beat/{r}"
            value = store.get(key) if store.check([key]) else b""
            last = self._seen.get(r)
            if last is None or last[0] != value:
                self._seen[r] = (value, now)
            elif now - last[1] > stale:
                out[r] = f"no heartbeat for {now - last[1]:.0f} s (killed, hung or unreachable)"
        return out

    def share(self, key: str, value: Any = None, *, what: str = "answer") -> Any:
        if self._store is None:
            return value
        if self.info.rank == 0:
            self._store.set(key, json.dumps(value))
            return value
        self._wait([key], what, ranks=[0])
        return json.loads(self._store.get(key))

    def _wait(
        self,
        keys: Sequence[str],
        what: str,
        ranks: Sequence[int] | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        assert self._store is not None
        limit = self.timeout if timeout is None else float(timeout)
        deadline = time.monotonic() + limit
        noticed = False
        while True:
            left = deadline - time.monotonic()
            try:
                self._store.wait(list(keys), timedelta(seconds=max(0.001, min(left, _NOTICE_S))))
                return
            except Exception as e:  # a timeout (DistStoreError) or a store gone away
                if not _is_timeout(e):
                    raise RankError(
                        f"rank {self.info.rank}: the ranks' store failed while "
                        f"waiting for their {what} ({type(e).__name__}: {e})"
                    ) from e
            missing = self._missing(keys, ranks)
            if time.monotonic() >= deadline:
                setting = "rank_timeout" if timeout is None else "start_timeout or rank_timeout"
                raise RankError(
                    f"rank {self.info.rank}: ranks {missing} did not send their {what} within "
                    f"{limit:.0f} s. Every rank must run the same dstt.session(...) (or "
                    "callback) at the same point of training: a session on some ranks only "
                    "cannot commit; a rank that crashed or stalls holds the others up "
                    f"({setting}= sets the wait)"
                )
            if not noticed:
                noticed = True
                warnings.warn(
                    f"dstt: rank {self.info.rank} has waited {_NOTICE_S:.0f} s for "
                    f"the {what} of ranks {missing}; still waiting (up to "
                    f"{limit:.0f} s)",
                    DsttWarning,
                    stacklevel=4,
                )

    def _missing(self, keys: Sequence[str], ranks: Sequence[int] | None) -> list[int]:
        assert self._store is not None
        if ranks is not None:
            return list(ranks)
        return [int(k.rsplit("/", 1)[1]) for k in keys if not self._store.check([k])]


def _is_timeout(e: Exception) -> bool:
    text = f"{type(e).__name__} {e}".lower()
    return "timeout" in text or "timed out" in text


def _default_store() -> Any:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not (dist.is_available() and dist.is_initialized()):
        raise RankError(
            "several ranks need an initialized torch.distributed process group "
            "(torch.distributed.init_process_group, or torchrun)"
        )
    get = getattr(distributed_c10d, "_get_default_store", None)
    if get is None:  # pragma: no cover - every torch dstt supports has it
        raise RankError(
            "this torch.distributed has no default store; dstt cannot coordinate its ranks"
        )
    return get()


def run_identity(run: str | os.PathLike[str] | Repository | Storage) -> str:
    """What every rank must agree on about ``run``: its location (an absolute path or URL)."""
    if isinstance(run, Repository):
        return str(run.storage.location)
    if isinstance(run, Storage):
        return str(run.location)
    text = os.fspath(run)
    return text if "://" in text else os.path.abspath(text)


def _disagreements(said: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for key in sorted(said[0]):
        values = [s.get(key) for s in said]
        if any(v != values[0] for v in values):
            per = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            out.append(f"{key} ({per})")
    return out


def open_ranks(
    run: str | os.PathLike[str] | Repository | Storage,
    info: RankInfo,
    *,
    resume: bool,
    chunk_bytes: int,
    encoding: DeltaPolicy | None = None,
    timeout: float = DEFAULT_RANK_TIMEOUT,
    lazy_refs: bool = False,
    agree: Mapping[str, Any] | None = None,
    channel: RankChannel | None = None,
    start_timeout: float = DEFAULT_START_TIMEOUT,
) -> tuple[RankWriter, Any]:
    """Open ``run`` on every rank (call on the main thread of all ranks together).

    Returns this rank's ``RankWriter`` and the commit header every rank restores from (rank 0's
    head of the current timeline, or None for a new run). Rank 0 creates the run, takes the
    lock and removes part files a crashed session left; the others open part writers.
    ``agree``: settings every rank must share (``every``, ...; the run's location and
    ``resume`` always are), checked before anything is opened. ``lazy_refs``: rank 0's ref is
    synced by the next barrier (``Writer(lazy_refs=...)``); not for callers that publish a
    pointer of their own after each commit (``latest``). ``start_timeout``: how long the
    ranks wait for each other to arrive (a session started on some ranks only fails then);
    ``timeout`` bounds every later wait.
    """
    if encoding is not None and info.world > 1:
        raise ValueError(
            "encoding (XOR deltas) is not supported with several ranks yet; pass encoding=None"
        )
    ch = channel or RankChannel(info, timeout=timeout)
    said = ch.gather(
        "hello",
        {"run": run_identity(run), "resume": bool(resume), "world": info.world, **(agree or {})},
        what="dstt.session start",
        timeout=min(start_timeout, timeout),
    )
    bad = _disagreements(said)
    if bad:
        raise RankError(
            "the ranks started dstt sessions that disagree on "
            + "; ".join(bad)
            + ": every rank must pass the same run and options"
        )
    writer: Any = None
    if info.rank == 0:
        try:
            repo = run if isinstance(run, Repository) else Repository.create(run)
            writer = repo.writer(chunk_bytes=chunk_bytes, encoding=encoding, lazy_refs=lazy_refs)
            remove_parts(repo.storage)
            reader = repo.reader()
            head = reader.head()
            if head is not None and not resume:
                raise TimelineError(
                    f"run {repo.storage.location} already has committed steps (timeline "
                    f"{reader.current_timeline!r} is at step {head.step}); pass resume=True to "
                    "continue it, or choose a new run path"
                )
            payload: dict[str, Any] = {
                "error": None,
                "base": writer.next_slot,
                "session": uuid.uuid4().hex,
                "head": None if head is None else head.slot,
            }
        except BaseException as e:
            if writer is not None:
                writer.close()
            ch.share("opened", {"error": f"{type(e).__name__}: {e}"})
            raise
        ch.share("opened", payload)
    else:
        payload = ch.share("opened", what="run (from rank 0)")
        if payload["error"] is not None:
            raise RankError(f"rank 0 could not open the run: {payload['error']}")
    ok, msg = True, ""
    head = None
    try:
        if info.rank != 0:
            repo = run if isinstance(run, Repository) else Repository.open(run)
            writer = repo.writer(chunk_bytes=chunk_bytes, exclusive=False, rank=info.rank)
        head = None if payload["head"] is None else writer.reader.header(payload["head"])
    except Exception as e:
        ok, msg = False, f"{type(e).__name__}: {e}"
    try:
        got = ch.gather("ready", [ok, msg], what="opened run")
        failed = [(r, m) for r, (k, m) in enumerate(got) if not k]
        if failed:
            raise RankError(
                "could not open the run on every rank: "
                + "; ".join(f"rank {r}: {m}" for r, m in failed)
            )
    except BaseException:
        if writer is not None:
            writer.close()
        raise
    rw = RankWriter(
        writer, info, base_slot=int(payload["base"]), session=payload["session"], timeout=timeout
    )
    return rw, head
