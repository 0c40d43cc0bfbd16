"""Conversions between torch and the store: dtype names, flat byte views, tensors inside objects.

The store knows nothing of torch, so every crossing happens here. Tensors cross as *bytes*:
``t.detach().reshape(-1).view(torch.uint8)`` on the way out and a numpy array reinterpreted
with ``torch.from_numpy(...).view(dtype)`` on the way back, which is bit-exact for every dtype
(NaN payloads, -0.0, subnormals) and needs no float conversion. bfloat16 crosses as uint16
because numpy has no native bfloat16 (the reader hands out ``ml_dtypes.bfloat16``).

Tensors that sit inside *objects* (scheduler state, 0-d optimizer scalars, user state) become a
small tagged dict holding their dtype, shape and raw bytes. Rejected alternative: ``.tolist()``
— it silently widens bf16/fp16 through float64 and loses the dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dstt.errors import SchemaError

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "STORE_TO_TORCH",
    "TORCH_TO_STORE",
    "flat_bytes",
    "from_plain",
    "store_dtype",
    "tensor_from_numpy",
    "to_plain",
    "torch_dtype",
]

TORCH_TO_STORE: Mapping[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}
STORE_TO_TORCH: Mapping[str, torch.dtype] = {v: k for k, v in TORCH_TO_STORE.items()}

_TENSOR_TAG = "__dstt_tensor__"


def store_dtype(dtype: torch.dtype, *, what: str = "tensor") -> str:
    """The store's dtype name for a torch dtype; ``SchemaError`` for unsupported ones."""
    try:
        return TORCH_TO_STORE[dtype]
    except KeyError:
        raise SchemaError(
            f"{what} has dtype {dtype}, which dstt cannot store; supported: "
            f"{', '.join(sorted(TORCH_TO_STORE.values()))}"
        ) from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return STORE_TO_TORCH[name]
    except KeyError:
        raise SchemaError(f"stored dtype {name!r} has no torch equivalent") from None


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The C-order bytes of ``t`` as a 1-d uint8 tensor (a view when ``t`` is contiguous)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def tensor_from_numpy(arr: np.ndarray, dtype: str) -> torch.Tensor:
    """A CPU tensor of store dtype ``dtype`` sharing ``arr``'s bytes (bit-exact)."""
    want = torch_dtype(dtype)
    a = arr if arr.flags.c_contiguous and arr.flags.writeable else arr.copy(order="C")
    if want == torch.bfloat16:
        return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
    t = torch.from_numpy(a)
    if t.dtype != want:
        raise SchemaError(f"stored array has numpy dtype {a.dtype}, expected {dtype}")
    return t


def _tensor_to_plain(t: torch.Tensor) -> dict[str, Any]:
    cpu = t.detach().to("cpu").contiguous()
    return {
        _TENSOR_TAG: {
            "dtype": store_dtype(cpu.dtype, what="a tensor inside an object"),
            "shape": list(cpu.shape),
            "device": str(t.device),
            "data": flat_bytes(cpu).numpy().tobytes(),
        }
    }


def _tensor_from_plain(d: Mapping[str, Any]) -> torch.Tensor:
    raw = bytearray(d["data"])
    dtype = torch_dtype(d["dtype"])
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    t = flat.view(dtype).reshape(d["shape"])
    device = d.get("device", "cpu")
    if device != "cpu" and torch.device(device).type == "cuda" and torch.cuda.is_available():
        t = t.to(device)
    return t


def to_plain(obj: Any) -> Any:
    """Replace every tensor in a nested dict/list/tuple by a tagged dict of its raw bytes."""
    if isinstance(obj, torch.Tensor):
        return _tensor_to_plain(obj)
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):  # a copy: the caller may keep mutating its list
        if all(map(_LEAVES.__contains__, map(type, obj))):
            return list(obj)  # names, RNG words: no call per element
        return [to_plain(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        if all(map(_LEAVES.__contains__, map(type, obj))):
            return obj
        return tuple(to_plain(v) for v in obj)
    return obj


#: types ``to_plain`` leaves as they are (a list or tuple of only these is copied in C)
_LEAVES = frozenset({int, float, str, bool, bytes, type(None)})


def from_plain(obj: Any) -> Any:
    """Inverse of :func:`to_plain`."""
    if isinstance(obj, dict):
        if len(obj) == 1 and _TENSOR_TAG in obj:
            return _tensor_from_plain(obj[_TENSOR_TAG])
        return {k: from_plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_plain(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(from_plain(v) for v in obj)
    return obj
