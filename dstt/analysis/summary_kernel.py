"""The one kernel of write-time summaries: numpy over a flat array and segment offsets.

Every summary dstt stores (the flat lane in a writer thread or the torch-free flusher, the
chunk lane per host chunk, the importer) is computed here, per tensor (a *segment*): sum of
squares and max|x| of the finite elements, NaN/Inf counts, probed values, squared distance to
the previous step's copy. A segment's numbers depend only on its own elements, never on its
neighbours, so two lanes handed one tensor store the same bits. Squares are float32, summed
pairwise by ``add.reduceat`` (segments under ``LARGE`` elements) or a fused ``einsum`` per
``BLOCK`` (float64 across blocks); a segment whose sums are not finite is redone in float64,
skipping NaN/Inf. Rejected: a torch formula for the chunk lane (a second kernel, and the
flusher has no torch) and BLAS ``dot`` (its thread pool spun next to training: measured).
"""

from __future__ import annotations

import functools
import itertools
import threading
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dstt import schema
from dstt.errors import SchemaError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "BLOCK",
    "LARGE",
    "PROBE_SIZE",
    "DigestPlan",
    "Segments",
    "as_float",
    "digest",
    "finish_columns",
    "probe_indices",
    "segment_stats",
    "segment_updates",
]

#: elements probed per tensor (fixed flat indices: the same at every step, in every process)
PROBE_SIZE = 16
#: elements per ``einsum`` call of a large segment (its float32 partial sums stay accurate)
BLOCK = 1 << 20
#: a segment of at least this many elements is summed by itself (no squares written)
LARGE = 1 << 16


@functools.lru_cache(maxsize=65536)
def _probe_indices(path: str, numel: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(path.encode()))
    idx = rng.choice(numel, size=min(k, numel), replace=False)
    idx.sort()
    idx.setflags(write=False)
    return idx


def probe_indices(path: str, numel: int, k: int = PROBE_SIZE) -> np.ndarray:
    """Sorted flat indices probed for ``path``: drawn without replacement by a generator seeded
    from the path, so deterministic in path, numel and k (cached, read-only)."""
    return _probe_indices(path, int(numel), int(k))


def as_float(x: np.ndarray) -> np.ndarray:
    """float32/float64 as they are; bf16, fp16 and integers as float32 (exact for bf16/fp16)."""
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


