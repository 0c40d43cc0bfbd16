"""The contract between the capture engine and whatever writes its steps.

The engine's pipeline drives one of three writers: the store's ``Writer`` (one rank), the
engine's ``RankWriter`` (several ranks: its transactions prepare or merge parts) and the
DeepSpeed checkpoint engine's tag writer (several files of one tag share a transaction). They
were kept in step by hand, through ``Any`` and ``getattr``, and drifted: ``RankWriter`` lacked
``encoder``, so a one-rank ``DeltaPolicy`` run silently wrote every step raw. These Protocols
name everything the pipeline uses; ``tests/engine/test_writer_contract.py`` runs the same
capture through every implementation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from .codec.delta import EncodeStats
from .codec.predict import Prediction
from .format.flat import FlatLayout
from .format.layout import ChunkPlan
from .format.records import CommitHeader, Metric
from .format.stepfile import StepFile

__all__ = ["FlatStepWriter", "StepTransaction", "StepWriter"]


@runtime_checkable
class StepTransaction(Protocol):
    """One step on its way to a commit (``store.writer.Transaction`` and its proxies)."""

    slot: int
    step: int
    encode: bool  # False: write this step raw (the encode governor's decision)
    keyframe: bool  # True: write this step whole

    @property
    def stats(self) -> EncodeStats: ...

    @property
    def bytes_written(self) -> int: ...

    @property
    def zip(self) -> StepFile: ...

    def declare(self, path: str, dtype: str, shape: tuple[int, ...],
                dims: Sequence[str] | None = None) -> ChunkPlan: ...

    def predict(self, predictions: Mapping[str, Prediction]) -> None: ...

    def put_chunk(self, path: str, index: int, data: Any) -> Any: ...

    def put_flat(self, layout: FlatLayout, buf: Any, images: Any = None) -> None: ...

    def put_flat_chunks(self, layout: FlatLayout, buf: Any) -> None: ...

    def reserve_flat(self, layout: FlatLayout, nbytes_at: Callable[[int], int]) -> int: ...

    def complete_flat(self, layout: FlatLayout, offsets: list[int], sizes: list[int],
                      crcs: list[int], directory: bytes, buf: Any = None) -> None: ...

    def put_object(self, name: str, obj: Any, *, encoding: Any = "json") -> Any: ...

    def put_encoded(self, name: str, data: bytes, encoding: Any = "json") -> Any: ...

    def defer_object(self, name: str, obj: Any, *, encoding: Any = "json",
                     or_pickle: bool = False) -> None: ...

    @property
    def deferred(self) -> Sequence[Any]: ...  # the objects stored at commit (``Deferred``)

    def commit(self, metrics: Mapping[str, Metric] | None = None) -> CommitHeader | Any: ...

    def abort(self) -> None: ...


@runtime_checkable
class StepWriter(Protocol):
    """What hands out ``StepTransaction`` objects (``store.writer.Writer``, ``RankWriter``,
    the DeepSpeed checkpoint engine's tag writer)."""

    def begin(self, step: int) -> StepTransaction: ...


@runtime_checkable
class FlatStepWriter(StepWriter, Protocol):
    """A writer the engine's flat lane can use: it lays out whole steps and says whether it
    encodes (a writer that encodes gets the chunk lane)."""

    @property
    def encoder(self) -> Any: ...  # the DeltaEncoder, or None without DeltaPolicy

    def flat_layout(self, arrays: Sequence[tuple[str, str, tuple[int, ...]]
                                           | tuple[str, str, tuple[int, ...],
                                                   Sequence[str] | None]]) -> FlatLayout: ...
