"""A Lightning ``.ckpt`` file as a :class:`Checkpoint`.

A ``.ckpt`` is a ``torch.save`` dict (loaded with ``weights_only=True``). The model and
optimizer are read as a ``torch.save`` file's (``from_torch.model_checkpoint``: indices named
by the state dict's parameter order, or by ``model=``); the fit loop's progress goes to
``extra/lightning`` as ``dstt.integrations.lightning.DsttCallback`` stores it, the callbacks'
states beside it. A Lightning checkpoint holds no RNG state (``lacks``).

Rejected alternative: Lightning's own ``Trainer.fit(ckpt_path=...)`` machinery to read it —
it needs the LightningModule's code and a Trainer, and imports nothing without them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from dstt import schema
from dstt.errors import SourceError

from .from_torch import model_checkpoint
from .loading import load_pickle

if TYPE_CHECKING:
    import torch

    from .checkpoint import Checkpoint

__all__ = ["FORMAT", "read_lightning", "step_of_lightning"]

FORMAT = "lightning"


def step_of_lightning(path: str) -> int | None:
    """``global_step`` of the file (memory-mapped: only its small objects are read)."""
    try:
        doc = load_pickle(path)
    except Exception:  # importing it reports why
        return None
    k = doc.get("global_step") if isinstance(doc, Mapping) else None
    return k if isinstance(k, int) else None


def read_lightning(
    path: str,
    *,
    step: int | None = None,
    model: torch.nn.Module | None = None,
    trusted: bool = False,
) -> Checkpoint:
    """Read one Lightning ``.ckpt`` (see the module docstring)."""
    doc = load_pickle(path, trusted=trusted)
    if not isinstance(doc, Mapping) or "state_dict" not in doc:
        raise SourceError(f"{path} is not a Lightning checkpoint (no state_dict)")
    k = step if step is not None else doc.get("global_step")
    if not isinstance(k, int):
        raise SourceError(f"{path} has no global_step; pass step=/--step")
    opts = list(doc.get("optimizer_states") or [])
    if len(opts) > 1:
        raise SourceError(
            f"{path} holds {len(opts)} optimizers; dstt imports one per step "
            "(import the weights from a torch.save file instead)"
        )
    ck = model_checkpoint(
        doc["state_dict"],
        opts[0] if opts else None,
        step=k,
        source=os.path.abspath(path),
        fmt=FORMAT,
        model=model,
    )
    scheds = list(doc.get("lr_schedulers") or [])
    ck.scheduler = scheds[0] if len(scheds) == 1 else None
    loops: Mapping[str, Any] = doc.get("loops") or {}
    fit: Mapping[str, Any] = loops.get("fit_loop") or {}
    progress = fit.get("epoch_loop.batch_progress") or {}
    ck.objects[f"{schema.EXTRA_OBJECT}/lightning"] = {
        "fit_loop": dict(fit),
        "epoch_end": bool(progress.get("is_last_batch", False)),
        "callbacks": doc.get("callbacks") or {},
        "epoch": doc.get("epoch"),
        "global_step": doc.get("global_step"),
        "version": doc.get("pytorch-lightning_version"),
    }
    if doc.get("hyper_parameters"):
        ck.objects[f"{schema.EXTRA_OBJECT}/lightning/hparams"] = doc["hyper_parameters"]
    ck.files = {path: os.path.getsize(path)}
    ck.note_lacks()
    return ck
