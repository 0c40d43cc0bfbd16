"""A ``torch.save`` file (or a safetensors file) as a :class:`Checkpoint`.

Two layouts are understood: a bare model state dict (``torch.save(model.state_dict(), f)``)
and a dict of parts — the model under ``model``/``state_dict``/``model_state_dict``/``module``,
the optimizer under ``optimizer``/``optimizer_state_dict``/``optim``, the scheduler under
``scheduler``/``lr_scheduler``, the step under ``step``/``global_step``/``iteration``. The
file is loaded with ``torch.load(weights_only=True)`` (``loading``). The optimizer's indices
are named by the model state dict's own order (``state_dict()`` order is ``named_parameters()``
order), or by ``model=``'s (``naming``). The step: ``step=``, else a number in the file name
(``step_1200.pt``, ``ckpt-1200.pt``), else the file's own step key.
Rejected alternative: guessing among every nested dict for tensors — a file whose layout is
not one of the above is refused with what was found, so nothing is imported half-understood.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from dstt import schema
from dstt.errors import SourceError

from .checkpoint import Checkpoint, NamedOptimizer, split_by_model, step_in_name
from .loading import load_pickle, read_safetensors
from .naming import group_names, trainable_names

__all__ = [
    "FORMAT",
    "MODEL_KEYS",
    "OPTIMIZER_KEYS",
    "SCHEDULER_KEYS",
    "STEP_KEYS",
    "model_checkpoint",
    "read_torch",
    "step_of_torch",
]

FORMAT = "torch"
MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler")
STEP_KEYS = ("step", "global_step", "iteration")


def _first(doc: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    return next((doc[k] for k in keys if k in doc), None)


def _is_state_dict(x: Any) -> bool:
    return (
        isinstance(x, Mapping)
        and bool(x)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in x.items())
    )


def _load(path: str, trusted: bool) -> Any:
    if path.endswith(".safetensors"):
        return read_safetensors([path])
    return load_pickle(path, trusted=trusted)


def step_of_torch(path: str, doc: Any = None) -> int | None:
    """The step of a file: its name's, else its step key's (the file is loaded lazily,
    memory-mapped)."""
    named = step_in_name(os.path.basename(path))
    if named is not None:
        return named
    if doc is None:
        try:
            doc = _load(path, False)
        except Exception:  # no step found; importing it reports why
            return None
    k = _first(doc, STEP_KEYS) if isinstance(doc, Mapping) else None
    if isinstance(k, torch.Tensor) and k.numel() == 1:
        k = int(k.item())
    return k if isinstance(k, int) and not isinstance(k, bool) else None


def model_checkpoint(
    sd: Mapping[str, torch.Tensor],
    osd: Any,
    *,
    step: int,
    source: str,
    fmt: str,
    model: torch.nn.Module | None,
) -> Checkpoint:
    """A checkpoint of a model state dict and an index-keyed optimizer state dict (or None),
    named by ``model=`` or by the state dict's order (what ``from_torch`` and
    ``from_lightning`` share)."""
    params, buffers, tied = split_by_model(sd, model, where=source)
    order = trainable_names(model) if model is not None else list(params)
    ck = Checkpoint(
        step=step, source=source, format=fmt, params=params, buffers=buffers, model=model
    )
    if osd is not None:
        shapes = {n: tuple(t.shape) for n, t in {**params, **buffers}.items()}
        ck.optimizer = NamedOptimizer.of(osd, group_names(osd, order, shapes, where=source))
    if tied:
        ck.objects[schema.TIED_OBJECT] = tied
    return ck


def read_torch(
    path: str,
    *,
    step: int | None = None,
    model: torch.nn.Module | None = None,
    trusted: bool = False,
) -> Checkpoint:
    """Read one ``torch.save``/safetensors file (see the module docstring)."""
    doc = _load(path, trusted)
    if _is_state_dict(doc):
        sd, osd, sched = doc, None, None
    elif isinstance(doc, Mapping) and _is_state_dict(_first(doc, MODEL_KEYS)):
        sd, osd, sched = (
            _first(doc, MODEL_KEYS),
            _first(doc, OPTIMIZER_KEYS),
            _first(doc, SCHEDULER_KEYS),
        )
    else:
        keys = sorted(map(str, doc))[:8] if isinstance(doc, Mapping) else type(doc).__name__
        raise SourceError(
            f"{path} is neither a model state dict nor a dict with one of "
            f"{', '.join(MODEL_KEYS)} (found: {keys})"
        )
    k = step if step is not None else step_of_torch(path, doc)
    if k is None:
        raise SourceError(f"{path}: no step in its name or contents; pass step=/--step")
    ck = model_checkpoint(sd, osd, step=k, source=os.path.abspath(path), fmt=FORMAT, model=model)
    ck.scheduler = sched
    ck.files = {path: os.path.getsize(path)}
    ck.note_lacks()
    return ck
