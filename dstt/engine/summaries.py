"""Write-time per-tensor summaries, computed on the host copy in the engine's flush threads.

For each tensor of each step the engine stores, in the commit object ``summaries``::

    {array_path: {"l2", "rms", "maxabs", "nan", "inf", "update_l2", "update_ratio",
                  "probe", "update_exact"}}

so spike studies over thousands of steps read a few KB per step instead of whole tensors.

What is exact and what is estimated:

* ``nan`` and ``inf`` (counts) and ``maxabs`` (over the *finite* elements) are exact; ``l2``
  and ``rms`` (over the finite elements) are float32 sums of squares per block of 2^20
  elements (BLAS ``dot``), accumulated across blocks in float64: relative error ~1e-7, plenty
  for spike studies, at ~1/15 of the CPU of a float64 pass (the summaries run on every
  parameter of every step, competing with training for cores). A block with NaN/Inf — or
  whose float32 squares overflow — takes an exact float64 path.
* ``probe``: the values (as float) of up to ``PROBE_SIZE`` elements at fixed flat indices drawn
  without replacement by a generator seeded from the array path, so the same elements are
  probed at every step, in every process and every run (:func:`probe_indices`).
* ``update_l2`` = ||x_t - x_{t-1}||: exact (``update_exact: true``) when the caller passes the
  previous step's host copy; otherwise *estimated* from the probes of this and the previous
  step as ``sqrt(numel / k * sum((p_t - p_{t-1})**2))``, an unbiased estimate of the squared
  norm under the uniform probe, noisy for sparse updates. None at the first step of a run;
  after a resume the book is seeded with the restored (parent) parameters
  (:meth:`SummaryBook.seed`), so the first resumed step is measured against its parent.
* ``update_ratio`` = ``update_l2 / l2`` (the current weights' norm); None when either is
  unknown or ``l2`` is 0.

The update of a commit is always relative to its *parent commit* (the step before it on its
timeline: step k-1 when every step is committed, k-every with ``every=``). In the flat lane it
is exact wherever the digest that summarised the parent kept its copy in the same process
(``dstt.store.flusher.flatstats``: ``digest`` with a token) — every step after the first of a
session, on every flat path (flusher, writer threads, ``DeltaPolicy``) — and the committer
checks that the copy was the parent's (:meth:`SummaryBook.committed`), since a failed step, a
chunk-lane step in between or a resume make the previous digest another step's. The chunk
lane (steps larger than half the budget) keeps no copy: estimates there, labelled so.

A tensor staged in chunks (the host cache may be smaller than the tensor) is summarised with a
:class:`SummaryAccumulator` fed chunk by chunk, from any thread, in any order; ``tensor_summary``
is the one-shot form. A :class:`SummaryBook` (one per session) remembers each path's last probe
so the next step's update can be estimated; the engine's flush threads use it as::

    acc = book.accumulator(path, numel)          # when the tensor's first chunk is staged
    acc.add(offset, host_chunk)                  # per chunk, in the flush thread
    summaries[path] = book.finish(path, acc)     # after its last chunk; -> put_object
 Rejected alternative: computing summaries on the device at stage time —
it would add kernels and a sync to the training stream, the one place dstt must not slow.
"""

from __future__ import annotations

import functools
import math
import threading
import zlib
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dstt.store._internal import DigestPlan, logical_of

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "PROBE_SIZE",
    "SUMMARIZED",
    "SummaryAccumulator",
    "SummaryBook",
    "flat_digest_plan",
    "probe_indices",
    "summarized",
    "tensor_summary",
]

PROBE_SIZE = 16

SUMMARIZED = ("params/",)  # array prefixes that get write-time summaries


def summarized(path: str) -> bool:
    """Whether the array ``path`` gets write-time summaries: parameters, and a rank's shard
    of one (``dtensor/w<W>/r<R>/params/...``: readers fold the shards' rows into one)."""
    if path.startswith(SUMMARIZED):
        return True
    logical = logical_of(path)
    return logical is not None and logical.startswith(SUMMARIZED)


