"""A whole timeline as one virtual Zarr v3 store: references into the step files, no copy.

``write_references`` writes one kerchunk-format reference file that fsspec's ``reference://``
file system serves as a Zarr store, so zarr-python, xarray and dask read the run without
dstt: each tensor is one array with a leading ``step`` dimension whose chunks are the step
files' own chunks (crc32c trailers included), metrics inline at the root. What cannot be
virtual (delta-encoded steps, unevenly split or ZeRO-sharded tensors, changed shapes) is
left out and listed; re-running appends the steps committed since.

Chosen over Icechunk's virtual chunks and VirtualiZarr (extra dependencies or a parser for
dstt's zips): kerchunk needs only fsspec. Rejected: copying every tensor into a Zarr array
per tensor (every byte twice). History: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import base64
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.errors import ConfigError
from dstt.store._internal import DTENSOR_PREFIX, dtype_itemsize

from .naming import canonical_path

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from dstt.store._internal import ArrayRecord, CommitHeader, LogicalArray, Reader

__all__ = ["VirtualReport", "write_references"]

#: the version of the root's ``attributes["dstt"]["virtual"]`` layout
VIRTUAL_VERSION = 1
#: every key lies under this folder: zarr's FsspecStore lists a store whose path is empty as
#: ``/<prefix>``, which fsspec's reference file system does not find (open
#: ``reference://run``)
ROOT = "run"
#: a group named ``step`` (Adam's ``optim/step/...``) would shadow the ``step`` coordinate
#: that every node inherits from the root: it is presented as ``step_count``
RENAMED = {"step": "step_count"}


def virtual_path(path: str) -> str:
    """Where the tensor stored at ``path`` (``optim/step/0/weight``) sits in the store."""
    parts = path.split("/")
    return "/".join([*(RENAMED.get(x, x) for x in parts[:-1]), parts[-1]])


@dataclass(frozen=True)
class VirtualReport:
    """What a ``write_references`` call wrote: the file, the steps it covers (oldest first),
    the steps appended by this call, and what was left out and why."""

    path: Path
    steps: tuple[int, ...]
    added: tuple[int, ...]
    arrays: int
    left_out_steps: Mapping[int, str] = field(default_factory=dict)
    left_out_arrays: Mapping[str, str] = field(default_factory=dict)


def _array_doc(
    shape: list[int],
    dtype: str,
    chunks: list[int],
    fill: str | int,
    codecs: list[Any],
    dims: list[str],
) -> str:
    """An array's ``zarr.json`` (regular chunk grid, ``/``-separated keys)."""
    return json.dumps(
        {
            "zarr_format": 3,
            "node_type": "array",
            "shape": shape,
            "data_type": dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill,
            "codecs": codecs,
            "attributes": {},
            "dimension_names": dims,
        }
    )


_LITTLE = {"name": "bytes", "configuration": {"endian": "little"}}


def _inline_array(values: np.ndarray, dims: Sequence[str]) -> dict[str, str]:
    """``zarr.json`` and the single chunk (inline) of a small 1-d array along ``step``."""
    dtype = "int64" if values.dtype.kind in "iu" else "float64"
    fill: Any = 0 if dtype == "int64" else "NaN"
    n = len(values)
    doc = _array_doc([n], dtype, [max(1, n)], fill, [_LITTLE], list(dims))
    data = np.ascontiguousarray(values, dtype="<i8" if dtype == "int64" else "<f8").tobytes()
    return {"zarr.json": doc, "c/0": "base64:" + base64.b64encode(data).decode()}


@dataclass
class _Array:
    """One tensor's trajectory: its per-step metadata (fixed) and its chunk references.
    ``chunks``: the chunk shape past the ``step`` dimension (one chunk grid for all steps)."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dims: list[str]

    @classmethod
    def from_doc(cls, path: str, doc: Mapping[str, Any]) -> _Array:
        chunk = doc["chunk_grid"]["configuration"]["chunk_shape"]
        return cls(
            path,
            doc["data_type"],
            tuple(doc["shape"][1:]),
            tuple(int(c) for c in chunk[1:]),
            doc["dimension_names"][1:],
        )

    def document(self, n: int) -> str:
        itemsize = dtype_itemsize(self.dtype)
        # the step files' fill values: NaN for floats (a step without the tensor shows it)
        fill: Any = False if self.dtype == "bool" else "NaN" if "float" in self.dtype else 0
        codecs = [_LITTLE if itemsize > 1 else {"name": "bytes"}, {"name": "crc32c"}]
        return _array_doc(
            [n, *self.shape], self.dtype, [1, *self.chunks], fill, codecs, ["step", *self.dims]
        )


def _stored_chunks(rec: ArrayRecord) -> tuple[tuple[int, ...], dict[tuple[int, ...], Any]]:
    """A stored array's chunk shape (rows, then whole trailing dimensions) and its chunks by
    grid index: the step file's own grid."""
    if not rec.shape:
        return (), ({(): rec.chunks[0]} if rec.chunks else {})
    rest = (0,) * (len(rec.shape) - 1)
    chunks = (rec.rows, *(max(1, s) for s in rec.shape[1:]))
    return chunks, {(j, *rest): c for j, c in enumerate(rec.chunks)}


