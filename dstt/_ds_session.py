"""``dstt.session(engine, run=...)`` for a DeepSpeed engine: every rank captures its share.

The same lifecycle as the plain-PyTorch ``Session`` (stage after step k, wait before step k+1,
seal, commit in the background), with three differences, each delegated to the engine package:

* *what* — ``dstt.engine.deepspeed`` discovers one rank's state: ZeRO flat partitions of
  master weights and optimizer state, replicated tensors split among ranks, per-rank RNG and
  data position, and the engine's counters, LR scheduler and loss scaler;
* *when* — the wait is a pre-step hook on the wrapped torch optimizer and the capture happens
  when ``engine.step()`` has taken a step;
* *who commits* — ``dstt.engine.ranks``: rank 0 merges every rank's durable part into one
  commit; no collective runs outside ``start`` (one broadcast, main thread).

Every rank must enter and leave the session together (it is collective at ``start``), with the
same ``run`` path on a filesystem all ranks share. ``resume=True`` restores every rank from the
commit rank 0 chose — bit-exact in the same world size and ZeRO stage; ZeRO 1-3 partitions are
resharded from the logical tensors into another world size or stage.
Rejected alternative: hooking ``engine.save_checkpoint`` only — it runs synchronously on the
training thread and at most every few hundred steps; ``dstt.engine.ds_checkpoint`` offers that
path too, for code that already calls it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from ._session_core import DEFAULT_BUDGET, CopyMode, ErrorPolicy, RacePolicy, Session
from .engine.deepspeed import DeepSpeedState, EngineStepHook, per_rank_object
from .engine.dims import DimsOf, ModelDims
from .engine.providers import StoreSource
from .engine.ranks import DEFAULT_RANK_TIMEOUT, RankInfo, dist_info, open_ranks
from .engine.torch_state import Stateful, TorchState
from .errors import DsttWarning
from .store import DeltaPolicy, Repository, Retention, Storage

__all__ = ["DeepSpeedSession"]


class DeepSpeedSession(Session):
    """A capturing session over one rank of a DeepSpeed engine; use ``dstt.session(engine)``."""

    _prefetch_restore = False  # each rank reads only its own partitions
    _tail_on_error = False  # the other ranks may be gone: rank 0 would wait for their parts

    def __init__(self, engine: Any, optimizer: Any = None, *,
                 run: str | os.PathLike[str] | Repository | Storage, every: int = 1,
                 scheduler: Any = None, resume: bool = False,
                 budget_bytes: int = DEFAULT_BUDGET, race_policy: RacePolicy = "raise",
                 verify: bool = False, error_policy: ErrorPolicy = "raise",
                 extra_state: Mapping[str, Stateful] | None = None,
                 writers: int | None = None,
                 max_backlog: int = 16, summaries: bool = True,
                 encoding: DeltaPolicy | None = None, copy: CopyMode = "async",
                 rank_timeout: float = DEFAULT_RANK_TIMEOUT,
                 info: RankInfo | None = None, retention: Retention | None = None) -> None:
        if optimizer is not None:
            raise ValueError("pass the DeepSpeed engine alone: dstt.session(engine, run=...); "
                             "it captures the engine's own optimizer")
        self.engine = engine
        self.info = info or dist_info()
        self.rank_timeout = rank_timeout
        if scheduler is not None and scheduler is not engine.lr_scheduler:
            extra_state = {**(extra_state or {}), "scheduler": scheduler}
        self._ds: DeepSpeedState | None = None
        self._warned_log = False
        super().__init__(engine, None, run=run, every=every, scheduler=None, resume=resume,
                         budget_bytes=budget_bytes, race_policy=race_policy, verify=verify,
                         error_policy=error_policy, extra_state=extra_state, writers=writers,
                         max_backlog=max_backlog, summaries=summaries, encoding=encoding,
                         copy=copy, retention=retention)
        if self.info.rank:  # each rank summarises the params/ arrays it writes
            self.summaries_object = f"{self.summaries_object}/r{self.info.rank}"

    @property
    def rank(self) -> int:
        return self.info.rank

    def _keeps_metrics(self) -> bool:
        """Rank 0 commits each step with its metrics; another rank's ``s.log`` warns once."""
        if self.info.rank == 0:
            return True
        if not self._warned_log:
            self._warned_log = True
            warnings.warn(
                f"dstt: s.log on rank {self.info.rank} is not recorded: rank 0 commits each "
                "step with rank 0's metrics. Reduce the metric to rank 0 (e.g. "
                "torch.distributed.all_reduce) and log it there", DsttWarning, stacklevel=3)
        return False

    def _dims_of(self) -> DimsOf:
        return ModelDims(self.engine.module)  # the store names the inner model's tensors

    def _discover(self, scheduler: Any,
                  extra_state: Mapping[str, Stateful] | None) -> TorchState:
        data = per_rank_object("data", self.info, self._data_state, self._set_data,
                               fallback=True)
        self._ds = DeepSpeedState(self.engine, self.info, extra_state=extra_state,
                                  extra=[data])
        return self._ds.state

    def _open(self, chunk: int) -> tuple[Any, Any, Any]:
        writer, head = open_ranks(self._run_arg, self.info, resume=self.resume,
                                  chunk_bytes=chunk, encoding=self.encoding,
                                  timeout=self.rank_timeout, lazy_refs=True)
        self.repo = writer.repo
        return writer, self.repo.reader(), head

    def _restore_state(self, source: StoreSource, reader: Any, head: Any) -> None:
        assert self._ds is not None
        self._ds.restore(source)

    def _attach(self) -> list[Any]:
        assert self._ds is not None
        return [self._ds.inner.register_step_pre_hook(lambda *_: self._before_step()),
                EngineStepHook(self.engine, self._at_boundary, self._after_step)]
