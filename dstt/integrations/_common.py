"""What both callbacks share: their ``SessionOptions``, unwrapping framework wrappers, metrics.

Kept free of either framework's import so that each callback module pays only for its own.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from dstt.errors import ConfigError
from dstt.training.options import SessionOptions

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "PROGRESS_FIELDS",
    "numeric_metrics",
    "refuse_whole_batches",
    "session_options",
    "unwrap_optimizer",
    "unwrap_scheduler",
]

#: the Trainer's progress kept with each commit (``extra/transformers`` in the run); here,
#: not in ``transformers.py``, so ``dstt import`` reads HF folders without transformers
PROGRESS_FIELDS = (
    "epoch",
    "global_step",
    "num_input_tokens_seen",
    "total_flos",
    "best_metric",
    "best_global_step",
    "train_batch_size",
)


def session_options(
    run: Any, *, every: int | str, resume: bool, options: Mapping[str, Any]
) -> SessionOptions:
    """The ``SessionOptions`` of a callback: ``run``, ``every``, ``resume`` and the
    ``dstt.session`` keywords it passes on — not what the callback finds itself."""
    for bad in ("scheduler", "extra_state", "model", "optimizer"):
        if bad in options:
            raise ConfigError(f"DsttCallback finds the Trainer's {bad} itself; do not pass {bad}=")
    if isinstance(run, str | os.PathLike) and not os.fspath(run):
        raise ConfigError("run must name a directory, e.g. DsttCallback(run='runs/exp1')")
    return SessionOptions.of(run, every=every, resume=resume, **options)


def refuse_whole_batches(reader: Any, batches: Any, framework: str, replay: str) -> None:
    """Refuse, before ``framework`` starts, the skips its count-based resume cannot honour:
    whole ``batches``, or a fresh rollback's ``skip_data``; ``replay``: how to find samples."""
    ref, head = reader.ref(), reader.head()
    if batches or (head is not None and ref.skip_data and head.slot == ref.base_slot):
        raise ConfigError(
            "this timeline skips whole batches (rollback(..., skip_data=N) or "
            f"skip_batches=[...]), which {framework} cannot follow: it resumes by counting the "
            "batches it consumed, so every later resume would land on the wrong batch. Roll back "
            f"with skip_samples=[...] instead (e.g. {replay}.worst(3)): each batch keeps its "
            "place and loses only those samples"
        )


def unwrap_optimizer(opt: Any) -> Any:
    """The torch optimizer under accelerate's ``AcceleratedOptimizer`` (and similar wrappers
    that keep it as ``.optimizer``): its step hooks are the ones that fire."""
    import torch

    seen = 0
    while not isinstance(opt, torch.optim.Optimizer) or (
        hasattr(opt, "optimizer") and isinstance(opt.optimizer, torch.optim.Optimizer)
    ):
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