_BLOCK = 1 << 20  # elements per float64 block: bounds the temporary memory of one summary


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """float32/float64 as they are; bf16, fp16 and integers as float32 (exact for bf16/fp16)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)


@functools.lru_cache(maxsize=65536)
def _probe_indices(path: str, numel: int, k: int) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(path.encode()))
    idx = rng.choice(numel, size=min(k, numel), replace=False)
    idx.sort()
    idx.setflags(write=False)
    return idx


def probe_indices(path: str, numel: int, k: int = PROBE_SIZE) -> np.ndarray:
    """Sorted flat indices probed for ``path`` (deterministic in path, numel and k)."""
    return _probe_indices(path, int(numel), int(k))


class SummaryAccumulator:
    """Accumulates the summary of one tensor from its chunks (flat C-order element ranges).

    Thread-safe: chunks may be added concurrently and in any order. Call :meth:`result` once
    every element has been added.
    """

    def __init__(
        self,
        path: str,
        numel: int,
        *,
        prev_probe: Sequence[float] | None = None,
        probe_size: int = PROBE_SIZE,
    ) -> None:
        self.path, self.numel = path, int(numel)
        self.idx = probe_indices(path, self.numel, probe_size)
        self.probe = np.full(len(self.idx), np.nan)
        self.prev_probe = None if prev_probe is None else np.asarray(prev_probe, dtype=float)
        self._lock = threading.Lock()
        self._sumsq = self._maxabs = self._upd_sumsq = 0.0
        self._finite = self._nan = self._inf = self._seen = self._upd_seen = 0

    def add(self, offset: int, chunk: torch.Tensor, prev_chunk: torch.Tensor | None = None) -> None:
        """Add elements ``[offset, offset + chunk.numel())``; ``prev_chunk`` is the same range
        of the previous step's copy (makes ``update_l2`` exact)."""
        flat = chunk.reshape(-1)
        prev_flat = None if prev_chunk is None else prev_chunk.reshape(-1)
        if prev_flat is not None and prev_flat.numel() != flat.numel():
            raise ValueError(
                f"{self.path}: previous chunk has {prev_flat.numel()} elements, "
                f"this one {flat.numel()}"
            )
        sumsq = maxabs = upd = 0.0
        finite = nan = inf = 0
        for s in range(0, flat.numel(), _BLOCK):
            x = _as_float(flat[s : s + _BLOCK])
            ss = m = 0.0
            if x.numel():
                mm = torch.aminmax(x)  # NaN propagates: sends the block to the exact path
                ss, m = float(torch.dot(x, x)), max(-float(mm.min), float(mm.max))
            if math.isfinite(ss) and math.isfinite(m):  # the common case: three cheap passes
                finite += x.numel()
                sumsq += ss
                maxabs = max(maxabs, m)
            else:  # NaN/Inf present, or float32 squares overflowed: exact float64 path
                x64 = x.to(torch.float64)
                ok = torch.isfinite(x64)
                n_ok = int(ok.sum())
                n_nan = int(torch.isnan(x64).sum())
                nan, inf = nan + n_nan, inf + x64.numel() - n_ok - n_nan
                x64 = x64[ok]
                finite += n_ok
                if x64.numel():
                    sumsq += float(torch.dot(x64, x64))
                    maxabs = max(maxabs, float(x64.abs().max()))
            if prev_flat is not None:
                d = x.to(torch.float64) - _as_float(prev_flat[s : s + _BLOCK]).to(torch.float64)
                upd += float(torch.dot(d, d))
        lo = np.searchsorted(self.idx, offset)
        hi = np.searchsorted(self.idx, offset + flat.numel())
        vals = flat[torch.from_numpy(self.idx[lo:hi] - offset)].to(torch.float64).numpy()
        with self._lock:
            self._sumsq += sumsq
            self._maxabs = max(self._maxabs, maxabs)
            self._finite += finite
            self._nan += nan
            self._inf += inf
            self._seen += flat.numel()
            if prev_flat is not None:
                self._upd_sumsq += upd
                self._upd_seen += flat.numel()
            self.probe[lo:hi] = vals

    def result(self) -> dict[str, Any]:
        """The summary dict (plain floats/ints/None, ready for tagged JSON)."""
        with self._lock:
            if self._seen != self.numel:
                raise ValueError(f"{self.path}: summarised {self._seen} of {self.numel} elements")
            l2 = math.sqrt(self._sumsq)
            rms = math.sqrt(self._sumsq / self._finite) if self._finite else float("nan")
            maxabs = self._maxabs if self._finite else float("nan")
            update, exact = None, False
            if self._upd_seen == self.numel and self.numel:
                update, exact = math.sqrt(self._upd_sumsq), True
            elif self.prev_probe is not None and len(self.prev_probe) == len(self.probe) > 0:
                d = self.probe - self.prev_probe
                if np.all(np.isfinite(d)):
                    update = math.sqrt(self.numel / len(d) * float(np.dot(d, d)))
            ratio = update / l2 if update is not None and l2 > 0 else None
            return {
                "l2": l2,
                "rms": rms,
                "maxabs": maxabs,
                "nan": self._nan,
                "inf": self._inf,
                "update_l2": update,
                "update_ratio": ratio,
                "probe": [float(v) for v in self.probe],
                "update_exact": exact,
            }


