"""Write-time digests of the tensors in a flat step buffer, with numpy only (no torch).

The engine's write-time summaries (``dstt.engine.summaries``: what each field means) are
computed here from the same host buffer the step file is written from, so they run where the
flush runs — a writer thread, or the flusher process, which has no torch and no GIL shared
with training. Per dtype region of parameters (the flat layout groups them): one conversion
to float32 where needed (bf16/fp16/ints), one ``maximum.reduceat``/``minimum.reduceat`` pass
for max|x| (over each tensor's own elements: what lies between tensors, zero padding or zip
headers, is left out), one gather of every probe;
per tensor one ``einsum`` per block of 2^20 elements for the sum of squares (not BLAS
``dot``: OpenBLAS wakes its thread pool for vectors this long, and its spinning threads took
CPU from training — measured; einsum is single-threaded, as fast, and as exact). A non-finite
sum sends that tensor to an exact float64 pass that counts NaN/Inf and skips them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .format.zarr_meta import dtype_itemsize, numpy_dtype

__all__ = ["BLOCK", "DigestPlan", "digest"]

BLOCK = 1 << 20


@dataclass(frozen=True)
class _Region:
    dtype: str
    start: int  # bytes, in the buffer
    end: int
    members: tuple[tuple[int, int], ...]  # (element offset in the region, numel)
    #: start, end, start, end... element offsets of the non-empty members, for ``reduceat``
    #: (its even results are the members; the odd ones span what lies between them — zero
    #: padding, or a framed layout's zip headers — and are dropped)
    bounds_se: np.ndarray
    probe_index: np.ndarray  # every member's probes, as element offsets in the region
    bounds: tuple[int, ...]  # member j's probes are probe_index[bounds[j]:bounds[j + 1]]


class DigestPlan:
    """Where the digested tensors sit in the buffer, and which elements each one probes."""

    def __init__(self, items: Sequence[tuple[str, str, int, int, np.ndarray]],
                 probe_size: int) -> None:
        """``items``: (path, store dtype, byte offset, numel, probe indices) per tensor,
        consecutive tensors of one dtype forming one region."""
        self.probe_size = probe_size
        self.paths = [it[0] for it in items]
        self.numel = np.array([it[3] for it in items], dtype=np.int64)
        self.regions: list[_Region] = []
        run: list[tuple[str, str, int, int, np.ndarray]] = []
        for it in [*items, None]:
            if run and (it is None or it[1] != run[0][1]):
                self.regions.append(self._region(run))
                run = []
            if it is not None:
                run.append(it)

    @staticmethod
    def _region(run: list[tuple[str, str, int, int, np.ndarray]]) -> _Region:
        dtype = run[0][1]
        size = dtype_itemsize(dtype)
        full = [it for it in run if it[3] > 0]  # an empty tensor's offset means nothing
        start = full[0][2] if full else 0
        end = full[-1][2] + full[-1][3] * size if full else 0
        members = tuple(((off - start) // size if n > 0 else 0, n) for _, _, off, n, _ in run)
        se = [v for s, n in members if n > 0 for v in (s, s + n)]
        if se and se[-1] == (end - start) // size:
            se.pop()  # reduceat's last segment runs to the end anyway
        bounds_se = np.array(se, dtype=np.intp)
        idx = [np.asarray(p, dtype=np.intp) + s for (s, _), (*_, p) in zip(members, run,
                                                                           strict=True)]
        bounds = tuple(np.cumsum([0, *(len(i) for i in idx)]).tolist())
        gidx = np.concatenate(idx) if idx else np.empty(0, np.intp)
        return _Region(dtype, start, end, members, bounds_se, gidx.astype(np.intp), bounds)


def _as_float(raw: np.ndarray, dtype: str) -> np.ndarray:
    x = raw.view(numpy_dtype(dtype))
    return x if dtype in ("float32", "float64") else x.astype(np.float32)


def digest(plan: DigestPlan, buf: np.ndarray | memoryview) -> dict[str, np.ndarray]:
    """Columns over ``plan.paths``: ``sumsq maxabs`` (float64, over the finite elements),
    ``finite nan inf`` (int64), ``probe`` (float64, NaN-padded to ``probe_size``) and
    ``probe_len``."""
    host = np.frombuffer(buf, dtype=np.uint8)
    n_all = len(plan.paths)
    sumsq = np.zeros(n_all)
    maxabs = np.zeros(n_all)
    counts = np.zeros((3, n_all), dtype=np.int64)  # finite, nan, inf
    probe = np.full((n_all, plan.probe_size), np.nan)
    probe_len = np.zeros(n_all, dtype=np.int64)
    row = 0
    for reg in plan.regions:
        x = _as_float(host[reg.start:reg.end], reg.dtype)
        if len(reg.bounds_se):
            hi = np.maximum.reduceat(x, reg.bounds_se)[::2]
            lo = np.minimum.reduceat(x, reg.bounds_se)[::2]
        values = x[reg.probe_index].astype(np.float64)
        k = 0
        for j, (s, n) in enumerate(reg.members):
            r = row + j
            a, b = reg.bounds[j], reg.bounds[j + 1]
            probe[r, :b - a] = values[a:b]
            probe_len[r] = b - a
            if n == 0:
                continue
            seg = x[s:s + n]
            ss = 0.0
            for blk in range(0, n, BLOCK):
                part = seg[blk:blk + BLOCK]
                ss += float(np.einsum("i,i->", part, part))
            m = max(float(hi[k]), -float(lo[k]))
            k += 1
            if math.isfinite(ss) and math.isfinite(m):
                sumsq[r], maxabs[r], counts[0, r] = ss, m, n
                continue
            x64 = seg.astype(np.float64)  # NaN/Inf present, or the squares overflowed
            ok = np.isfinite(x64)
            n_ok = int(ok.sum())
            n_nan = int(np.isnan(x64).sum())
            good = x64[ok]
            sumsq[r] = float(np.dot(good, good))
            maxabs[r] = float(np.abs(good).max()) if n_ok else 0.0
            counts[:, r] = (n_ok, n_nan, n - n_ok - n_nan)
        row += len(reg.members)
    return {"sumsq": sumsq, "maxabs": maxabs, "finite": counts[0], "nan": counts[1],
            "inf": counts[2], "probe": probe, "probe_len": probe_len}
