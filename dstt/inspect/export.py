"""Export one commit as a plain PyTorch state dict (``safetensors`` or ``torch.save``).

The model's tensors (``params/`` and ``buffers/``) are written under their dotted names, so
``model.load_state_dict(safetensors.torch.load_file(path))`` works; with ``include_all`` every
other array (optimizer states, user arrays) is added under its store path. Values keep their
stored dtype (bfloat16 stays bfloat16, bit for bit). torch and safetensors are imported only
here, on demand. Rejected alternative: exporting a DCP / DeepSpeed checkpoint directory — their
layouts depend on the parallelism at save time; a flat state dict is what every tool loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

import numpy as np

from .naming import MODEL_KINDS, user_name

__all__ = ["FORMATS", "export_commit"]

FORMATS = ("safetensors", "torch")
Format = Literal["safetensors", "torch"]


def _to_torch(arr: np.ndarray, store_dtype: str) -> Any:
    import torch

    arr = arr if arr.flags.c_contiguous else arr.copy(order="C")  # keeps 0-d tensors 0-d
    if store_dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def export_commit(reader: Any, header: Any, out: str | os.PathLike[str], fmt: Format, *,
                  include_all: bool = False,
                  progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write commit ``header`` to ``out``; returns ``{"tensors": n, "bytes": b, "path": out}``."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    table = reader.arrays(header)
    paths = [p for p in sorted(table) if include_all or p.split("/")[0] in MODEL_KINDS]
    tensors: dict[str, Any] = {}
    nbytes = 0
    for p in paths:
        rec = table[p]
        tensors[user_name(p)] = _to_torch(reader.read_array(header, p), rec.dtype)
        nbytes += rec.plan.nbytes
        if progress:
            progress(rec.plan.nbytes)
    meta = {"dstt_step": str(header.step), "dstt_timeline": header.timeline,
            "dstt_slot": str(header.slot)}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(tensors, os.fspath(out), metadata=meta)
    else:
        import torch

        torch.save(tensors, os.fspath(out))
    return {"tensors": len(tensors), "bytes": nbytes, "path": os.fspath(out)}
