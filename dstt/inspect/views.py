"""Build lazy xarray objects (DataArray, DataTree) from commits and their arrays tables.

Views are assembled from :mod:`dstt.inspect.lazy` backend arrays and carry no data until
values are asked for. A snapshot selection becomes a ``DataTree`` mirroring module paths
(``layers.0.attn.q_proj.weight`` -> node ``layers/0/attn/q_proj``, variable ``weight``) with the
scalar ``step`` coordinate at the root; each tensor keeps its own local dims
(:func:`dstt.inspect.naming.tensor_dims`). A trajectory is a ``DataArray`` with a leading
``step`` dimension (index, unique and ascending) and ``slot``, ``timeline`` and ``time``
(``datetime64[ns]``, UTC) coordinates along it.

Rejected alternative: one flat ``Dataset`` keyed by dotted names — it loses the module
hierarchy users navigate by, and xarray's dotted variable names do not tab-complete.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import xarray as xr

from ..schema import tree_location, user_name
from .lazy import CommitArray, ReaderPool, TrajectoryArray, variable
from .naming import tensor_dims
from .summaries import step_coords

__all__ = ["layer_tree", "tensor_dataarray", "trajectory_dataarray"]


def _attrs(record: Any) -> dict[str, Any]:
    return {"store_path": record.path, "store_dtype": record.dtype,
            "name": user_name(record.path)}


def _commit_attrs(header: Any) -> dict[str, Any]:
    return {"step": int(header.step), "slot": int(header.slot), "timeline": header.timeline,
            "time": float(header.time)}


def tensor_dataarray(readers: ReaderPool, header: Any, arrays: Mapping[str, Any], path: str, *,
                     chunks: Any = None,
                     dims_of: Callable[[str, int], tuple[str, ...]] | None = None
                     ) -> xr.DataArray:
    """Lazy DataArray of one tensor of one commit, with a scalar ``step`` coordinate."""
    rec = arrays[path]
    dims = (dims_of or tensor_dims(arrays))(path, len(rec.shape))
    var = variable(CommitArray(readers, header, rec), dims, chunks, _attrs(rec))
    return xr.DataArray(var, coords={"step": np.int64(header.step)}, name=user_name(path))


def layer_tree(readers: ReaderPool, header: Any, arrays: Mapping[str, Any], paths: Sequence[str], *,
               chunks: Any = None,
               dims_of: Callable[[str, int], tuple[str, ...]] | None = None) -> xr.DataTree:
    """Lazy DataTree of ``paths`` (store paths of one commit) laid out by module path.

    ``dims_of`` is ``tensor_dims(arrays)``, passed in by callers that build many views of one
    commit (it scans every path once)."""
    dims_of = dims_of or tensor_dims(arrays)
    nodes: dict[str, dict[str, xr.Variable]] = {}
    for p in paths:
        rec = arrays[p]
        node, var = tree_location(p)
        nodes.setdefault(node, {})[var] = variable(
            CommitArray(readers, header, rec), dims_of(p, len(rec.shape)), chunks, _attrs(rec))
    root = xr.Dataset(nodes.pop("", {}), coords={"step": np.int64(header.step)},
                      attrs=_commit_attrs(header))
    tree: dict[str, xr.Dataset] = {"/": root}
    for node in sorted(nodes):
        tree[node] = xr.Dataset(nodes[node])
    return xr.DataTree.from_dict(tree)


def trajectory_dataarray(readers: ReaderPool, headers: Sequence[Any], path: str,
                         newest: Mapping[str, Any], *, chunks: Any = None) -> xr.DataArray:
    """Lazy DataArray of tensor ``path`` over ``headers`` (commits of one timeline, ascending
    unique steps).

    Shape, dtype and dim names come from ``newest`` (the arrays table of the newest commit
    holding the tensor); the other steps' tables are read only when their values are.
    """
    ref = newest[path]
    backend = TrajectoryArray(readers, headers, path, tuple(ref.shape), ref.dtype)
    dims = ("step", *tensor_dims(newest)(path, len(ref.shape)))
    attrs = _attrs(ref)
    attrs["timeline"] = headers[-1].timeline if headers else None
    coords = step_coords([h.step for h in headers], [h.slot for h in headers],
                         [h.timeline for h in headers], [h.time for h in headers])
    return xr.DataArray(variable(backend, dims, chunks, attrs), coords=coords,
                        name=user_name(path))