def tensor_summary(
    t: torch.Tensor,
    path: str,
    *,
    prev: torch.Tensor | None = None,
    prev_probe: Sequence[float] | None = None,
    probe_size: int = PROBE_SIZE,
) -> dict[str, Any]:
    """Summary of host tensor ``t`` stored at ``path``.

    ``prev`` (the previous step's copy, same shape) makes ``update_l2`` exact; otherwise
    ``prev_probe`` (the previous step's ``"probe"`` list) gives an estimate; with neither the
    update fields are None. Runs on CPU tensors of any dtype dstt stores (bf16 included).
    """
    if prev is not None and tuple(prev.shape) != tuple(t.shape):
        raise ValueError(
            f"{path}: previous copy has shape {tuple(prev.shape)}, this one {tuple(t.shape)}"
        )
    acc = SummaryAccumulator(path, t.numel(), prev_probe=prev_probe, probe_size=probe_size)
    acc.add(0, t.detach(), None if prev is None else prev.detach())
    return acc.result()


class SummaryBook:
    """Per-session memory of each tensor's last probe (thread-safe), for update estimates."""

    def __init__(self, probe_size: int = PROBE_SIZE) -> None:
        self.probe_size = probe_size
        self._probes: dict[str, list[float]] = {}
        self._columns: dict[tuple[str, ...], np.ndarray] = {}  # the flat lane's last probes
        self._parent_token = -1  # the digest token of the last committed step (-1: none)
        self._lock = threading.Lock()

    def accumulator(self, path: str, numel: int) -> SummaryAccumulator:
        with self._lock:
            prev = self._probes.get(path)
        return SummaryAccumulator(path, numel, prev_probe=prev, probe_size=self.probe_size)

    def finish(self, path: str, acc: SummaryAccumulator) -> dict[str, Any]:
        """The summary of ``acc``; remembers its probe for the next step of ``path``."""
        out = acc.result()
        with self._lock:
            self._probes[path] = out["probe"]
        return out

    def summarize(
        self, path: str, t: torch.Tensor, prev: torch.Tensor | None = None
    ) -> dict[str, Any]:
        """One-shot form of ``accumulator`` + ``add`` + ``finish``."""
        acc = self.accumulator(path, t.numel())
        acc.add(0, t.detach(), None if prev is None else prev.detach())
        return self.finish(path, acc)

    def finish_columns(
        self, paths: Sequence[str], numel: np.ndarray, st: dict[str, np.ndarray]
    ) -> dict[str, Any]:
        """The columnar summaries object of one flat step (in step order: it remembers the
        probes for the next step's update estimate)."""
        key = tuple(paths)
        with self._lock:
            prev = self._columns.get(key)
            if prev is None and any(p in self._probes for p in paths):
                prev = np.full(st["probe"].shape, np.nan)
                for i, p in enumerate(paths):
                    old = self._probes.get(p)
                    if old is not None and len(old) == st["probe_len"][i]:
                        prev[i, : len(old)] = old
            parent = self._parent_token
        upd, prev_token = st.pop("upd_sumsq", None), int(st.pop("prev_token", -1))
        exact = None
        if upd is not None and parent != -1 and prev_token == parent:
            exact = np.asarray(upd, dtype=np.float64)  # compared with the parent's own copy
        out = finish_columns(numel, st, prev, exact)
        out["path"] = list(paths)
        with self._lock:
            self._columns = {key: st["probe"]}
        return out

    def committed(self, token: int) -> None:
        """The step just committed had digest token ``token`` (-1: none, a chunk-lane
        step): the next flat step's update is exact only if its digest compared it with
        that token's copy (``flatstats.digest``)."""
        with self._lock:
            self._parent_token = int(token)

    def seed(self, path: str, t: torch.Tensor) -> None:
        """Remember the probe of ``t`` as ``path``'s last one: after a resume, the restored
        parameters are the parent step's, so the next step's update is estimated against it
        (instead of being unknown)."""
        flat = t.detach().reshape(-1)
        idx = probe_indices(path, flat.numel(), self.probe_size)
        where = torch.from_numpy(idx.astype(np.int64)).to(flat.device)
        probe = flat[where].to(torch.float64).cpu()
        with self._lock:
            self._columns.clear()
            self._parent_token = -1  # the parent is the restored step: no copy of it
            self._probes[path] = [float(v) for v in probe.tolist()]

    def forget(self, path: str | None = None) -> None:
        """Drop remembered probes (all, or one path) — e.g. after a resume or rollback."""
        with self._lock:
            self._columns.clear()
            self._parent_token = -1
            if path is None:
                self._probes.clear()
            else:
                self._probes.pop(path, None)


