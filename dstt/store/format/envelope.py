"""The checksummed envelope every dstt document is sealed in, and the crc32c it uses.

Every document is an envelope ``{"crc32c": N, "body": {...}}`` whose crc32c covers the canonical
serialization of the body (sorted keys, no spaces), so a flipped byte anywhere is detected.
Parsing is strict: an unknown ``format`` raises ``FormatVersionError``, unknown or missing fields
raise ``CorruptRunError``. Metric values keep non-finite floats as ``{"float": "nan"}``. The
documents themselves (headers, arrays tables, refs) are ``manifest``; part manifests are
``parts``. Rejected alternative: a checksum sidecar file — two files to keep consistent
instead of one.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

from dstt.errors import ChecksumError, CorruptRunError, FormatVersionError

from .layout import FORMAT_VERSION

if TYPE_CHECKING:
    from collections.abc import Callable

    from .records import Metric

__all__ = ["checksum", "crc32c_raw"]


def _load_crc32c() -> Callable[..., int]:
    """The ``crc32c`` package's C function, loaded from its extension module alone: the
    package's ``__init__`` imports ``importlib.metadata`` (for its ``__version__``) and its
    command line, 0.05-0.2 s that every command pays, since every document read is verified.
    Falls back to ``import crc32c`` if the extension is not where the package keeps it.
    Rejected alternative: deferring the import to the first checksum — the first document
    a command reads (``HEAD``) is verified, so nothing would be saved."""
    import importlib.machinery
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("crc32c")
        where = list(spec.submodule_search_locations or []) if spec is not None else []
        suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
        for folder in where:
            for name in sorted(os.listdir(folder)):
                if name.startswith("_crc32c.") and name.endswith(suffixes):
                    path = os.path.join(folder, name)
                    loader = importlib.machinery.ExtensionFileLoader("crc32c._crc32c", path)
                    ext_spec = importlib.util.spec_from_file_location(
                        "crc32c._crc32c", path, loader=loader
                    )
                    if ext_spec is None:
                        continue
                    module = importlib.util.module_from_spec(ext_spec)
                    loader.exec_module(module)
                    fn: Callable[..., int] = module.crc32c
                    if fn(b"123456789") == 0xE3069283:  # the CRC-32C check value
                        return fn
    except (ImportError, OSError, AttributeError):
        pass
    import crc32c

    return crc32c.crc32c


#: the C function itself (``map`` it over many buffers: no Python frame per call)
crc32c_raw = _load_crc32c()


def checksum(data: bytes | memoryview, value: int = 0) -> int:
    """crc32c of ``data``, continuing from ``value`` (so pieces can be checksummed in turn)."""
    return int(crc32c_raw(data, value))


def _canonical(body: object) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _seal(kind: str, body: dict[str, Any]) -> bytes:
    body = {"kind": kind, "format": FORMAT_VERSION, **body}
    raw = _canonical(body)
    return b'{"crc32c":%d,"body":' % checksum(raw) + raw + b"}\n"


def _open(data: bytes, kind: str, where: str, *, verified: bool = False) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptRunError(f"{where}: not valid JSON ({e}); the file is damaged") from None
    if (
        not isinstance(doc, dict)
        or set(doc) != {"crc32c", "body"}
        or not isinstance(doc.get("body"), dict)
    ):
        raise CorruptRunError(f"{where}: not a dstt {kind} document")
    body: dict[str, Any] = doc["body"]
    if body.get("kind") != kind:
        raise CorruptRunError(f"{where}: expected a {kind} document, found {body.get('kind')!r}")
    if not verified:
        try:
            raw = _canonical(body)
        except ValueError as e:
            raise CorruptRunError(f"{where}: {e}") from None
        if checksum(raw) != doc["crc32c"]:
            raise ChecksumError(f"{where}: crc32c mismatch; the file is damaged")
    fmt = body.get("format")
    if fmt != FORMAT_VERSION:
        raise FormatVersionError(
            f"{where}: written by dstt format {fmt!r}; this dstt reads format {FORMAT_VERSION}. "
            "Upgrade dstt to read it."
        )
    return body


def _fields(body: dict[str, Any], required: set[str], optional: set[str], where: str) -> None:
    keys = set(body) - {"kind", "format"}
    missing, unknown = required - keys, keys - required - optional
    if missing or unknown:
        raise CorruptRunError(
            f"{where}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}"
        )


def _metric_out(v: object) -> Metric | dict[str, str]:
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": repr(v)}
    if isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"metric values must be numbers, strings or bools, got {type(v).__name__}")


def _metric_in(v: Metric | dict[str, str]) -> Metric:
    if isinstance(v, dict):
        return float(v["float"])
    return v