def _box_chunks(
    a: LogicalArray, table: Mapping[str, Any]
) -> tuple[tuple[int, ...], dict[tuple[int, ...], Any]] | str:
    """One chunk grid of the logical array ``a`` whose every cell is one whole chunk of one
    rank's box (its chunk shape and chunks by grid index), or why there is none."""
    shape = a.shape
    grid: tuple[int, ...] | None = None
    cells: dict[tuple[int, ...], Any] = {}
    for b in a.boxes:
        if 0 in b.sizes:
            continue  # a rank that holds no part of it (fewer rows than ranks)
        src = table.get(b.source) or table.get(canonical_path(b.source))
        if src is None or tuple(src.shape) != tuple(b.sizes):
            return f"the box {b.source} is not stored with the shape its shard map gives"
        own, chunks = _stored_chunks(src)
        if grid is None:
            grid = own
        elif own != grid:
            return (
                f"its boxes are chunked differently ({grid} and {own}, e.g. an uneven split "
                "over the ranks): no one regular chunk grid holds them"
            )
        for (j, *_), c in chunks.items():
            start = (b.offsets[0] + j * grid[0], *b.offsets[1:]) if shape else ()
            stop = tuple(
                min(o + g, lim, s0 + n)
                for o, g, lim, s0, n in zip(start, grid, shape, b.offsets, b.sizes, strict=True)
            )
            whole = all(
                o % g == 0 and (e - o == g or e == lim)
                for o, e, g, lim in zip(start, stop, grid, shape, strict=True)
            )
            if not whole:
                return (
                    f"the box {b.source} does not fall on the chunk grid {grid} (a chunk "
                    f"from {start} to {stop})"
                )
            cells.setdefault(tuple(o // g for o, g in zip(start, grid, strict=True)), c)
    if grid is None:
        if math.prod(shape):
            return "no rank stored a part of it"
        return tuple(max(1, s) for s in shape), {}
    need = math.prod(-(-s // g) for s, g in zip(shape, grid, strict=True))
    if len(cells) != need:
        return f"its boxes cover {len(cells)} of the {need} chunks of the grid {grid}"
    return grid, cells


def _load(out: Path, run_url: str, timeline: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The references and the ``dstt`` attributes of an earlier file for this timeline."""
    try:
        stored: dict[str, Any] = json.loads(out.read_text())["refs"]
        refs = {k.removeprefix(f"{ROOT}/"): v for k, v in stored.items()}
        attrs: dict[str, Any] = json.loads(refs["zarr.json"])["attributes"]["dstt"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{out} exists and is not a dstt reference file ({e}); choose another output "
            "path or remove it"
        ) from e
    if (attrs.get("run"), attrs.get("timeline")) != (run_url, timeline):
        raise ConfigError(
            f"{out} holds references to run {attrs.get('run')!r}, timeline "
            f"{attrs.get('timeline')!r}, not {run_url!r}, {timeline!r}: choose another output"
        )
    return refs, attrs


def write_references(
    reader: Reader,
    headers: Sequence[CommitHeader],
    out: str | os.PathLike[str],
    *,
    run_url: str,
    timeline: str,
) -> VirtualReport:
    """Write (or extend) the reference file ``out`` for the committed ``headers`` of one
    timeline (oldest first, tombstones excluded) of the run at ``run_url`` (the URL its step
    files' keys are relative to: ``file:///...`` or ``s3://bucket/prefix``)."""
    if run_url.startswith("memory://"):
        raise ConfigError(
            f"the run {run_url} lives in this process's memory: references to it would be "
            "unreadable elsewhere; write the run to a folder or a bucket first"
        )
    path = Path(out)
    refs: dict[str, Any] = {}
    attrs: dict[str, Any] = {"left_out_steps": {}, "left_out_arrays": {}, "steps": [], "slots": []}
    if path.exists():
        refs, attrs = _load(path, run_url, timeline)
    slots: list[int] = [int(s) for s in attrs["slots"]]
    steps: list[int] = [int(s) for s in attrs["steps"]]
    skipped: dict[str, str] = dict(attrs["left_out_steps"])
    dropped: dict[str, str] = dict(attrs["left_out_arrays"])
    live = [h for h in headers if not h.pruned]
    covered = set(slots)
    seen = covered | {int(k.split(":")[0]) for k in skipped}
    if slots and [h.slot for h in live if h.slot in covered] != slots:
        raise ConfigError(
            f"timeline {timeline!r} no longer holds the steps {path} covers (a rollback, "
            "a gc or a deleted timeline changed it): write a new reference file"
        )
    arrays: dict[str, _Array] = {}
    inline = {"step", *attrs.get("metrics", {})}
    for key, value in refs.items():
        if key.endswith("/zarr.json") and isinstance(value, str):
            doc = json.loads(value)
            name = key[: -len("/zarr.json")]
            if doc.get("node_type") == "array" and name not in inline:
                arrays[name] = _Array.from_doc(name, doc)
    metrics: dict[str, list[float]] = {
        k: [float(v) for v in vals] for k, vals in attrs.get("metric_values", {}).items()
    }
    added: list[int] = []
    purge: set[str] = set()  # arrays left out since: their references go, once, at the end
    for h in live:
        if h.slot in seen:
            continue
        records = reader.arrays(h)
        encoded = sorted(
            p for p, r in records.items() if any(c.encoding != "raw" for c in r.chunks)
        )
        if encoded:
            skipped[f"{h.slot}:{h.step}"] = (
                f"delta-encoded or predicted chunks ({len(encoded)} arrays, e.g. {encoded[0]}): "
                "a plain Zarr reader cannot decode them"
            )
            continue
        i = len(steps)
        for stored_path, rec in records.items():
            p = virtual_path(stored_path)
            if stored_path.startswith(DTENSOR_PREFIX) or p in dropped:
                continue  # a rank's box: presented as part of its logical tensor
            logical: LogicalArray | None = getattr(rec, "logical", None)
            if logical is not None and not logical.boxes:
                dropped[p] = (
                    "pieces of the ranks' flat buffers (ZeRO): its elements do not form "
                    "chunks of any regular grid"
                )
                continue
            found = _box_chunks(logical, records) if logical is not None else _stored_chunks(rec)
            if isinstance(found, str):
                dropped[p] = f"{found} (step {h.step})"
                purge.add(p)
                arrays.pop(p, None)
                continue
            grid, cells = found
            a = arrays.get(p)
            dims = (
                list(rec.dims)
                if rec.dims is not None
                else [f"{p.rsplit('/', 1)[-1]}_{d}" for d in range(len(rec.shape))]
            )
            if a is None:
                a = arrays[p] = _Array(p, rec.dtype, tuple(rec.shape), grid, dims)
            elif (a.dtype, a.shape, a.chunks) != (rec.dtype, tuple(rec.shape), grid):
                dropped[p] = f"its dtype, shape or chunk grid changed at step {h.step}"
                del arrays[p]
                purge.add(p)
                continue
            for index, c in cells.items():
                key = "/".join([f"{p}/c/{i}", *map(str, index)])
                refs[key] = [f"{run_url}/{c.key}", c.offset, c.nbytes]
        for name, v in h.metrics.items():
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue
            metrics.setdefault(name, [float("nan")] * len(steps)).append(float(v))
        steps.append(h.step)
        slots.append(h.slot)
        for vals in metrics.values():
            vals.extend([float("nan")] * (len(steps) - len(vals)))
        added.append(h.step)
    if purge:
        refs = {
            k: v
            for k, v in refs.items()
            if k.rsplit("/c/", 1)[0] not in purge and k.removesuffix("/zarr.json") not in purge
        }
    n = len(steps)
    groups = {""}
    for p, a in arrays.items():
        refs[f"{p}/zarr.json"] = a.document(n)
        parts = p.split("/")
        groups.update("/".join(parts[:k]) for k in range(1, len(parts)))
    for g in groups - {""}:
        refs[f"{g}/zarr.json"] = json.dumps(
            {"zarr_format": 3, "node_type": "group", "attributes": {}}
        )
    for k, v in _inline_array(np.asarray(steps, dtype=np.int64), ["step"]).items():
        refs[f"step/{k}"] = v
    names = {}
    tops = {p.split("/", 1)[0] for p in arrays} | {"step"}
    for name, vals in metrics.items():
        var = name.replace("/", ".")
        var = f"metric.{var}" if var in tops else var
        names[var] = name
        for k, v in _inline_array(np.asarray(vals, dtype=np.float64), ["step"]).items():
            refs[f"{var}/{k}"] = v
    root_attrs = {
        "virtual": VIRTUAL_VERSION,
        "run": run_url,
        "timeline": timeline,
        "steps": steps,
        "slots": slots,
        "metrics": names,
        "metric_values": metrics,
        "left_out_steps": skipped,
        "left_out_arrays": dropped,
        "renamed": {f"/{k}/": f"/{v}/" for k, v in RENAMED.items()},
    }
    refs["zarr.json"] = json.dumps(
        {"zarr_format": 3, "node_type": "group", "attributes": {"dstt": root_attrs}}
    )
    body = json.dumps(
        {"version": 1, "refs": {f"{ROOT}/{k}": v for k, v in refs.items()}},
        separators=(",", ":"),
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return VirtualReport(
        path=path,
        steps=tuple(steps),
        added=tuple(added),
        arrays=len(arrays),
        left_out_steps={int(k.split(":")[1]): v for k, v in skipped.items()},
        left_out_arrays=dropped,
    )
