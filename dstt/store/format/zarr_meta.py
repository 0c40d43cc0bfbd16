"""``zarr.json`` documents for the run's groups and arrays, written by hand.

dstt writes Zarr v3 metadata and raw chunk files itself (zarr-python's own writer costs ~10 ms
per array and runs at 0.1 GB/s here), but the documents are plain Zarr v3 so zarr-python,
xarray and tensorstore read a run without dstt. Codecs are declared explicitly (zarr-python's
default would be zstd): ``bytes`` (little endian) then ``crc32c``, so every chunk file is the raw
C-order bytes followed by a 4-byte little-endian crc32c that any Zarr reader verifies.
"""

from __future__ import annotations

import json
from typing import Any

from .layout import FORMAT_VERSION, ChunkPlan

__all__ = [
    "DTYPES",
    "array_document",
    "dtype_itemsize",
    "dump",
    "group_document",
    "numpy_dtype",
]

#: store dtype name -> (itemsize, fill value as Zarr v3 JSON)
DTYPES: dict[str, tuple[int, Any]] = {
    "float64": (8, "NaN"),
    "float32": (4, "NaN"),
    "float16": (2, "NaN"),
    "bfloat16": (2, "NaN"),
    "int64": (8, 0),
    "int32": (4, 0),
    "int16": (2, 0),
    "int8": (1, 0),
    "uint8": (1, 0),
    "bool": (1, False),
}


def dtype_itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype][0]
    except KeyError:
        raise ValueError(
            f"unsupported dtype {dtype!r}; dstt stores {', '.join(sorted(DTYPES))}"
        ) from None


def numpy_dtype(dtype: str) -> Any:
    """The numpy dtype for a store dtype name (bfloat16 via ml_dtypes)."""
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    dtype_itemsize(dtype)
    return np.dtype(dtype).newbyteorder("<")


def dump(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, indent=2, sort_keys=False).encode()


def group_document(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"zarr_format": 3, "node_type": "group"}
    if attributes:
        doc["attributes"] = attributes
    return doc


def root_attributes(**extra: Any) -> dict[str, Any]:
    return {"dstt": {"format": FORMAT_VERSION, **extra}}


def array_document(path: str, dtype: str, plan: ChunkPlan,
                   attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    """Zarr v3 metadata of one tensor array of a step file."""
    itemsize, fill = DTYPES[dtype]
    name = path.rsplit("/", 1)[-1]
    dims = [f"{name}_{i}" for i in range(len(plan.shape))]
    codecs: list[dict[str, Any]] = []
    if itemsize > 1:
        codecs.append({"name": "bytes", "configuration": {"endian": "little"}})
    else:
        codecs.append({"name": "bytes"})
    codecs.append({"name": "crc32c"})
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(plan.shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular",
                       "configuration": {"chunk_shape": list(plan.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": {"dstt": {"format": FORMAT_VERSION, **(attributes or {})}},
        "dimension_names": dims,
    }
