"""Sessions with several ranks: the same ``dstt.session(...)`` call on every rank.

``RankedSession`` is what every multi-rank session shares: the ranks agree on the run and
options and rank 0 takes the lock (``dstt.engine.distributed.ranks.open_ranks``); each rank
writes its share of a step and votes, rank 0 commits once every part is durable; rank 0's
``s.log`` goes with the commit; every rank restores from the commit rank 0 chose, reading only
what it holds. ``DistributedSession`` is the PyTorch-native one (DDP, FSDP2, tensor parallel, a
DTensor model on one process); ``DeepSpeedSession`` (``dstt.training.deepspeed``) the DeepSpeed
one. Rejected alternative: a session on rank 0 only, gathering state to it — every step would
need a collective and rank 0 would write every byte; and a resume would restore rank 0 alone.
Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from dstt import schema
from dstt.engine.distributed.parallel import ParallelState
from dstt.engine.distributed.ranks import RankChannel, RankInfo, RankWriter, dist_info, open_ranks
from dstt.engine.distributed.sharding import check_layout
from dstt.engine.state.dims import DimsOf, ModelDims
from dstt.engine.state.providers import RankObject, StoreSource
from dstt.errors import ConfigError, RankError
from dstt.store._internal import Repository

from .session import Session

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from dstt.engine.state.torch_state import Stateful, TorchState

    from .options import SessionOptions

__all__ = ["DistributedSession", "RankedSession"]

#: after this rank 0's training raised, how long it waits for the others' parts of the steps
#: they finished (a rank stuck in a collective that rank 0 left never sends its part)
_ERROR_GRACE_S = 30.0


class RankedSession(Session):
    """What every session of one rank among several shares (see the module docstring)."""

    _prefetch_restore = False  # each rank reads only what it holds
    # after an exception a finished step is still committed, as with one process: rank 0
    # waits for gone ranks once at most (RankLostError), not rank_timeout per step

    def __init__(
        self,
        model: Any,
        optimizer: Any = None,
        *,
        options: SessionOptions,
        scheduler: Any = None,
        extra_state: Mapping[str, Stateful] | None = None,
        info: RankInfo | None = None,
    ) -> None:
        self.info = info or dist_info()
        self.channel = RankChannel(self.info, timeout=options.rank_timeout)
        super().__init__(
            model, optimizer, options=options, scheduler=scheduler, extra_state=extra_state
        )
        if options.every == "auto" and self.info.world > 1:
            self._capture.agree = self._all_can_take
        if self.info.rank:  # each rank summarises the arrays it writes
            self.summaries_object = f"{self.summaries_object}/r{self.info.rank}"

    def _all_can_take(self, step: int, ok: bool) -> bool:
        """``every="auto"`` on several ranks: store ``step`` only if every rank's engine can
        take it now (one small gather through the session's own channel, on the training
        thread, per optimizer step), so every rank stores the same steps. Rejected: rank 0
        deciding alone — another rank's busy engine would then block its training."""
        got = self.channel.gather(
            f"auto/{step}", bool(ok), what=f"whether step {step} is stored (every='auto')"
        )
        return all(got)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world(self) -> int:
        return self.info.world

    def _keeps_metrics(self) -> bool:
        """Rank 0 commits each step with its metrics; ``s.log`` on another rank is ignored,
        so the usual loop that logs on every rank needs no ``if rank == 0`` (reduce a metric
        that differs per rank to rank 0 first if its mean is what you want)."""
        return self.info.rank == 0

    def _agreed(self) -> dict[str, Any]:
        """Options every rank must share (the run and ``resume`` are always checked)."""
        o = self.options
        return {"every": o.every, "encoding": o.encoding is not None, "kind": type(self).__name__}

    def close(self, exc: BaseException | None = None) -> None:
        """Commit the last step and release the run; with several ranks every rank returns
        once rank 0 has committed (or failed to commit) the last step, so what follows the
        ``with`` block on any rank sees the run complete. After an exception only rank 0
        says how it ended (the others may be gone) and no rank waits."""
        if self._closed or not self._started:
            return
        failure: BaseException | None = None
        if exc is not None and self.info.rank == 0 and isinstance(self._writer, RankWriter):
            # the others may be stuck (a collective this rank left): wait for them once, briefly
            self._writer.give_up_after(min(self.options.rank_timeout, _ERROR_GRACE_S))
        try:
            super().close(exc)
        except BaseException as e:
            failure = e
            raise
        finally:
            if self.info.world > 1:
                try:
                    self._close_together(exc, failure)
                finally:
                    err = exc or failure
                    self.channel.leave("closed" if err is None else f"{type(err).__name__}: {err}")

    def _close_together(self, exc: BaseException | None, failure: BaseException | None) -> None:
        if self.info.rank == 0:
            with contextlib.suppress(Exception):  # best effort: the others wait otherwise
                self.channel.share(
                    "closed",
                    {"error": None if failure is None else f"{type(failure).__name__}: {failure}"},
                )
            return
        if exc is not None or failure is not None:
            return
        said = self.channel.share("closed", what="last commit (from rank 0)")
        if said.get("error"):
            raise RankError(f"rank 0 could not commit the last steps: {said['error']}")

    def _open(self, chunk: int) -> tuple[Any, Any, Any]:
        o = self.options
        writer, head = open_ranks(
            o.run,
            self.info,
            resume=o.resume,
            chunk_bytes=chunk,
            encoding=o.encoding,
            timeout=o.rank_timeout,
            lazy_refs=True,
            agree=self._agreed(),
            channel=self.channel,
            start_timeout=o.start_timeout,
        )
        self.channel.start_heartbeat()
        if self.info.rank == 0:  # its committer gives up at once on a rank that is gone
            writer.liveness = self.channel.lost
        repo = writer.repo  # the store names a writer's run by a protocol (``RunHandle``)
        assert isinstance(repo, Repository)
        self.repo = repo
        return writer, repo.reader(), head


