"""The multi-rank commit: every rank writes its own step file, rank 0 commits once all are durable.

Each rank's pipeline writes through a ``RankWriter``: rank 0 holds the run's lock and its
``commit`` waits (on its committer thread) for every other rank's part manifest of the slot,
polling the store (``parts.collect_parts``), and merges them into one commit; the other ranks'
``commit`` *prepares* (barrier, then the part manifest). Each rank's n-th step takes slot
``base + n``, ``base`` agreed once when the ranks open the run; after that ranks coordinate only
through the store. Rejected alternatives: a gloo barrier per step from the committer thread (a
rank that stops checkpointing would hang every other rank's committer, and per-step collectives
serialise the ranks' flushes); this code in the engine (it knows nothing of torch and is the
store's commit protocol, held to the same contract tests).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dstt.errors import CaptureError, RankLostError

from .parts import abort_vote, collect_parts

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from dstt.store.codec.delta import DeltaEncoder, EncodeStats
    from dstt.store.codec.predict import Prediction
    from dstt.store.format.flat import ArraySpec, FlatImage, FlatLayout, StepBytes
    from dstt.store.format.layout import ChunkPlan
    from dstt.store.format.objects import Encoding
    from dstt.store.format.parts import Part
    from dstt.store.format.records import ChunkRecord, CommitHeader, Metric, ObjectRecord
    from dstt.store.format.stepfile import StepFile
    from dstt.store.storage.base import Storage

    from .transaction import Transaction
    from .writer import RunHandle, Writer

__all__ = ["DEFAULT_RANK_TIMEOUT", "RankInfo", "RankTransaction", "RankWriter", "TransactionProxy"]

DEFAULT_RANK_TIMEOUT = 600.0


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int


class TransactionProxy:
    """Passes what ``_seam.TransactionSink`` uses (``protocols.StepTransaction``), and
    ``put_object``, to a store transaction (or another proxy); subclasses change how the
    step is committed."""

    def __init__(self, txn: Transaction | TransactionProxy) -> None:
        self._txn = txn
        self.slot: int = txn.slot
        self.step: int = txn.step

    def declare(
        self, path: str, dtype: str, shape: tuple[int, ...], dims: Sequence[str] | None = None
    ) -> ChunkPlan:
        return self._txn.declare(path, dtype, shape, dims)

    def put_chunk(self, path: str, index: int, data: StepBytes) -> ChunkRecord | None:
        return self._txn.put_chunk(path, index, data)

    def put_object(self, name: str, obj: object, *, encoding: Encoding = "json") -> ObjectRecord:
        return self._txn.put_object(name, obj, encoding=encoding)

    def defer_object(
        self, name: str, obj: object, *, encoding: Encoding = "json", or_pickle: bool = False
    ) -> None:
        self._txn.defer_object(name, obj, encoding=encoding, or_pickle=or_pickle)

    def put_flat(
        self,
        layout: FlatLayout,
        buf: StepBytes,
        images: dict[int, FlatImage] | None = None,
        *,
        start: int | None = None,
    ) -> None:
        """``start``: a range ``reserve_flat`` reserved, written again here (the flusher
        died mid-write); passed on, not dropped (``_seam.py`` passes it)."""
        self._txn.put_flat(layout, buf, images, start=start)

    def put_flat_chunks(self, layout: FlatLayout, buf: StepBytes) -> None:
        self._txn.put_flat_chunks(layout, buf)

    def reserve_flat(self, layout: FlatLayout, nbytes_at: Callable[[int], int]) -> int:
        return int(self._txn.reserve_flat(layout, nbytes_at))

    def complete_flat(
        self,
        layout: FlatLayout,
        offsets: list[int],
        sizes: list[int],
        crcs: list[int],
        directory: bytes,
        buf: StepBytes | None = None,
    ) -> None:
        self._txn.complete_flat(layout, offsets, sizes, crcs, directory, buf)

    def predict(self, predictions: Mapping[str, Prediction]) -> None:
        self._txn.predict(predictions)

    @property
    def zip(self) -> StepFile:
        return self._txn.zip

    @property
    def keyframe(self) -> bool:
        return bool(self._txn.keyframe)

    @keyframe.setter
    def keyframe(self, value: bool) -> None:
        self._txn.keyframe = value

    def abort(self) -> None:
        self._txn.abort()

    @property
    def encode(self) -> bool:
        return bool(self._txn.encode)

    @encode.setter
    def encode(self, value: bool) -> None:
        self._txn.encode = value

    @property
    def stats(self) -> EncodeStats:
        return self._txn.stats

    @property
    def bytes_written(self) -> int:
        return int(self._txn.bytes_written)

    @property
    def retryable(self) -> bool:
        """False: a rank's failed commit or vote is not run again (its parts moved on)."""
        return False

    def reopen(self) -> None:
        raise CaptureError(f"the commit of step {self.step} of a rank cannot be tried again")


