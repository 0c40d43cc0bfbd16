"""Safe serialization of Python objects stored beside the tensors (RNG, scheduler, data position).

Default encoding is *tagged JSON*: plain JSON for dict/list/str/int/float/bool/None, plus tags
for tuples, bytes, non-string dict keys, non-finite floats and numpy arrays. Reading it can never
run code, so opening someone else's run is safe. ``pickle`` is available for arbitrary user
objects but only when the writer asks for it, and the reader must pass ``trusted=True`` to load
it. Rejected alternative: pickle everything (what torch.save did before ``weights_only``) — one
malicious run directory would own the analyst's notebook.
"""

from __future__ import annotations

import base64
import json
import math
import pickle
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from dstt.errors import UnsafeObjectError

__all__ = ["Encoded", "Encoding", "UnsafeObjectError", "decode_object", "encode_object"]

Encoding = Literal["json", "pickle", "raw"]


@dataclass(frozen=True)
class Encoded:
    """An object encoded once and stored as these bytes at every step that holds it: for a
    provider whose value keeps its structure for many steps (the optimizer state's key
    lists), so a step does not walk it again. Reads back as the decoded object."""

    data: bytes
    encoding: Encoding = "json"

    @classmethod
    def of(cls, obj: object, encoding: Encoding = "json") -> Encoded:
        return cls(encode_object(obj, encoding), encoding)


def _dtype_out(dt: np.dtype[Any]) -> str:
    # ml_dtypes types (bfloat16, float8_*) have no numpy type string: ``.str`` is '<V2', which
    # would decode as raw void bytes; store their name instead
    if dt.kind == "V" and dt.fields is None and dt.type.__module__.startswith("ml_dtypes"):
        return dt.name
    return dt.str


def _dtype_in(s: str) -> np.dtype[Any]:
    if s.isidentifier():  # a name written by _dtype_out, e.g. "bfloat16"
        import ml_dtypes

        named: np.dtype[Any] = np.dtype(getattr(ml_dtypes, s))
        return named
    return np.dtype(s)


_PLAIN = frozenset({str, int, bool, type(None)})  # JSON as they are (exact types only)
_NUMBERS = frozenset({float, int, bool})


def _plain_items(x: list[Any] | tuple[Any, ...]) -> bool:
    """Every item is a str/int/bool/None, or a finite float: the sequence encodes as it is
    (checked in C: RNG words and name lists without a Python call per item)."""
    types = set(map(type, x))
    if types <= _PLAIN:
        return True
    return types <= _NUMBERS and all(map(math.isfinite, x))


def _enc(x: object) -> object:
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else {"$float": repr(x)}
    if isinstance(x, np.generic):
        return _enc(x.item())
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in x):
            return {k: _enc(v) for k, v in x.items()}
        return {"$dict": [[_enc(k), _enc(v)] for k, v in x.items()]}
    if isinstance(x, list):
        return list(x) if _plain_items(x) else [_enc(v) for v in x]
    if isinstance(x, tuple):
        return {"$tuple": list(x) if _plain_items(x) else [_enc(v) for v in x]}
    if isinstance(x, (bytes, bytearray, memoryview)):
        return {"$bytes": base64.b64encode(bytes(x)).decode()}
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise TypeError("object arrays cannot be stored as JSON; use encoding='pickle'")
        # x.shape, not a.shape: ascontiguousarray turns a 0-d array into a 1-d one
        a = np.ascontiguousarray(x)
        return {
            "$ndarray": {
                "dtype": _dtype_out(a.dtype),
                "shape": list(x.shape),
                "data": base64.b64encode(a.tobytes()).decode(),
            }
        }
    raise TypeError(
        f"cannot store {type(x).__name__} as tagged JSON; convert it to plain data "
        "(dict/list/str/number/bytes/numpy array) or pass encoding='pickle'"
    )


def _dec(x: Any) -> Any:
    if isinstance(x, list):
        return [_dec(v) for v in x]
    if isinstance(x, dict):
        if len(x) == 1:
            ((tag, val),) = x.items()
            if tag == "$float":
                return float(val)
            if tag == "$tuple":
                return tuple(_dec(v) for v in val)
            if tag == "$bytes":
                return base64.b64decode(val)
            if tag == "$dict":
                return {_dec(k): _dec(v) for k, v in val}
            if tag == "$ndarray":
                raw = base64.b64decode(val["data"])
                dt = _dtype_in(val["dtype"])
                return np.frombuffer(raw, dtype=dt).reshape(tuple(val["shape"])).copy()
        return {k: _dec(v) for k, v in x.items()}
    return x


def encode_object(obj: object, encoding: Encoding = "json") -> bytes:
    if encoding == "json":
        return json.dumps(_enc(obj), separators=(",", ":"), allow_nan=False).encode()
    if encoding == "pickle":
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if encoding == "raw":
        if not isinstance(obj, (bytes, bytearray, memoryview)):
            raise TypeError(f"encoding='raw' needs bytes, got {type(obj).__name__}")
        return bytes(obj)
    raise ValueError(f"unknown object encoding {encoding!r}; use 'json', 'pickle' or 'raw'")


def decode_object(data: bytes, encoding: str, *, trusted: bool = False, where: str = "") -> Any:
    if encoding == "json":
        return _dec(json.loads(data))
    if encoding == "raw":
        return data
    if encoding == "pickle":
        if not trusted:
            raise UnsafeObjectError(
                f"object {where} was stored with pickle; loading it runs code from the run "
                "directory. Pass trusted=True if you trust this run."
            )
        return pickle.loads(data)  # explicit opt-in above
    raise ValueError(f"unknown object encoding {encoding!r} in {where}")