class DistributedSession(RankedSession):
    """A capturing session over one rank of a PyTorch-native parallel trainer (DDP, FSDP2,
    tensor parallel); use ``dstt.session(model, optimizer, ...)`` on every rank."""

    def __init__(
        self,
        model: torch.nn.Module | None,
        optimizer: Any = None,
        *,
        options: SessionOptions,
        scheduler: Any = None,
        extra_state: Mapping[str, Stateful] | None = None,
        info: RankInfo | None = None,
    ) -> None:
        if model is None:
            raise ConfigError(
                "a distributed session needs the model: dstt.session(model, "
                "optimizer, run=...) on every rank"
            )
        self._parallel: ParallelState | None = None
        super().__init__(
            model,
            optimizer,
            options=options,
            scheduler=scheduler,
            extra_state=extra_state,
            info=info,
        )

    def _dims_of(self) -> DimsOf:
        return ModelDims(self.model)

    def _discover(self, scheduler: Any, extra_state: Mapping[str, Stateful] | None) -> TorchState:
        assert self.model is not None
        data = RankObject(schema.DATA_OBJECT, self.info, self._data_state, self._set_data)
        self._parallel = ParallelState(
            self.model,
            self.optimizers_arg(),
            self.info,
            self.channel,
            scheduler=scheduler,
            extra_state=extra_state,
            extra=[data],
        )
        return self._parallel.state

    def _open(self, chunk: int) -> tuple[Any, Any, Any]:
        opened = super()._open(chunk)
        assert self._parallel is not None
        # pipeline stages (ranks holding different parameters) store their own structure
        self._parallel.layout.decide(self.channel, self._parallel.names)
        return opened

    def _restore_state(self, source: StoreSource) -> None:
        assert self._parallel is not None
        check_layout(source, self._parallel.layout.params, world=self.info.world)
        self._state.step_state.restore(source)
        self._state.boundary_state.restore(source)
