"""One DeepSpeed checkpoint tag, one dstt transaction: the tag's file flights share it.

``DsttCheckpointEngine`` (``dstt.engine.ds.ds_checkpoint``) stages each ``save(state_dict, path)``
of a tag as a pipeline flight, and ``commit`` stages a final one (the rank's shard map).
``_TagWriter`` hands every flight of the tag the tag's one transaction (``_SharedTxn``: all
flights share one slot): the first flight begins it, only the final flight's ``commit``
commits it, the others return ``_FileDone``. So one tag is one dstt commit.
Rejected alternative: a transaction per file flight — the tag would not be one commit, which
rank 0 makes once every rank's part is durable (``dstt.engine.distributed.ranks``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from dstt.engine.distributed.ranks import RankTransaction, RankWriter, TransactionProxy

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

    from dstt.engine.capture.pipeline import Flight
    from dstt.store._internal import ArraySpec, FlatLayout, Metric

    from ._statedict import SessionPaths

__all__ = ["_Save", "_TagWriter"]


@dataclasses.dataclass
class _Save:
    """One tag on its way to a commit."""

    info: CheckpointCommitInfo
    step: int
    timeline: str
    flights: list[Flight] = dataclasses.field(default_factory=list)
    stubs: list[str] = dataclasses.field(default_factory=list)
    total: int | None = None  # flights including the final one, once known
    begun: int = 0
    txn: RankTransaction | None = None
    names: SessionPaths | None = None
    complete: bool = False  # save_checkpoint returned (known only through ``attach``)


class _FileDone:
    """What a file flight's ``commit`` returns: its part of the tag's transaction is done."""


class _SharedTxn(TransactionProxy):
    """The tag's transaction as seen by one of its flights (all flights share one slot)."""

    _txn: RankTransaction

    def __init__(self, txn: RankTransaction, final: bool) -> None:
        super().__init__(txn)
        self.final = final

    @property
    def encode(self) -> bool:
        return False  # a tag's files are written raw

    @encode.setter
    def encode(self, value: bool) -> None:
        pass

    def commit(self, metrics: Mapping[str, Metric] | None = None) -> object:
        """The tag's commit (its header or this rank's vote) from the final flight."""
        return self._txn.commit(metrics) if self.final else _FileDone()


class _TagWriter:
    """Pipeline-facing writer: every flight of a tag writes into the tag's one transaction."""

    def __init__(self, rw: RankWriter, saves: dict[int, _Save]) -> None:
        self.rw, self.saves = rw, saves

    encoder: None = None  # a tag's files are written raw (``_SharedTxn.encode``)

    def flat_layout(self, arrays: Sequence[ArraySpec]) -> FlatLayout:
        return self.rw.flat_layout(arrays)

    def begin(self, step: int) -> _SharedTxn:
        save = self.saves[step]  # added before its first flight was staged
        if save.txn is None:
            save.txn = self.rw.begin(step)
        save.begun += 1
        return _SharedTxn(save.txn, final=save.total is not None and save.begun == save.total)
