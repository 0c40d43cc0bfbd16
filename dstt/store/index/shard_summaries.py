"""Write-time summaries of sharded tensors, folded into one row per logical tensor.

A rank stores its shard of a DTensor as ``dtensor/w<world>/r<rank>/<logical path>`` and
summarises what it wrote, so a commit holds a summaries row per *shard*; the index folds the
rows of a logical tensor's shards into one column: ``l2`` = sqrt(sum of l2²), ``nan``/``inf``
sums, ``maxabs`` max; ``rms`` over the element counts (l2 / rms)²; ``update_*`` only when every
shard has one; ``probe`` the shards' probes in path order, cut to the longest. The logical path
is read from the shard's own path, so folding needs no shard map.

Rejected alternative: summarising logical tensors at commit time on rank 0 — rank 0 would have
to read every rank's bytes back, or a collective would run per step.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

import numpy as np

from dstt.store.format.segment import SCALARS

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["DTENSOR_PREFIX", "fold_columns", "logical_of", "shard_source"]

DTENSOR_PREFIX = "dtensor"
_SHARD = re.compile(rf"^{DTENSOR_PREFIX}/w\d+/r\d+/(.+)$")
_I = {f: i for i, f in enumerate(SCALARS)}


def shard_source(world: int, rank: int, path: str) -> str:
    """The stored array of rank ``rank``'s shard of the logical tensor ``path``."""
    return f"{DTENSOR_PREFIX}/w{world}/r{rank}/{path}"


def logical_of(path: str) -> str | None:
    """The logical tensor a shard source holds part of (None for any other array)."""
    m = _SHARD.match(path)
    return m.group(1) if m else None


def _fold(vals: np.ndarray) -> np.ndarray:
    """``vals``: (shards, scalars) -> the logical tensor's scalars (NaN where unknown)."""
    out = np.full(len(SCALARS), np.nan)
    if not len(vals) or np.all(np.isnan(vals)):
        return out
    l2 = vals[:, _I["l2"]]
    rms = vals[:, _I["rms"]]
    out[_I["l2"]] = math.sqrt(float(np.nansum(l2**2)))
    counted = (rms > 0) & np.isfinite(rms) & np.isfinite(l2)
    n = float(np.sum((l2[counted] / rms[counted]) ** 2))
    out[_I["rms"]] = math.sqrt(float(np.sum(l2[counted] ** 2)) / n) if n > 0 else 0.0
    out[_I["maxabs"]] = float(np.nanmax(vals[:, _I["maxabs"]]))
    out[_I["nan"]] = float(np.nansum(vals[:, _I["nan"]]))
    out[_I["inf"]] = float(np.nansum(vals[:, _I["inf"]]))
    upd = vals[:, _I["update_l2"]]
    if not np.any(np.isnan(upd)):
        u = math.sqrt(float(np.sum(upd**2)))
        out[_I["update_l2"]] = u
        total = out[_I["l2"]]
        out[_I["update_ratio"]] = u / total if total > 0 else np.nan
    return out


def _groups(paths: Sequence[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for j, p in enumerate(paths):
        logical = logical_of(p)
        if logical is not None:
            groups.setdefault(logical, []).append(j)
    for js in groups.values():
        js.sort(key=lambda j: paths[j])
    return groups


def fold_columns(
    paths: Sequence[str], has: np.ndarray, val: np.ndarray, exact: np.ndarray, probe: np.ndarray
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """The index's summaries columns (rows x paths) with every logical tensor's shard columns
    folded into one column named by the logical path; other columns as they are. ``has`` is
    per row and unchanged."""
    groups = _groups(paths)
    if not groups:
        return list(paths), val, exact, probe
    keep = [j for j, p in enumerate(paths) if logical_of(p) is None]
    names = [paths[j] for j in keep] + sorted(groups)
    n_rows = val.shape[0]
    v_out = np.full((n_rows, len(names), val.shape[2]), np.nan)
    e_out = np.zeros((n_rows, len(names)), exact.dtype)
    p_out = np.full((n_rows, len(names), probe.shape[2]), np.nan, probe.dtype)
    v_out[:, : len(keep)] = val[:, keep]
    e_out[:, : len(keep)] = exact[:, keep]
    p_out[:, : len(keep)] = probe[:, keep]
    for k, logical in enumerate(sorted(groups), start=len(keep)):
        js = groups[logical]
        for i in range(n_rows):
            v_out[i, k] = _fold(val[i, js])
            e_out[i, k] = int(bool(np.all(exact[i, js])))
            flat = probe[i, js].reshape(-1)
            flat = flat[~np.isnan(flat)][: probe.shape[2]]
            p_out[i, k, : len(flat)] = flat
    order = sorted(range(len(names)), key=lambda j: names[j])
    return ([names[j] for j in order], v_out[:, order], e_out[:, order], p_out[:, order])