@dataclass(frozen=True)
class Segments:
    """Where the members (tensors) lie in one flat array, and which elements each probes.

    Built once per layout (:meth:`build`); ``runs`` and ``large`` say how each non-empty
    member's squares are summed, by its own size only."""

    numel: np.ndarray  # per member (an empty member's offset means nothing)
    full: np.ndarray  # indices of the non-empty members
    stop: int  # the end of the last non-empty member: arrays are cut there
    #: start, end, start, end, ..., start of the non-empty members, for ``reduceat`` (the odd
    #: results span what lies between them and are dropped; the last runs to ``stop``)
    bounds: np.ndarray
    #: runs of consecutive small members: (lo, hi, bounds relative to lo, positions in full)
    runs: tuple[tuple[int, int, np.ndarray, np.ndarray], ...]
    large: tuple[tuple[int, int, int], ...]  # (position in full, start, numel)
    squares: int  # the longest run: the scratch the squares of small members need
    probe_index: np.ndarray  # every member's probes, as element offsets in the array
    probe_rows: np.ndarray  # where each gathered probe goes: (member, column)
    probe_cols: np.ndarray
    probe_len: np.ndarray  # per member

    @classmethod
    def build(
        cls, start: Sequence[int], numel: Sequence[int], probes: Sequence[np.ndarray]
    ) -> Segments:
        """``start``/``numel``: element offset and size of each member, in order, not
        overlapping; ``probes``: each member's probed indices (offsets in the member)."""
        n = np.asarray(numel, dtype=np.int64).reshape(-1)
        s = np.asarray(start, dtype=np.int64).reshape(-1)
        full = np.flatnonzero(n > 0)
        fs, fn = s[full], n[full]
        if len(full) and (fs[0] < 0 or np.any(fs[1:] < fs[:-1] + fn[:-1])):
            raise SchemaError(
                "summary segments overlap or are out of order: pass each tensor's "
                "(start, numel) in buffer order"
            )
        if len(probes) != len(n) or any(
            len(p) and (np.min(p) < 0 or np.max(p) >= k) for p, k in zip(probes, n, strict=True)
        ):
            raise SchemaError("summary probes must be indices inside their own tensor")
        se = [v for a, m in zip(fs.tolist(), fn.tolist(), strict=True) for v in (a, a + m)]
        stop = se.pop() if se else 0
        runs: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        large: list[tuple[int, int, int]] = []
        run: list[int] = []
        for j in [*range(len(full)), None]:
            if j is None or fn[j] >= LARGE:
                if run:
                    lo, hi = int(fs[run[0]]), int(fs[run[-1]] + fn[run[-1]])
                    rel = [v - lo for i in run for v in (int(fs[i]), int(fs[i] + fn[i]))]
                    runs.append((lo, hi, np.array(rel[:-1], np.intp), np.array(run, np.intp)))
                    run = []
                if j is not None:
                    large.append((j, int(fs[j]), int(fn[j])))
            else:
                run.append(j)
        lens = np.array([len(p) for p in probes], dtype=np.int64)
        gidx = [np.asarray(p, dtype=np.intp) + a for p, a in zip(probes, s.tolist(), strict=True)]
        return cls(
            numel=n,
            full=full.astype(np.intp),
            stop=stop,
            bounds=np.array(se, dtype=np.intp),
            runs=tuple(runs),
            large=tuple(large),
            squares=max((hi - lo for lo, hi, _, _ in runs), default=0),
            probe_index=np.concatenate(gidx) if gidx else np.empty(0, np.intp),
            probe_rows=np.repeat(np.arange(len(n), dtype=np.intp), lens),
            probe_cols=(
                np.concatenate([np.arange(k, dtype=np.intp) for k in lens.tolist()])
                if len(lens)
                else np.empty(0, np.intp)
            ),
            probe_len=lens,
        )


def _fused(seg: np.ndarray) -> float:
    return sum(
        float(np.einsum("i,i->", seg[b : b + BLOCK], seg[b : b + BLOCK]))
        for b in range(0, len(seg), BLOCK)
    )


def _sum_squares(v: np.ndarray, segs: Segments, sq: np.ndarray | None) -> np.ndarray:
    """Per non-empty member, the sum of ``v**2`` in ``v``'s float type (float64 out): a
    fused sum each for large members, squares into ``sq`` (``v`` itself: in place; else at
    least ``segs.squares`` elements of ``v``'s dtype, or None) and ``add.reduceat`` per run
    of small ones."""
    if sq is not None and sq is not v and (sq.dtype != v.dtype or len(sq) < segs.squares):
        sq = None
    ss = np.empty(len(segs.full))
    for j, s, n in segs.large:
        ss[j] = _fused(v[s : s + n])
    for lo, hi, bounds, where in segs.runs:
        w = v[lo:hi]
        out = np.empty_like(w) if sq is None else sq[lo:hi] if sq is v else sq[: hi - lo]
        with np.errstate(over="ignore", invalid="ignore"):  # what lies between members
            np.square(w, out=out)
            ss[where] = np.add.reduceat(out, bounds)[::2]
    return ss


def _exact(seg: np.ndarray) -> tuple[float, float, int, int, int]:
    """Sum of squares and max|x| of the finite elements of ``seg`` in float64, and the
    counts of finite, NaN and Inf elements."""
    x64 = seg.astype(np.float64)
    good = x64[np.isfinite(x64)]
    n_nan = int(np.isnan(x64).sum())
    m = float(np.abs(good).max()) if len(good) else 0.0
    with np.errstate(over="ignore"):  # float64 values near its max: inf, as their l2 is
        ss = float(np.dot(good, good))
    return ss, m, len(good), n_nan, len(x64) - len(good) - n_nan


