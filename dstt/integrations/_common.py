"""What both callbacks share: the session options, unwrapping framework wrappers, metrics.

Kept free of either framework's import so that each callback module pays only for its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ["check_every", "check_run", "check_session_options", "numeric_metrics",
           "unwrap_optimizer", "unwrap_scheduler"]


def check_every(every: int) -> int:
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"every must be a positive int, got {every!r}")
    return every


def check_run(run: Any) -> Any:
    if not isinstance(run, str | os.PathLike):
        return run
    if not os.fspath(run):
        raise ConfigError("run must name a directory, e.g. DsttCallback(run='runs/exp1')")
    return run


def check_session_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``dstt.session`` keywords a callback may pass on: not what it finds itself."""
    for bad in ("scheduler", "extra_state", "model", "optimizer"):
        if bad in options:
            raise ConfigError(f"DsttCallback finds the Trainer's {bad} itself; do not pass "
                              f"{bad}=")
    return dict(options)


def unwrap_optimizer(opt: Any) -> Any:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (and similar wrappers
    that keep it as ``.optimizer``): its step hooks are the ones that fire."""
    import torch

    seen = 0
    while not isinstance(opt, torch.optim.Optimizer) or (
            hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer)):
        inner = getattr(opt, "optimizer", None)
        if inner is None or seen > 4:
            break
        opt, seen = inner, seen + 1
    return opt


def unwrap_scheduler(sched: Any) -> Any:
    """The scheduler under accelerate's ``AcceleratedScheduler`` (``.scheduler``)."""
    inner = getattr(sched, "scheduler", None)
    return inner if inner is not None and hasattr(inner, "state_dict") else sched


def numeric_metrics(logs: Mapping[str, Any]) -> dict[str, Any]:
    """The scalar numbers among a framework's logged values (a NaN loss is still filed)."""
    out: dict[str, Any] = {}
    for k, v in logs.items():
        if hasattr(v, "item") and callable(v.item) and getattr(v, "ndim", 0) == 0:
            v = v.item()
        if isinstance(v, bool | int | float):
            out[str(k)] = v
    return out