def flat_digest_plan(
    items: Sequence[tuple[str, str, int, int]], probe_size: int = PROBE_SIZE
) -> DigestPlan:
    """The store's :class:`~dstt.store.flusher.flatstats.DigestPlan` for tensors of a flat buffer:
    ``items`` are (path, store dtype, byte offset, numel); probes as ``probe_indices``."""
    return DigestPlan(
        [
            (p, dt, off, n, probe_indices(p, n, probe_size) if n else np.empty(0, np.intp))
            for p, dt, off, n in items
        ],
        probe_size,
    )


def finish_columns(
    numel: np.ndarray,
    st: dict[str, np.ndarray],
    prev_probe: np.ndarray | None,
    exact_sumsq: np.ndarray | None = None,
) -> dict[str, Any]:
    """The columnar summaries object of one flat step from ``flatstats.digest`` columns.

    Same fields and estimators as ``SummaryAccumulator.result``, one array each
    (``update_l2``/``update_ratio`` NaN where unknown); ``exact_sumsq`` (the squared
    distances to the parent's copy, NaN where unknown) makes those rows exact, flagged in
    the ``update_exact`` column; ``dstt.inspect.summaries`` reads it.
    """
    finite = st["finite"]
    l2 = np.sqrt(st["sumsq"])
    with np.errstate(invalid="ignore", divide="ignore"):
        rms = np.where(finite > 0, np.sqrt(st["sumsq"] / np.maximum(finite, 1)), np.nan)
        maxabs = np.where(finite > 0, st["maxabs"], np.nan)
        update = np.full(len(l2), np.nan)
        if prev_probe is not None and prev_probe.shape == st["probe"].shape:
            d = st["probe"] - prev_probe
            k = st["probe_len"]
            good = (k > 0) & _rows_finite(d, k)
            d0 = np.where(np.isfinite(d), d, 0.0)
            d2 = (d0 * d0).sum(axis=1)
            update = np.where(good, np.sqrt(numel / np.maximum(k, 1) * d2), np.nan)
        exact = np.zeros(len(l2), dtype=bool)
        if exact_sumsq is not None and exact_sumsq.shape == l2.shape:
            exact = np.isfinite(exact_sumsq) & (numel > 0)
            update = np.where(exact, np.sqrt(np.where(exact, exact_sumsq, 0.0)), update)
        ratio = np.where(l2 > 0, update / np.where(l2 > 0, l2, 1.0), np.nan)
    return {
        "columns": 1,
        "l2": l2,
        "rms": rms,
        "maxabs": maxabs,
        "nan": st["nan"],
        "inf": st["inf"],
        "update_l2": update,
        "update_ratio": ratio,
        "probe": st["probe"],
        "probe_len": st["probe_len"],
        "update_exact": exact,
    }


def _rows_finite(d: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Per row: every one of its first ``k[i]`` values is finite (padding is NaN)."""
    mask = np.arange(d.shape[1])[None, :] < k[:, None]
    finite: np.ndarray = np.all(np.isfinite(d) | ~mask, axis=1)
    return finite
