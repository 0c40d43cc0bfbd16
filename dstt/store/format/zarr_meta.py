"""``zarr.json`` documents for the run's groups and arrays, written by hand.

dstt writes Zarr v3 metadata itself but plain, so zarr-python, xarray and tensorstore read a
run without dstt: codecs ``bytes`` (little endian) then ``crc32c``, declared explicitly;
``dimension_names`` as the writer is told (else ``<name>_<i>``); a step's root document may
carry consolidated metadata (``root_document``), so a step opens with one read.

Rejected alternatives: zarr-python's own writer (~10 ms per array, 0.1 GB/s here); no
consolidation (every plain ``xr.open_datatree`` of a step warns and lists the zip once per
group). Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from .layout import FORMAT_VERSION, ChunkPlan

if TYPE_CHECKING:
    from collections.abc import Sequence

    import numpy as np

__all__ = [
    "DTYPES",
    "array_document",
    "check_dims",
    "consolidated_metadata",
    "default_dims",
    "dtype_itemsize",
    "dump",
    "group_document",
    "numpy_dtype",
    "root_document",
    "root_document_bytes",
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


def numpy_dtype(dtype: str) -> np.dtype[Any]:
    """The numpy dtype for a store dtype name (bfloat16 via ml_dtypes)."""
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)
        return bf16
    dtype_itemsize(dtype)
    little: np.dtype[Any] = np.dtype(dtype).newbyteorder("<")
    return little


def dump(doc: dict[str, Any]) -> bytes:
    """A zarr.json document, compact: no indentation (JSON readers do not care; at every
    step of per-iteration capture the ~1,000 documents and their consolidated copy are
    written again, and indentation was half of their ~0.6 MB per step at 360 arrays)."""
    return json.dumps(doc, separators=(",", ":"), sort_keys=False).encode()


def group_document(attributes: dict[str, Any] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {"zarr_format": 3, "node_type": "group"}
    if attributes:
        doc["attributes"] = attributes
    return doc


def root_attributes(**extra: Any) -> dict[str, Any]:
    return {"dstt": {"format": FORMAT_VERSION, **extra}}


#: a dimension name: what xarray users type as a keyword (``isel(out_features=0)``)
_DIM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_dims(path: str, ndim: int, dims: Sequence[str]) -> tuple[str, ...]:
    """``dims`` as a tuple after checking there is one identifier per axis, all distinct."""
    out = tuple(dims)
    if (
        len(out) != ndim
        or len(set(out)) != ndim
        or not all(isinstance(d, str) and _DIM.match(d) for d in out)
    ):
        raise ValueError(
            f"dimension names {list(out)} of array {path!r} must be {ndim} "
            "distinct identifiers (letters, digits, '_'), one per axis"
        )
    return out


def default_dims(path: str, ndim: int) -> tuple[str, ...]:
    """The names of an array declared without any: ``<name>_<i>``."""
    name = path.rsplit("/", 1)[-1]
    return tuple(f"{name}_{i}" for i in range(ndim))


def array_document(
    path: str,
    dtype: str,
    plan: ChunkPlan,
    attributes: dict[str, Any] | None = None,
    dims: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Zarr v3 metadata of one tensor array of a step file; ``dims`` its
    ``dimension_names`` (default ``<name>_<i>``)."""
    itemsize, fill = DTYPES[dtype]
    names = (
        default_dims(path, len(plan.shape))
        if dims is None
        else check_dims(path, len(plan.shape), dims)
    )
    as_bytes: dict[str, Any] = {"name": "bytes"}
    if itemsize > 1:
        as_bytes["configuration"] = {"endian": "little"}
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(plan.shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(plan.chunk_shape)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": [as_bytes, {"name": "crc32c"}],
        "attributes": {"dstt": {"format": FORMAT_VERSION, **(attributes or {})}},
        "dimension_names": list(names),
    }


def _tree_order(member: tuple[Any, ...]) -> tuple[int, str]:
    """Depth, then path: zarr-python (3.1) rebuilds the tree from the flat mapping with
    ``itertools.groupby`` over keys sorted by depth only, so the children of one group must
    be adjacent (they are, sorted by path within a depth)."""
    return member[0].count("/"), member[0]


def _consolidated(metadata: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "inline", "must_understand": False, "metadata": metadata}


def root_document(
    attributes: dict[str, Any], members: Sequence[tuple[str, dict[str, Any]]]
) -> dict[str, Any]:
    """A step's root group document with Zarr's consolidated metadata of ``members``
    (``(node path, its zarr.json document)`` for every group and array below the root), laid
    out as zarr-python's own ``consolidate_metadata`` writes it."""
    metadata: dict[str, Any] = {}
    for path, doc in sorted(members, key=_tree_order):
        if doc.get("node_type") == "group":
            doc = {**doc, "consolidated_metadata": _consolidated({})}
        metadata[path] = doc
    return {**group_document(attributes), "consolidated_metadata": _consolidated(metadata)}


def consolidated_metadata(members: Sequence[tuple[str, str, bytes]]) -> bytes:
    """The ``consolidated_metadata`` JSON of a step from ``(node path, "group" | "array",
    zarr.json bytes)`` of every node below the root: the array documents are spliced in as
    they are (no parse: built once per set of arrays, reused while it holds)."""
    parts = []
    for path, kind, doc in sorted(members, key=_tree_order):
        if kind == "group":
            doc = dump({**json.loads(doc), "consolidated_metadata": _consolidated({})})
        parts.append(json.dumps(path).encode() + b":" + doc)
    return b'{"kind":"inline","must_understand":false,"metadata":{' + b",".join(parts) + b"}}"


def root_document_bytes(attributes: dict[str, Any], consolidated: bytes) -> bytes:
    """``dump(root_document(attributes, members))``, byte for byte, from
    ``consolidated_metadata(members)``: per step only the attributes are encoded."""
    head = dump(group_document(attributes))
    return head[:-1] + b',"consolidated_metadata":' + consolidated + b"}"
