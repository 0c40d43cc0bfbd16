"""DeepSpeed: what a DeepSpeed engine holds, per rank, and where its steps begin and end.

``discover_deepspeed`` builds the plain-PyTorch path's two provider sets for one rank: ZeRO
1-3 flat fp32 partitions and their optimizer state (``zero.py``); replicated tensors split
among the ranks by size; module buffers and ``deepspeed/engine``/``deepspeed/meta`` from rank
0; RNG, data position and ``extra_state`` per rank. The wait for step k's copies is a pre-step
hook on the wrapped torch optimizer; capture happens when ``engine.step()`` returns having
taken a step (it is wrapped per instance). Rejected alternative: the wrapped optimizer's
post-step hook (ZeRO calls it once per group). Never imports ``deepspeed`` (detection by
class name). The details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dstt import schema
from dstt.engine.distributed.sharding import OwnedTensors
from dstt.engine.state.model_names import param_names
from dstt.engine.state.optimizers import OptimizerStateProvider
from dstt.engine.state.providers import CompositeProvider, RankObject, RestoreSource, TensorProvider
from dstt.engine.state.torch_state import (
    Stateful,
    TorchState,
    extra_state_objects,
    get_rng,
    model_buffers,
    set_rng,
)
from dstt.engine.tensors._convert import from_plain, to_plain
from dstt.errors import CaptureError, RankError, SchemaError
from dstt.schema import DEEPSPEED_ENGINE_OBJECT, DEEPSPEED_META_OBJECT, tensor_path

from .zero import ZeroState

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from dstt.engine.distributed.ranks import RankInfo

__all__ = [
    "DeepSpeedState",
    "EngineStepHook",
    "discover_deepspeed",
    "is_deepspeed_engine",
    "session_tensors",
]

_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")


def is_deepspeed_engine(obj: Any) -> bool:
    """Whether ``obj`` is a ``deepspeed.DeepSpeedEngine`` (without importing deepspeed)."""
    return any(
        c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed")
        for c in type(obj).__mro__
    )


class _EngineProvider:
    """``deepspeed/engine``: counters, LR scheduler, hyperparameters, loss scaler (rank 0)."""

    def __init__(self, engine: Any, inner: torch.optim.Optimizer, info: RankInfo) -> None:
        self.engine, self.inner, self.info = engine, inner, info

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {}

    def objects(self) -> Mapping[str, Any]:
        if self.info.rank != 0:
            return {}
        e = self.engine
        scaler = getattr(e.optimizer, "loss_scaler", None)
        state = {
            "counters": {k: int(getattr(e, k, 0)) for k in _COUNTERS},
            "lr_scheduler": None if e.lr_scheduler is None else e.lr_scheduler.state_dict(),
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.inner.param_groups
            ],
            "loss_scaler": None
            if scaler is None
            else {k: v for k, v in vars(scaler).items() if isinstance(v, int | float | bool)},
        }
        return {DEEPSPEED_ENGINE_OBJECT: to_plain(state)}

    def restore(self, source: RestoreSource) -> None:
        if not source.has_object(DEEPSPEED_ENGINE_OBJECT):
            raise SchemaError(
                f"step {source.step} has no {DEEPSPEED_ENGINE_OBJECT!r}; it was not "
                "written by a DeepSpeed session"
            )
        state = from_plain(source.object(DEEPSPEED_ENGINE_OBJECT))
        e = self.engine
        for k, v in state["counters"].items():
            setattr(e, k, v)
        if state["lr_scheduler"] is not None and e.lr_scheduler is not None:
            e.lr_scheduler.load_state_dict(state["lr_scheduler"])
        groups = state["param_groups"]
        if len(groups) != len(self.inner.param_groups):
            raise SchemaError(
                f"step {source.step} has {len(groups)} optimizer param groups, "
                f"the engine has {len(self.inner.param_groups)}"
            )
        for live, saved in zip(self.inner.param_groups, groups, strict=True):
            live.update(saved)
        scaler = getattr(e.optimizer, "loss_scaler", None)
        if scaler is not None and state["loss_scaler"]:
            for k, v in state["loss_scaler"].items():
                setattr(scaler, k, v)


class _MetaProvider:
    def __init__(self, stage: int, info: RankInfo) -> None:
        self.stage, self.info = stage, info

    def tensors(self) -> Mapping[str, torch.Tensor]:
        return {}

    def objects(self) -> Mapping[str, Any]:
        if self.info.rank != 0:
            return {}
        return {DEEPSPEED_META_OBJECT: {"format": 1, "world": self.info.world, "stage": self.stage}}

    def restore(self, source: RestoreSource) -> None:
        meta = (
            source.object(DEEPSPEED_META_OBJECT)
            if source.has_object(DEEPSPEED_META_OBJECT)
            else None
        )
        if meta is None:
            raise SchemaError(f"step {source.step} was not written by a DeepSpeed session")
        if (meta["stage"] == 0) != (self.stage == 0):
            raise RankError(
                f"step {source.step} was written with ZeRO stage {meta['stage']} and cannot be "
                f"resumed with stage {self.stage} (ZeRO 1-3 restore into each other and into "
                "any world size; stage 0 only into stage 0). Inspect it with dstt.open(run)."
            )


class DeepSpeedState:
    """The providers of one rank of a DeepSpeed engine (see the module docstring)."""

    def __init__(
        self,
        engine: Any,
        info: RankInfo,
        *,
        extra_state: Mapping[str, Stateful] | None = None,
        extra: Iterable[Any] = (),
    ) -> None:
        self.engine, self.info = engine, info
        self.stage = int(engine.zero_optimization_stage())
        opt = engine.optimizer
        if opt is None:
            raise CaptureError("the DeepSpeed engine has no optimizer; dstt captures training")
        self.zero = ZeroState(engine, info) if self.stage > 0 else None
        inner = opt.optimizer if self.zero is not None else opt
        if not isinstance(inner, torch.optim.Optimizer):
            if self.zero is None:
                raise CaptureError(
                    f"ZeRO stage 0 with fp16/bf16 runs DeepSpeed's {type(opt).__name__}, whose "
                    "master weights dstt does not capture yet; use ZeRO stage 1-3 (or fp32)"
                )
            raise CaptureError(
                f"the engine's optimizer {type(opt).__name__} wraps "
                f"{type(inner).__name__}, not a torch optimizer; dstt needs one "
                "to hook (pass a torch optimizer to deepspeed.initialize)"
            )
        self.inner: torch.optim.Optimizer = inner
        module = engine.module
        names = param_names(module)
        if self.zero is None:
            replicated: list[Any] = [
                TensorProvider(
                    lambda: {tensor_path("params", n): p for n, p in module.named_parameters()}
                ),
                OptimizerStateProvider(inner, names),
            ]
        else:
            frozen = {n: p for n, p in module.named_parameters() if n not in self.zero.shapes}
            if frozen and self.stage == 3:
                raise CaptureError(
                    f"ZeRO-3 parameters outside the optimizer ({sorted(frozen)[:3]}"
                    "...) are not supported yet"
                )
            replicated = [TensorProvider({tensor_path("params", n): p for n, p in frozen.items()})]
        buffers = TensorProvider(lambda: model_buffers(module), snapshot=True)
        step = CompositeProvider(
            [OwnedTensors(replicated, info), OwnedTensors([buffers], info, rank0=True)]
        )
        if self.zero is not None:
            step.add(self.zero)
        step.add(_MetaProvider(self.stage, info))
        for p in extra:
            step.add(p)
        step.add(RankObject(schema.RNG_OBJECT, info, get_rng, set_rng, always_suffix=True))
        boundary = CompositeProvider([_EngineProvider(engine, inner, info)])
        for p in extra_state_objects(extra_state, info, always_suffix=True):
            boundary.add(p)
        self.state = TorchState(step, boundary)

    def restore(self, source: RestoreSource) -> None:
        """Resume from a ``StoreSource`` (every rank restores the same commit): the stage
        check first, then the replicated and per-rank state, the ZeRO partitions, and the
        boundary state (which does not touch RNG: the committed RNG state stays)."""
        providers = self.state.step_state.providers
        meta = next(p for p in providers if isinstance(p, _MetaProvider))
        meta.restore(source)
        for p in providers:
            if p is not self.zero and p is not meta:
                p.restore(source)
        if self.zero is not None:
            self.zero.restore(source)
        self.state.boundary_state.restore(source)


class EngineStepHook:
    """Wraps ``engine.step`` of one engine instance: ``before()`` at entry, ``after()`` once a
    step was taken. ``remove()`` restores the class method."""

    def __init__(self, engine: Any, before: Callable[[], None], after: Callable[[], None]) -> None:
        self.engine = engine
        original = engine.step

        def step(*args: Any, **kwargs: Any) -> Any:
            before()
            taken = engine.global_steps
            out = original(*args, **kwargs)
            if engine.global_steps != taken and engine.was_step_applied():
                after()
            return out

        self._fn = step
        engine.step = step

    def remove(self) -> None:
        if self.engine.__dict__.get("step") is self._fn:
            del self.engine.step


def session_tensors(
    engine: Any, info: RankInfo
) -> tuple[dict[str, torch.Tensor], ZeroState | None]:
    """Every live tensor a session on this rank would capture, by its array path — all of
    them, not the rank's share — and the ``ZeroState`` whose shard map names the ZeRO
    partitions (None at stage 0). The checkpoint engine names what it saves by these."""
    module = engine.module
    stage = int(engine.zero_optimization_stage())
    out: dict[str, torch.Tensor] = dict(model_buffers(module))
    zero = ZeroState(engine, info) if stage > 0 else None
    if zero is None:
        out.update({tensor_path("params", n): p for n, p in module.named_parameters()})
        if isinstance(engine.optimizer, torch.optim.Optimizer):
            out.update(OptimizerStateProvider(engine.optimizer, param_names(module)).tensors())
    else:
        out.update(
            {
                tensor_path("params", n): p
                for n, p in module.named_parameters()
                if n not in zero.shapes
            }
        )
        out.update(zero.tensors())
    return out, zero


def discover_deepspeed(engine: Any, info: RankInfo, **kw: Any) -> DeepSpeedState:
    """``DeepSpeedState`` for ``engine`` on this rank."""
    return DeepSpeedState(engine, info, **kw)