def segment_stats(
    x: np.ndarray, segs: Segments, width: int, scratch: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Per member of ``segs`` over the flat array ``x`` (any numeric dtype): ``sumsq`` and
    ``maxabs`` (float64, over the finite elements), ``finite nan inf`` (int64), ``probe``
    (float64, NaN-padded to ``width`` columns) and ``probe_len``. ``scratch``: a buffer of
    ``x``'s float type for the squares (``segs.squares`` elements), else allocated."""
    x = as_float(x)
    n = len(segs.numel)
    out = _empty_stats(n, width)
    sumsq, maxabs, probe = out["sumsq"], out["maxabs"], out["probe"]
    counts = np.zeros((3, n), dtype=np.int64)  # finite, nan, inf
    probe[segs.probe_rows, segs.probe_cols] = x[segs.probe_index]
    if len(segs.full):
        v = x[: segs.stop]
        hi = np.maximum.reduceat(v, segs.bounds)[::2].astype(np.float64)
        lo = np.minimum.reduceat(v, segs.bounds)[::2].astype(np.float64)
        ss = _sum_squares(v, segs, scratch)
        m = np.maximum(hi, -lo)
        rows = segs.full
        ok = np.isfinite(ss) & np.isfinite(m)
        sumsq[rows[ok]], maxabs[rows[ok]] = ss[ok], m[ok]
        counts[0, rows[ok]] = segs.numel[rows[ok]]
        for k in np.flatnonzero(~ok).tolist():  # NaN/Inf present, or the squares overflowed
            r, s = int(rows[k]), int(segs.bounds[2 * k])
            sumsq[r], maxabs[r], *c = _exact(v[s : s + int(segs.numel[r])])
            counts[:, r] = c
    out["finite"], out["nan"], out["inf"] = counts
    out["probe_len"] = segs.probe_len.copy()
    return out


def _empty_stats(n: int, width: int) -> dict[str, np.ndarray]:
    """:func:`segment_stats` columns of ``n`` tensors, zero (probes NaN)."""
    return {
        "sumsq": np.zeros(n),
        "maxabs": np.zeros(n),
        "finite": np.zeros(n, np.int64),
        "nan": np.zeros(n, np.int64),
        "inf": np.zeros(n, np.int64),
        "probe": np.full((n, width), np.nan),
        "probe_len": np.zeros(n, np.int64),
    }


def segment_updates(
    x: np.ndarray, old: np.ndarray, segs: Segments, scratch: np.ndarray | None = None
) -> np.ndarray:
    """Per member, the sum of squares of ``x - old`` (the previous step's array, same
    layout): differences and squares in ``x``'s float type (float32 differences of nearby
    values are exact, Sterbenz), summed as :func:`segment_stats` sums; a member whose sum is
    not finite is redone in float64, NaN if the difference itself is not finite; NaN for an
    empty member."""
    x, old = as_float(x), as_float(old)
    upd = np.full(len(segs.numel), np.nan)
    if not len(segs.full):
        return upd
    v, o = x[: segs.stop], old[: segs.stop]
    if scratch is None or scratch.dtype != v.dtype or len(scratch) < segs.stop:
        scratch = np.empty(segs.stop, dtype=v.dtype)
    d = scratch[: segs.stop]
    with np.errstate(over="ignore", invalid="ignore"):  # what lies between members
        np.subtract(v, o, out=d)
    ss = _sum_squares(d, segs, d)
    rows = segs.full
    ok = np.isfinite(ss)
    upd[rows[ok]] = ss[ok]
    for k in np.flatnonzero(~ok).tolist():
        r, s = int(rows[k]), int(segs.bounds[2 * k])
        e = s + int(segs.numel[r])
        with np.errstate(over="ignore", invalid="ignore"):  # inf - inf: NaN, no update
            d64 = v[s:e].astype(np.float64) - o[s:e].astype(np.float64)
            upd[r] = float(np.dot(d64, d64)) if np.all(np.isfinite(d64)) else np.nan
    return upd


@dataclass(frozen=True)
class _Region:
    dtype: np.dtype[Any]
    start: int  # bytes, in the buffer
    end: int
    rows: int  # its first member's row
    segs: Segments


class DigestPlan:
    """Where the summarised tensors sit in a flat byte buffer, grouped into regions of one
    dtype, and (for exact updates) this process's copy of the last digested step."""

    def __init__(
        self, items: Sequence[tuple[str, np.dtype[Any], int, int, np.ndarray]], probe_size: int
    ) -> None:
        """``items``: (path, numpy dtype, byte offset, numel, probe indices) per tensor, in
        buffer order; consecutive tensors of one dtype form one region."""
        self.probe_size = probe_size
        self.paths = [it[0] for it in items]
        self.numel = np.array([it[3] for it in items], dtype=np.int64)
        self.regions: list[_Region] = []
        row = 0
        for dt, group in itertools.groupby(items, key=lambda it: np.dtype(it[1])):
            run = list(group)
            full = [it for it in run if it[3] > 0]
            lo = full[0][2] if full else 0
            hi = full[-1][2] + full[-1][3] * dt.itemsize if full else 0
            segs = Segments.build(
                [(off - lo) // dt.itemsize if n > 0 else 0 for _, _, off, n, _ in run],
                [n for *_, n, _ in run],
                [p for *_, p in run],
            )
            self.regions.append(_Region(dt, lo, hi, row, segs))
            row += len(run)
        self._scratch: list[np.ndarray] = []  # float buffers, one per concurrent digest
        self._lock = threading.Lock()
        self._prev: list[np.ndarray] | None = None  # the last digested step's region bytes
        self._prev_token = -1
        self._prev_lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # sent to the flusher process: no lock
        skip = ("_scratch", "_lock", "_prev", "_prev_token", "_prev_lock")
        return {k: v for k, v in self.__dict__.items() if k not in skip}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._scratch, self._lock = [], threading.Lock()
        self._prev, self._prev_token, self._prev_lock = None, -1, threading.Lock()

    def _view(self, host: np.ndarray, reg: _Region) -> np.ndarray:
        return as_float(host[reg.start : reg.end].view(reg.dtype))

    def _take(self, n: int, dtype: np.dtype[Any]) -> np.ndarray:
        with self._lock:
            for i, b in enumerate(self._scratch):
                if len(b) >= n and b.dtype == dtype:
                    return self._scratch.pop(i)
        return np.empty(n, dtype=dtype)

    def _give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            if len(self._scratch) < 4:
                self._scratch.append(buf)

    def stats(self, host: np.ndarray) -> dict[str, np.ndarray]:
        """:func:`segment_stats` columns over every tensor of the buffer ``host`` (uint8)."""
        out = _empty_stats(len(self.paths), self.probe_size)
        for reg in self.regions:
            x = self._view(host, reg)
            sq = self._take(reg.segs.squares, x.dtype)
            try:
                got = segment_stats(x, reg.segs, self.probe_size, sq)
            finally:
                self._give_back(sq)
            for k, v in got.items():
                out[k][reg.rows : reg.rows + len(reg.segs.numel)] = v
        return out

    def drop_copy(self) -> None:
        """Let the last digested step's copy go (another process digests the next steps):
        the next update here has no copy to compare with."""
        with self._prev_lock:
            self._prev, self._prev_token = None, -1

    def updates(self, host: np.ndarray, token: int) -> tuple[np.ndarray, int]:
        """Each tensor's squared distance to the previous digested step's copy (NaN where
        there is none) and that step's token (-1 for none); then this step's tensor bytes
        (``host``: the whole buffer) become the copy, under ``token``."""
        with self._prev_lock:
            upd = np.full(len(self.paths), np.nan)
            prev, prev_token = self._prev, self._prev_token
            if prev is not None and len(prev) == len(self.regions):
                for reg, old in zip(self.regions, prev, strict=True):
                    if len(reg.segs.full) and len(old) == reg.end - reg.start:
                        x = self._view(host, reg)
                        sq = self._take(reg.segs.stop, x.dtype)
                        try:
                            u = segment_updates(x, as_float(old.view(reg.dtype)), reg.segs, sq)
                        finally:
                            self._give_back(sq)
                        upd[reg.rows : reg.rows + len(u)] = u
            else:
                prev_token = -1
            if prev is None or len(prev) != len(self.regions):
                prev = [np.empty(reg.end - reg.start, np.uint8) for reg in self.regions]
            for reg, old in zip(self.regions, prev, strict=True):
                np.copyto(old, host[reg.start : reg.end])
            self._prev, self._prev_token = prev, token
            return upd, prev_token


def digest(
    plan: DigestPlan, buf: np.ndarray | memoryview, token: int | None = None
) -> dict[str, Any]:
    """Columns over ``plan.paths`` (:meth:`DigestPlan.stats`); with ``token`` (an id of this
    step, not -1) also ``upd_sumsq`` (the squared distance of each tensor to the previous
    digested step's copy, NaN where there is none or it is not finite) and ``prev_token``
    (that step's token, -1 for none), and this step becomes the copy the next one compares
    with (one copy of the tensor bytes and one more pass, in this thread)."""
    host = np.frombuffer(buf, dtype=np.uint8)
    out: dict[str, Any] = plan.stats(host)
    if token is not None:
        out["upd_sumsq"], out["prev_token"] = plan.updates(host, token)
    return out


def finish_columns(
    numel: np.ndarray,
    st: dict[str, np.ndarray],
    prev_probe: np.ndarray | None,
    exact_sumsq: np.ndarray | None = None,
) -> dict[str, Any]:
    """The columnar summaries object (the ``schema.SUMMARY_FIELDS``, one array each, and
    ``columns``/``probe_len``) from :func:`segment_stats` columns.

    ``l2 = sqrt(sumsq)``, ``rms = sqrt(sumsq / finite)`` and ``maxabs`` (NaN without a
    finite element); ``update_l2`` exact where ``exact_sumsq`` (squared distances to the
    parent's copy) is finite — flagged in ``update_exact`` — else estimated from the probes
    of this step and ``prev_probe`` (the parent's) as ``sqrt(numel / k * sum(dp**2))``,
    unbiased for the squared norm under the uniform probe; NaN where unknown;
    ``update_ratio = update_l2 / l2``.
    """
    l2_, rms_, maxabs_, nan_, inf_, upd_, ratio_, probe_, exact_ = schema.SUMMARY_FIELDS
    finite = st["finite"]
    l2 = np.sqrt(st["sumsq"])
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.where(finite > 0, np.sqrt(st["sumsq"] / np.maximum(finite, 1)), np.nan)
        maxabs = np.where(finite > 0, st["maxabs"], np.nan)
        update = np.full(len(l2), np.nan)
        if prev_probe is not None and prev_probe.shape == st["probe"].shape:
            d = st["probe"] - prev_probe
            k = st["probe_len"]
            mask = np.arange(d.shape[1])[None, :] < k[:, None]  # padding is NaN
            good = (k > 0) & np.all(np.isfinite(d) | ~mask, axis=1)
            d0 = np.where(np.isfinite(d), d, 0.0)
            update = np.where(
                good, np.sqrt(numel / np.maximum(k, 1) * (d0 * d0).sum(axis=1)), np.nan
            )
        exact = np.zeros(len(l2), dtype=bool)
        if exact_sumsq is not None and exact_sumsq.shape == l2.shape:
            exact = np.isfinite(exact_sumsq) & (numel > 0)
            update = np.where(exact, np.sqrt(np.where(exact, exact_sumsq, 0.0)), update)
        ratio = np.where(l2 > 0, update / np.where(l2 > 0, l2, 1.0), np.nan)
    return {
        "columns": 1,
        l2_: l2,
        rms_: rms,
        maxabs_: maxabs,
        nan_: st["nan"],
        inf_: st["inf"],
        upd_: update,
        ratio_: ratio,
        probe_: st["probe"],
        "probe_len": st["probe_len"],
        exact_: exact,
    }