class RankTransaction(TransactionProxy):
    """A store transaction of one rank; ``commit`` merges (rank 0) or prepares (others)."""

    _txn: Transaction

    def __init__(self, owner: RankWriter, txn: Transaction) -> None:
        super().__init__(txn)
        self._owner = owner
        self.slot, self.step, self.rank = txn.slot, txn.step, owner.info.rank

    def abort(self) -> None:
        super().abort()
        o = self._owner
        if o.info.rank != 0 and not o.cancel.is_set():  # rank 0 should not wait for us
            with contextlib.suppress(Exception):
                abort_vote(
                    o.storage,
                    slot=self.slot,
                    step=self.step,
                    rank=o.info.rank,
                    world=o.info.world,
                    session=o.session,
                    error=f"rank {o.info.rank} dropped the step",
                )

    def commit(self, metrics: Mapping[str, Metric] | None = None) -> CommitHeader | Part:
        o = self._owner
        for hook in o.before_commit:
            hook(self)
        if o.info.rank != 0:
            return self._txn.prepare(
                rank=o.info.rank, world=o.info.world, session=o.session, metrics=metrics
            )
        try:
            parts = collect_parts(
                o.storage,
                slot=self.slot,
                step=self.step,
                ranks=range(1, o.info.world),
                world=o.info.world,
                session=o.session,
                timeout=o.wait_left(),
                cancel=o.cancel,
                lost=o.lost_ranks,
            )
        except RankLostError as e:
            o.mark_lost(e.ranks, f"gone since step {self.step}")
            raise
        header = self._txn.commit(metrics, parts=parts)
        for done in o.after_commit:
            done(header)
        return header


class RankWriter:
    """The pipeline-facing writer of one rank (see the module docstring)."""

    def __init__(
        self,
        writer: Writer,
        info: RankInfo,
        *,
        base_slot: int,
        session: str,
        timeout: float = DEFAULT_RANK_TIMEOUT,
    ) -> None:
        self.writer, self.info = writer, info
        self.storage: Storage = writer.storage
        self.base_slot, self.session, self.timeout = base_slot, session, timeout
        self.cancel = threading.Event()
        self._n = 0
        self._lock = threading.Lock()
        #: called on the committer thread: before a commit/prepare (with the transaction) and,
        #: on rank 0, after the global commit (with its header)
        self.before_commit: list[Callable[[RankTransaction], None]] = []
        self.after_commit: list[Callable[[CommitHeader], None]] = []
        #: rank 0: which of the given ranks are known gone (the engine's heartbeat watch);
        #: None: only a rank that missed ``timeout`` is
        self.liveness: Callable[[Sequence[int]], Mapping[int, str]] | None = None
        self._lost: dict[int, str] = {}
        self._deadline: float | None = None

    def give_up_after(self, seconds: float) -> None:
        """Every commit still waiting for parts gives up ``seconds`` from now at the latest
        (rank 0's training raised: the other ranks may never prepare their part)."""
        with self._lock:
            at = time.monotonic() + seconds
            self._deadline = at if self._deadline is None else min(self._deadline, at)

    def wait_left(self) -> float:
        """How long the next commit may wait for the other ranks' parts."""
        with self._lock:
            if self._deadline is None:
                return self.timeout
            return max(0.0, min(self.timeout, self._deadline - time.monotonic()))

    def mark_lost(self, ranks: Sequence[int], why: str) -> None:
        """Remember ``ranks`` as gone: the commits still waiting for them fail at once
        instead of each waiting ``timeout`` (one bounded wait per session, not per step)."""
        with self._lock:
            for r in ranks:
                self._lost.setdefault(r, why)

    def lost_ranks(self, ranks: Sequence[int]) -> dict[int, str]:
        """Which of ``ranks`` are gone: remembered ones, then what ``liveness`` says."""
        with self._lock:
            out = {r: self._lost[r] for r in ranks if r in self._lost}
        rest = [r for r in ranks if r not in out]
        if rest and self.liveness is not None:
            # a watch that fails (its store closed) gives no verdict
            with contextlib.suppress(Exception):
                out.update(self.liveness(rest))
        return out

    @property
    def repo(self) -> RunHandle:
        return self.writer.repo

    @property
    def encoder(self) -> DeltaEncoder | None:
        """The store writer's delta encoder (None without ``DeltaPolicy``): the pipeline
        decides per step from it whether to encode (it read ``None`` here before, so a
        one-rank DeltaPolicy run wrote every step raw)."""
        return self.writer.encoder

    def flat_layout(
        self,
        arrays: Sequence[ArraySpec],
    ) -> FlatLayout:
        return self.writer.flat_layout(arrays)

    def begin(self, step: int) -> RankTransaction:
        with self._lock:
            slot = self.base_slot + self._n
            self._n += 1
        return RankTransaction(self, self.writer.begin(step, slot=slot))

    def close(self) -> None:
        self.cancel.set()
        self.writer.close()
