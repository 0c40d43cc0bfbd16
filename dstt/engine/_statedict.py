"""State dicts as (array paths → live tensors) plus a picklable skeleton, and back.

DeepSpeed hands checkpoint engines nested state dicts (module weights, ZeRO partitions, the
optimizer's ``state_dict()``, loss scalers, configs). ``flatten`` keeps the tensors *live* —
the engine copies them lazily like any captured tensor — and replaces each by a placeholder
naming its array path, derived from the dict keys (sanitised to valid path segments, made
unique). Tensors of at most ``INLINE_NUMEL`` elements (Adam's ``step``) stay inside the
skeleton as tagged bytes: a chunk file per 0-d tensor per step would cost ~1 ms each.
``rebuild`` reverses it with a reader callback. Rejected alternative: ``torch.save`` of the
skeleton with tensors — the bytes would bypass the chunked, checksummed, lazy store.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from ._convert import from_plain, store_dtype, to_plain

__all__ = ["INLINE_NUMEL", "flatten", "rebuild", "segment"]

INLINE_NUMEL = 16
_ARRAY = "__dstt_array__"
_SEGMENT = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def segment(key: Any, used: set[str]) -> str:
    """A valid array path segment for a dict key, unique within ``used`` (which it joins)."""
    s = str(key)
    if not _SEGMENT.match(s) or s.startswith(("c.", "d.")) or s == "zarr.json":
        s = "k_" + re.sub(r"[^A-Za-z0-9_.\-]", "_", s)
    base, i = s, 1
    while s in used:
        i += 1
        s = f"{base}_{i}"
    used.add(s)
    return s


def flatten(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The state dict with large tensors replaced by array placeholders (collected in
    ``tensors``); small tensors are kept inline as tagged bytes."""
    if isinstance(obj, torch.Tensor):
        if obj.numel() <= INLINE_NUMEL or obj.is_sparse:
            return to_plain(obj)
        store_dtype(obj.dtype, what=f"checkpoint tensor {prefix!r}")
        tensors[prefix] = obj.detach()
        return {_ARRAY: prefix}
    if isinstance(obj, dict):
        used: set[str] = set()
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = flatten(v, f"{prefix}/{segment(k, used)}", tensors)
        return out
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        items = [flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else type(obj)(items)
    return obj


def rebuild(obj: Any, read: Callable[[str], torch.Tensor]) -> Any:
    """The state dict of ``flatten``'s skeleton; ``read(path)`` loads one array."""
    if isinstance(obj, dict):
        if len(obj) == 1 and _ARRAY in obj:
            return read(obj[_ARRAY])
        plain = from_plain(obj) if len(obj) == 1 else None
        if isinstance(plain, torch.Tensor):
            return plain
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = rebuild(v, read)
        return out
    if isinstance(obj, list):
        return [rebuild(v, read) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return type(obj)(rebuild(v, read) for v in obj)
    return obj
