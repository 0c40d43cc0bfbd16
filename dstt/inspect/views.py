"""Build lazy xarray objects (DataArray, DataTree) from commits and their arrays tables.

Views are assembled from :mod:`dstt.inspect.lazy` backend arrays and carry no data until
values are asked for. A snapshot selection is a ``DataTree`` mirroring module paths
(``layers.0.attn.q_proj.weight`` -> node ``layers/0/attn/q_proj``, variable ``weight``), each
tensor with its own dims, a tied name with ``attrs["tied_to"]``. A trajectory is a
``DataArray`` with a leading ``step`` dimension and ``slot``, ``timeline``, ``time`` along it.

Rejected alternative: one flat ``Dataset`` keyed by dotted names — it loses the module
hierarchy users navigate by, and xarray's dotted variable names do not tab-complete.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from dstt.schema import tree_location, user_name

from .lazy import CommitArray, ReaderPool, TrajectoryArray, variable
from .summaries import step_coords

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from dstt.store._internal import CommitHeader

    from .catalog import Catalog

__all__ = ["layer_tree", "tensor_dataarray", "trajectory_dataarray"]


def _attrs(path: str, record: Any, catalog: Catalog) -> dict[str, Any]:  # noqa: ANN401 - a stored or a logical record
    attrs = {"store_path": record.path, "store_dtype": record.dtype, "name": user_name(path)}
    tied = catalog.tied_to(path)
    if tied is not None:
        attrs["tied_to"] = tied  # one tensor under two names: its bytes are stored once
    return attrs


def _variable(
    readers: ReaderPool,
    header: CommitHeader,
    catalog: Catalog,
    path: str,
    chunks: Any,  # noqa: ANN401 - xarray's chunks
) -> xr.Variable:
    rec = catalog.table[path]
    return variable(
        CommitArray(readers, header, rec),
        catalog.dims_of(path, len(rec.shape)),
        chunks,
        _attrs(path, rec, catalog),
    )


def tensor_dataarray(
    readers: ReaderPool,
    header: CommitHeader,
    catalog: Catalog,
    path: str,
    *,
    chunks: Any = None,  # noqa: ANN401 - xarray's chunks
) -> xr.DataArray:
    """Lazy DataArray of one tensor of one commit, with a scalar ``step`` coordinate."""
    var = _variable(readers, header, catalog, path, chunks)
    return xr.DataArray(var, coords={"step": np.int64(header.step)}, name=user_name(path))


def layer_tree(
    readers: ReaderPool,
    header: CommitHeader,
    catalog: Catalog,
    paths: Sequence[str],
    *,
    picks: Mapping[str, tuple[str, int]] | None = None,
    chunks: Any = None,  # noqa: ANN401 - xarray's chunks
) -> xr.DataTree:
    """Lazy DataTree of ``paths`` (paths of ``catalog``, one commit's) laid out by module
    path. ``picks`` narrows fused-experts tensors to one expert (path -> (dim, index),
    :func:`dstt.inspect.selection.select_layer`): a lazy ``isel``, the index kept as a scalar
    coordinate of the node."""
    nodes: dict[str, dict[str, xr.Variable]] = {}
    coords: dict[str, dict[str, Any]] = {}
    for p in paths:
        node, name = tree_location(p)
        var = _variable(readers, header, catalog, p, chunks)
        if picks and p in picks:
            dim, index = picks[p]
            var = var.isel({dim: index})
            coords.setdefault(node, {})[dim] = np.int64(index)
        nodes.setdefault(node, {})[name] = var
    root = xr.Dataset(
        nodes.pop("", {}),
        coords={"step": np.int64(header.step), **coords.pop("", {})},
        attrs={
            "step": int(header.step),
            "slot": int(header.slot),
            "timeline": header.timeline,
            "time": float(header.time),
        },
    )
    tree: dict[str, xr.Dataset] = {"/": root}
    for node in sorted(nodes):
        tree[node] = xr.Dataset(nodes[node], coords=coords.get(node))
    return xr.DataTree.from_dict(tree)


def trajectory_dataarray(
    readers: ReaderPool,
    headers: Sequence[Any],
    path: str,
    newest: Catalog,
    *,
    chunks: Any = None,  # noqa: ANN401 - xarray's chunks
) -> xr.DataArray:
    """Lazy DataArray of tensor ``path`` over ``headers`` (commits of one timeline, ascending
    unique steps).

    Shape, dtype and dim names come from ``newest`` (the catalog of the newest commit
    holding the tensor); the other steps' tables are read only when their values are. A tied
    name reads its target's bytes at every step.
    """
    ref = newest.table[path]
    backend = TrajectoryArray(
        readers, headers, newest.tied.get(path, path), tuple(ref.shape), ref.dtype
    )
    dims = ("step", *newest.dims_of(path, len(ref.shape)))
    attrs = _attrs(path, ref, newest)
    attrs["timeline"] = headers[-1].timeline if headers else None
    coords = step_coords(
        [h.step for h in headers],
        [h.slot for h in headers],
        [h.timeline for h in headers],
        [h.time for h in headers],
    )
    return xr.DataArray(variable(backend, dims, chunks, attrs), coords=coords, name=user_name(path))
