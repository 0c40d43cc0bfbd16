"""``dstt.session(engine, run=...)`` for a DeepSpeed engine: every rank captures its share.

The lifecycle of the plain-PyTorch ``Session``, with three differences, each delegated to the
engine package: *what* (``dstt.engine.ds.deepspeed``: one rank's ZeRO partitions, RNG, data
position and the engine's counters), *when* (a pre-step hook on the wrapped torch optimizer,
the capture once ``engine.step()`` took a step) and *who commits*
(``dstt.engine.distributed.ranks``: rank 0 merges every rank's durable part). Every rank enters
and leaves together, on a filesystem all ranks share. Rejected alternative: hooking
``engine.save_checkpoint`` only — it runs synchronously on the training thread and at most
every few hundred steps; ``dstt.engine.ds.ds_checkpoint`` offers that path too. Details:
docs/decisions.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dstt import schema
from dstt.engine.ds.deepspeed import DeepSpeedState, EngineStepHook
from dstt.engine.state.dims import DimsOf, ModelDims
from dstt.engine.state.providers import RankObject, StoreSource
from dstt.errors import ConfigError

from .distributed import RankedSession

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.engine.distributed.ranks import RankInfo
    from dstt.engine.state.torch_state import Stateful, TorchState

    from .options import SessionOptions

__all__ = ["DeepSpeedSession"]


class DeepSpeedSession(RankedSession):
    """A capturing session over one rank of a DeepSpeed engine; use ``dstt.session(engine)``."""

    def __init__(
        self,
        engine: Any,
        optimizer: Any = None,
        *,
        options: SessionOptions,
        scheduler: Any = None,
        extra_state: Mapping[str, Stateful] | None = None,
        info: RankInfo | None = None,
    ) -> None:
        if optimizer is not None:
            raise ConfigError(
                "pass the DeepSpeed engine alone: dstt.session(engine, run=...); "
                "it captures the engine's own optimizer"
            )
        self.engine = engine
        if scheduler is not None and scheduler is not engine.lr_scheduler:
            extra_state = {**(extra_state or {}), "scheduler": scheduler}
        self._ds: DeepSpeedState | None = None
        super().__init__(
            engine, None, options=options, scheduler=None, extra_state=extra_state, info=info
        )

    def _dims_of(self) -> DimsOf:
        return ModelDims(self.engine.module)  # the store names the inner model's tensors

    def _discover(self, scheduler: Any, extra_state: Mapping[str, Stateful] | None) -> TorchState:
        data = RankObject(
            schema.DATA_OBJECT, self.info, self._data_state, self._set_data, always_suffix=True
        )
        self._ds = DeepSpeedState(self.engine, self.info, extra_state=extra_state, extra=[data])
        return self._ds.state

    def _restore_state(self, source: StoreSource) -> None:
        assert self._ds is not None
        self._ds.restore(source)

    def _attach(self) -> list[Any]:
        assert self._ds is not None
        cap = self._capture
        return [
            self._ds.inner.register_step_pre_hook(lambda *_: cap.before_step()),
            EngineStepHook(self.engine, cap.at_boundary, cap.after_step),
        ]
