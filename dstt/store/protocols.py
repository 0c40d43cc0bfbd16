"""The contract between the step seam and whatever writes its steps.

``_seam.TransactionSink`` drives the store's ``Writer``, the ``RankWriter`` and the DeepSpeed
checkpoint engine's tag writer. Kept in step by hand through ``Any`` and ``getattr``, they
drifted (``RankWriter`` lacked ``encoder``: a one-rank ``DeltaPolicy`` run wrote every step raw);
these Protocols name, typed, all the sink uses. What a writer can do beyond ``begin`` is a
``runtime_checkable`` *capability* the pipeline tests once: ``FlatStepWriter``,
``EncodingWriter``, ``StoredWriter``, ``OffloadingWriter``. The implementations (``commit/``,
``dstt.engine``) match them structurally, importing nothing from here.

Rejected alternative: ``hasattr``/``getattr`` probes — a renamed attribute silently turned a
capability off, and the type checker could not see the seam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from .format.flat import ArraySpec, FlatImage, FlatLayout, StepBytes

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from .codec.delta import DeltaEncoder, EncodeStats
    from .codec.predict import Prediction
    from .commit.job import RemoteCommitter
    from .format.layout import ChunkPlan
    from .format.objects import Encoding
    from .format.records import ChunkRecord, Metric
    from .format.stepfile import StepFile
    from .storage.base import Storage

__all__ = [
    "ArraySpec",
    "EncodingWriter",
    "FlatStepWriter",
    "OffloadingWriter",
    "StepBytes",
    "StepTransaction",
    "StepWriter",
    "StoredWriter",
]


@runtime_checkable
class StepTransaction(Protocol):
    """One step on its way to a commit (``commit.transaction.Transaction`` and its proxies):
    what ``_seam.TransactionSink`` drives; nothing else in dstt drives it."""

    step: int
    encode: bool  # False: write this step raw (the encode governor's decision)
    keyframe: bool  # True: write this step whole

    @property
    def stats(self) -> EncodeStats: ...

    @property
    def bytes_written(self) -> int: ...

    @property
    def zip(self) -> StepFile: ...

    def declare(
        self, path: str, dtype: str, shape: tuple[int, ...], dims: Sequence[str] | None = None
    ) -> ChunkPlan: ...

    def predict(self, predictions: Mapping[str, Prediction]) -> None: ...

    def put_chunk(self, path: str, index: int, data: StepBytes) -> ChunkRecord | None: ...

    def put_flat(
        self,
        layout: FlatLayout,
        buf: StepBytes,
        images: dict[int, FlatImage] | None = None,
        *,
        start: int | None = None,
    ) -> None: ...

    def put_flat_chunks(self, layout: FlatLayout, buf: StepBytes) -> None: ...

    def reserve_flat(self, layout: FlatLayout, nbytes_at: Callable[[int], int]) -> int: ...

    def complete_flat(
        self,
        layout: FlatLayout,
        offsets: list[int],
        sizes: list[int],
        crcs: list[int],
        directory: bytes,
        buf: StepBytes | None = None,
    ) -> None: ...

    def defer_object(
        self, name: str, obj: object, *, encoding: Encoding = "json", or_pickle: bool = False
    ) -> None: ...

    def commit(self, metrics: Mapping[str, Metric] | None = None) -> object:
        """The step's ``CommitHeader`` — or what a writer that does not commit this step
        returns instead (a rank's ``Part`` vote, one file of a DeepSpeed tag)."""
        ...

    def abort(self) -> None: ...

    @property
    def retryable(self) -> bool: ...  # a failed commit ``reopen`` may run again

    def reopen(self) -> None: ...


@runtime_checkable
class StepWriter(Protocol):
    """What hands out ``StepTransaction`` objects (``commit.writer.Writer``, ``RankWriter``,
    the DeepSpeed checkpoint engine's tag writer)."""

    def begin(self, step: int) -> StepTransaction: ...


@runtime_checkable
class EncodingWriter(Protocol):
    """A writer that may encode deltas: its encoder, or None without ``DeltaPolicy`` (the
    pipeline then never governs encoding)."""

    @property
    def encoder(self) -> DeltaEncoder | None: ...


@runtime_checkable
class FlatStepWriter(StepWriter, EncodingWriter, Protocol):
    """A writer the engine's flat lane can use: it lays out whole steps and says whether it
    encodes (a writer that encodes gets its flat steps written chunk by chunk)."""

    def flat_layout(self, arrays: Sequence[ArraySpec]) -> FlatLayout: ...


@runtime_checkable
class StoredWriter(Protocol):
    """A writer that says where its steps go (the flusher process serves local files)."""

    @property
    def storage(self) -> Storage: ...


@runtime_checkable
class OffloadingWriter(Protocol):
    """A writer whose commits can run in another process: ``_seam.TransactionSink`` sets
    ``committer`` to its flusher (``commit.job.RemoteCommitter``) and back to None at close."""

    committer: RemoteCommitter | None


if TYPE_CHECKING:  # the store's implementations match the contract (checked by mypy)
    from .commit.ranks import RankTransaction, RankWriter
    from .commit.transaction import Transaction
    from .commit.writer import Writer

    def _conforms(w: Writer, rw: RankWriter, t: Transaction, rt: RankTransaction) -> None:
        writers: list[FlatStepWriter] = [w, rw]
        stored: list[StoredWriter] = [w, rw]
        offloading: OffloadingWriter = w
        transactions: list[StepTransaction] = [t, rt]
        del writers, stored, offloading, transactions
