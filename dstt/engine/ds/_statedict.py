"""State dicts as (array paths → live tensors) plus a picklable skeleton, and back.

DeepSpeed hands checkpoint engines nested state dicts (module weights, ZeRO partitions, the
optimizer's ``state_dict()``, loss scalers, configs). ``flatten`` keeps the tensors *live* —
the engine copies them lazily like any captured tensor — and replaces each by a placeholder
naming its array path: by default derived from the dict keys (sanitised to valid path
segments, made unique), or whatever ``place`` says (the checkpoint engine names a tensor a
session would capture by the session's path). Every tensor becomes an array, however small
(Adam's 0-d ``step`` too, as sessions store it), so inspection sees it; only sparse and empty
tensors stay inside the skeleton as tagged bytes. ``rebuild`` reverses it with a reader
callback. Rejected alternative: ``torch.save`` of the skeleton with tensors — the bytes would
bypass the chunked, checksummed, lazy store.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dstt.engine.tensors._convert import from_plain, store_dtype, to_plain

__all__ = ["Place", "SessionPaths", "flatten", "rebuild", "segment"]

#: ``place(tensor, default_path)`` -> the array path to store ``tensor`` under
Place = Callable[[torch.Tensor, str], str]
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


def flatten(
    obj: Any, prefix: str, tensors: dict[str, torch.Tensor], place: Place | None = None
) -> Any:
    """The state dict with its tensors replaced by array placeholders (collected in
    ``tensors`` by array path: ``place(tensor, key path)`` or the key path); sparse and
    empty tensors are kept inline as tagged bytes."""
    if isinstance(obj, torch.Tensor):
        if obj.numel() == 0 or obj.is_sparse:
            return to_plain(obj)
        store_dtype(obj.dtype, what=f"checkpoint tensor {prefix!r}")
        path = prefix if place is None else place(obj, prefix)
        tensors[path] = obj.detach()
        return {_ARRAY: path}
    if isinstance(obj, dict):
        used: set[str] = set()
        out = type(obj)() if type(obj) is not dict else {}
        for k, v in obj.items():
            out[k] = flatten(v, f"{prefix}/{segment(k, used)}", tensors, place)
        return out
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        items = [flatten(v, f"{prefix}/{i}", tensors, place) for i, v in enumerate(obj)]
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


class SessionPaths:
    """One tag's array paths for the tensors a session would capture (``live``, by session
    path; ``zero``: the ``ZeroState`` whose shard map names ZeRO partitions). A saved tensor
    takes a session path when it is that live tensor — same storage, dtype and view, or a 1-d
    prefix of it (ZeRO 1/2 save partitions without their padding) — and no other view of it
    took the path first."""

    def __init__(self, live: Mapping[str, torch.Tensor], zero: Any) -> None:
        self.by_ptr: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for path, t in live.items():
            if t.numel() and t.device.type != "meta":
                self.by_ptr.setdefault(t.data_ptr(), []).append((path, t))
        self.zero = zero
        self.claimed: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self.staged: set[str] = set()  # paths already in one of the tag's flights

    def place(self, t: torch.Tensor, default: str) -> str:
        for path, s in self.by_ptr.get(t.data_ptr(), ()):
            if s.dtype != t.dtype or s.device != t.device:
                continue
            same = t.shape == s.shape and t.stride() == s.stride()
            prefix = (
                t.dim() == 1 == s.dim()
                and t.stride() == s.stride() == (1,)
                and t.numel() <= s.numel()
            )
            view = (tuple(t.shape), tuple(t.stride()))
            if (same or prefix) and self.claimed.setdefault(path, view) == view:
                return path
        return default

    def shard_map(self) -> dict[str, Any] | None:
        """The rank's shard map, keeping the logical arrays whose pieces all were saved."""
        if self.zero is None:
            return None
        m = self.zero.shard_map()
        size = {p: v[0][0] for p, v in self.claimed.items() if len(v[0]) == 1}
        arrays = {
            path: a
            for path, a in m["arrays"].items()
            if all(src in size and start + n <= size[src] for src, start, _, n in a["pieces"])
        }
        return {**m, "arrays": arrays} if arrays else None
