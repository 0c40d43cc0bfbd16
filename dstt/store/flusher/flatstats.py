"""Write-time digests of the tensors in a flat step buffer, with numpy only (no torch).

The engine's write-time summaries (``dstt.engine.summaries``: what each field means) are
computed here from the same host buffer the step file is written from, so they run where the
flush runs — a writer thread, or the flusher process, which has no torch and no GIL shared
with training. Per dtype region of parameters (the flat layout groups them) a fixed number of
numpy calls, whatever the number of tensors: one conversion to float32 where needed
(bf16/fp16/ints), ``maximum``/``minimum.reduceat`` for max|x| and ``add.reduceat`` of the
squares (into a reused scratch buffer) for the sum of squares — each over the tensors' own
elements (what lies between tensors, zero padding or zip headers, falls in the odd segments
and is dropped) — and one gather and one scatter of every probe. A tensor whose sums are not
finite gets an exact float64 pass that counts NaN/Inf and skips them. Where the tensors are
few and large (their mean at least ``LARGE`` elements) the squares are summed per tensor with a
fused ``einsum`` instead: a Python call per tensor is then cheaper than a pass writing squares.
Rejected: a loop over tensors (one ``einsum`` each, 2 ms of Python per 400 tensors per step,
doubled next to a busy training loop), and BLAS ``dot`` (OpenBLAS wakes its thread pool for
long vectors; its spinning threads took CPU from training — measured).

Exact updates: with a ``token`` (the step's id), ``digest`` also keeps a private copy of the
parameter regions (``DigestPlan`` holds it, one per process: the flusher's own) and, when it
has the previous digested step's copy, sums the squared differences per tensor the same way
(``subtract`` into the scratch buffer, ``square``, ``add.reduceat``): column ``upd_sumsq``
(NaN without a copy) and ``prev_token`` (whose copy it was, -1 for none). The caller calls
the update exact only where ``prev_token`` names the step's parent commit. Per step that is
one copy of the parameter bytes and one more pass over them and the copy, in this thread
(the flusher process at ``SCHED_IDLE``); memory: one step's parameters more. Rejected:
holding the previous step's ring buffer until the next digest (a buffer fewer for the copy
thread: training would wait on the disk sooner) and reading both steps back at read time
(whole tensors per step, and impossible once gc freed the parent).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt.store.format.zarr_meta import dtype_itemsize, numpy_dtype

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["DigestPlan", "digest"]

#: elements per ``einsum`` call (its float32 partial sums stay accurate: tested)
BLOCK = 1 << 20
#: a region whose tensors average this many elements sums them one by one
LARGE = 1 << 16


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
    #: where each gathered probe goes: (member, column) in the probe matrix
    probe_rows: np.ndarray
    probe_cols: np.ndarray
    probe_len: np.ndarray  # per member
    full: np.ndarray  # indices (in the region) of the non-empty members
    numel: np.ndarray  # of the non-empty members
    #: few tensors of many elements each: a per-tensor fused sum beats writing the squares
    few_large: bool = False


class DigestPlan:
    """Where the digested tensors sit in the buffer, and which elements each one probes."""

    def __init__(
        self, items: Sequence[tuple[str, str, int, int, np.ndarray]], probe_size: int
    ) -> None:
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
        self._scratch: list[np.ndarray] = []  # float32 squares, one per concurrent digest
        self._lock = threading.Lock()
        #: the last digested step's parameter bytes per region, and its token
        self._prev: list[np.ndarray] | None = None
        self._prev_token = -1
        self._prev_lock = threading.Lock()

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
        idx = [
            np.asarray(p, dtype=np.intp) + s for (s, _), (*_, p) in zip(members, run, strict=True)
        ]
        lens = np.array([len(i) for i in idx], dtype=np.int64)
        gidx = np.concatenate(idx) if idx else np.empty(0, np.intp)
        rows = np.repeat(np.arange(len(run), dtype=np.intp), lens)
        cols = (
            np.concatenate([np.arange(n, dtype=np.intp) for n in lens])
            if idx
            else np.empty(0, np.intp)
        )
        nonempty = np.array([j for j, (_, n) in enumerate(members) if n > 0], dtype=np.intp)
        numel = np.array([n for _, n in members if n > 0], np.int64)
        few_large = bool(len(numel)) and float(numel.mean()) >= LARGE
        return _Region(
            dtype,
            start,
            end,
            members,
            bounds_se,
            gidx.astype(np.intp),
            rows,
            cols,
            lens,
            nonempty,
            numel,
            few_large,
        )

    def __getstate__(self) -> dict[str, Any]:  # sent to the flusher process: no lock
        skip = ("_scratch", "_lock", "_prev", "_prev_token", "_prev_lock")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._scratch, self._lock = [], threading.Lock()
        self._prev, self._prev_token, self._prev_lock = None, -1, threading.Lock()

    def updates(self, host: np.ndarray, token: int) -> tuple[np.ndarray, int]:
        """Each tensor's squared distance to the previous digested step's copy (NaN where
        there is none) and that step's token (-1 for none); then this step's parameter
        bytes (``host``: the whole buffer) become the copy, under ``token``."""
        with self._prev_lock:
            upd = np.full(len(self.paths), np.nan)
            prev, prev_token = self._prev, self._prev_token
            if prev is not None and len(prev) == len(self.regions):
                row = 0
                for reg, old in zip(self.regions, prev, strict=True):
                    if len(reg.full) and len(old) == reg.end - reg.start:
                        x = _as_float(host[reg.start : reg.end], reg.dtype)
                        _region_updates(self, reg, x, _as_float(old, reg.dtype), row, upd)
                    row += len(reg.members)
            else:
                prev_token = -1
            if prev is None or len(prev) != len(self.regions):
                prev = [np.empty(reg.end - reg.start, np.uint8) for reg in self.regions]
            for reg, old in zip(self.regions, prev, strict=True):
                np.copyto(old, host[reg.start : reg.end])
            self._prev, self._prev_token = prev, token
            return upd, prev_token

    def scratch(self, n: int) -> np.ndarray:
        """A float32 buffer of at least ``n`` elements, held until :meth:`give_back`."""
        with self._lock:
            for i, b in enumerate(self._scratch):
                if len(b) >= n:
                    return self._scratch.pop(i)
        return np.empty(n, dtype=np.float32)

    def give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._scratch) < 4:
                self._scratch.append(buf)


def _as_float(raw: np.ndarray, dtype: str) -> np.ndarray:
    x = raw.view(numpy_dtype(dtype))
    return x if dtype in ("float32", "float64") else x.astype(np.float32)


def digest(
    plan: DigestPlan, buf: np.ndarray | memoryview, token: int | None = None
) -> dict[str, Any]:
    """Columns over ``plan.paths``: ``sumsq maxabs`` (float64, over the finite elements),
    ``finite nan inf`` (int64), ``probe`` (float64, NaN-padded to ``probe_size``) and
    ``probe_len``; with ``token`` (an id of this step, not -1) also ``upd_sumsq`` (float64:
    the squared distance of each tensor to the previous digested step's copy, NaN where
    there is none or it is not finite) and ``prev_token`` (that step's token, -1 for none),
    and this step's parameters become the copy the next digest compares with."""
    out = _digest(plan, buf)
    if token is not None:
        upd, prev_token = plan.updates(np.frombuffer(buf, dtype=np.uint8), token)
        out["upd_sumsq"], out["prev_token"] = upd, prev_token
    return out


def _region_updates(
    plan: DigestPlan, reg: _Region, x: np.ndarray, old: np.ndarray, row: int, upd: np.ndarray
) -> None:
    """Per member: the sum of squares of ``x - old`` (float32 differences and squares,
    float64 for a float64 region, summed pairwise by ``reduceat``; a member whose sum is
    not finite in float32 gets a float64 pass, NaN if the difference itself is not finite)."""
    if x.dtype == np.float64:  # (rare) float32 differences would round its small updates
        with np.errstate(over="ignore", invalid="ignore"):
            d64 = x - old
            ss = np.add.reduceat(d64 * d64, reg.bounds_se)[::2]
    else:
        sq = plan.scratch(len(x))
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # headers between members
                d = sq[: len(x)]
                np.subtract(x, old, out=d)  # exact for nearby values (Sterbenz)
                if reg.few_large:  # as ``_region_sums``: a fused sum each, no squares written
                    ss = np.array([_sumsq(d[s : s + n]) for s, n in reg.members if n > 0])
                else:
                    np.square(d, out=d)
                    ss = np.add.reduceat(d, reg.bounds_se)[::2].astype(np.float64)
        finally:
            plan.give_back(sq)
    rows = row + reg.full
    ok = np.isfinite(ss)
    upd[rows[ok]] = ss[ok]
    for k in np.flatnonzero(~ok).tolist():
        s, n = reg.members[int(reg.full[k])]
        d64 = x[s : s + n].astype(np.float64) - old[s : s + n].astype(np.float64)
        upd[int(rows[k])] = float(np.dot(d64, d64)) if np.all(np.isfinite(d64)) else np.nan


def _digest(plan: DigestPlan, buf: np.ndarray | memoryview) -> dict[str, Any]:
    host = np.frombuffer(buf, dtype=np.uint8)
    n_all = len(plan.paths)
    sumsq = np.zeros(n_all)
    maxabs = np.zeros(n_all)
    counts = np.zeros((3, n_all), dtype=np.int64)  # finite, nan, inf
    probe = np.full((n_all, plan.probe_size), np.nan)
    probe_len = np.zeros(n_all, dtype=np.int64)
    row = 0
    for reg in plan.regions:
        x = _as_float(host[reg.start : reg.end], reg.dtype)
        probe[row + reg.probe_rows, reg.probe_cols] = x[reg.probe_index]
        probe_len[row : row + len(reg.members)] = reg.probe_len
        if len(reg.full):
            _region_sums(plan, reg, x, row, sumsq, maxabs, counts)
        row += len(reg.members)
    return {
        "sumsq": sumsq,
        "maxabs": maxabs,
        "finite": counts[0],
        "nan": counts[1],
        "inf": counts[2],
        "probe": probe,
        "probe_len": probe_len,
    }


def _sumsq(seg: np.ndarray) -> float:
    return sum(
        float(np.einsum("i,i->", seg[b : b + BLOCK], seg[b : b + BLOCK]))
        for b in range(0, len(seg), BLOCK)
    )


def _region_sums(
    plan: DigestPlan,
    reg: _Region,
    x: np.ndarray,
    row: int,
    sumsq: np.ndarray,
    maxabs: np.ndarray,
    counts: np.ndarray,
) -> None:
    """Sum of squares and max|x| of every member: ``reduceat`` passes over the region
    (``add`` sums pairwise: as exact as a per-tensor einsum; the squares in a reused
    scratch buffer) or, for few large members, a fused sum each; a member whose sums are
    not finite gets an exact float64 pass (``_exact``)."""
    hi = np.maximum.reduceat(x, reg.bounds_se)[::2]
    lo = np.minimum.reduceat(x, reg.bounds_se)[::2]
    if reg.few_large:  # a handful of big tensors: a fused einsum each, no squares written
        ss = np.array([_sumsq(x[s : s + n]) for s, n in reg.members if n > 0])
    else:
        sq = plan.scratch(len(x))
        try:
            with np.errstate(over="ignore", invalid="ignore"):  # headers between members
                np.square(x, out=sq[: len(x)], dtype=np.float32)
                ss = np.add.reduceat(sq[: len(x)], reg.bounds_se)[::2].astype(np.float64)
        finally:
            plan.give_back(sq)
    m = np.maximum(hi.astype(np.float64), -lo.astype(np.float64))
    rows = row + reg.full
    ok = np.isfinite(ss) & np.isfinite(m)
    sumsq[rows[ok]] = ss[ok]
    maxabs[rows[ok]] = m[ok]
    counts[0, rows[ok]] = reg.numel[ok]
    for k in np.flatnonzero(~ok).tolist():  # NaN/Inf present, or the squares overflowed
        s, n = reg.members[int(reg.full[k])]
        _exact(x[s : s + n], int(rows[k]), sumsq, maxabs, counts)


def _exact(
    seg: np.ndarray, r: int, sumsq: np.ndarray, maxabs: np.ndarray, counts: np.ndarray
) -> None:
    """Row ``r`` from one tensor in float64, counting and skipping NaN/Inf."""
    x64 = seg.astype(np.float64)
    good_mask = np.isfinite(x64)
    n_ok = int(good_mask.sum())
    n_nan = int(np.isnan(x64).sum())
    good = x64[good_mask]
    sumsq[r] = float(np.dot(good, good))
    maxabs[r] = float(np.abs(good).max()) if n_ok else 0.0
    counts[:, r] = (n_ok, n_nan, len(seg) - n_ok - n_nan)
