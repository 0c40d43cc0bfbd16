"""Write-time summaries on the training side: the torch glue around the one numpy kernel.

What each field means and how it is computed: :mod:`dstt.analysis.summary_kernel` (every
lane, the flusher and the importer call it). Here: :class:`SummaryAccumulator` hands host
chunks (CPU torch tensors, as numpy views) to it from any thread and folds the partial sums;
:class:`SummaryBook` (one per session) remembers each path's probes and the digest token of
the last committed step, so an update is exact only when compared with its *parent's* copy
(the flat lane keeps one per process) and estimated from the probes otherwise (the chunk
lane, the first step after a resume). A tensor split in several chunks sums its chunks'
partials in float64: within ~1e-7 of the whole-tensor sum, not bit-equal. Rejected: summing
on the device at stage time (kernels and a sync on the training stream).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dstt import schema
from dstt.analysis.summary_kernel import (
    PROBE_SIZE,
    DigestPlan,
    Segments,
    finish_columns,
    probe_indices,
    segment_stats,
    segment_updates,
)
from dstt.engine.tensors._convert import flat_bytes, store_dtype
from dstt.errors import CaptureError, SchemaError
from dstt.store._internal import logical_of, numpy_dtype

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = [
    "SUMMARIZED",
    "SummaryAccumulator",
    "SummaryBook",
    "flat_digest_plan",
    "host_array",
    "summarized",
    "tensor_summary",
]

SUMMARIZED = ("params/",)  # array prefixes that get write-time summaries


def summarized(path: str) -> bool:
    """Whether the array ``path`` gets write-time summaries: parameters, and a rank's shard
    of one (``dtensor/w<W>/r<R>/params/...``: readers fold the shards' rows into one)."""
    if path.startswith(SUMMARIZED):
        return True
    logical = logical_of(path)
    return logical is not None and logical.startswith(SUMMARIZED)


@functools.lru_cache(maxsize=64)
def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any]:
    return numpy_dtype(store_dtype(dtype))


def host_array(t: torch.Tensor) -> np.ndarray:
    """The elements of CPU tensor ``t`` as a flat numpy array for the kernel: float32 and
    wider as views of its memory (where contiguous); bfloat16 and float16 cast to float32
    here, the exact cast the kernel's ``as_float`` makes (torch's is ~3x faster than numpy's
    for bfloat16: measured)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.to(torch.float32)
    return flat_bytes(t.contiguous()).numpy().view(_numpy_dtype(t.dtype))


@functools.lru_cache(maxsize=65536)
def _chunk_segments(path: str, numel: int, k: int, offset: int, n: int) -> Segments:
    """The kernel's segments of one chunk (elements ``offset..offset+n`` of ``path``) and
    the probes in it: the same every step, so built once."""
    idx = probe_indices(path, numel, k)
    lo, hi = np.searchsorted(idx, [offset, offset + n])
    return Segments.build([0], [n], [idx[lo:hi] - offset])


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
        self.path, self.numel, self.probe_size = path, int(numel), int(probe_size)
        self.idx = probe_indices(path, self.numel, probe_size)
        self.probe = np.full(len(self.idx), np.nan)
        self.prev_probe = None if prev_probe is None else np.asarray(prev_probe, dtype=float)
        self._lock = threading.Lock()
        self._sums: dict[str, Any] = dict.fromkeys(("sumsq", "maxabs", "finite", "nan", "inf"), 0)
        self._upd_sumsq, self._seen, self._upd_seen = 0.0, 0, 0

    def add(self, offset: int, chunk: torch.Tensor, prev_chunk: torch.Tensor | None = None) -> None:
        """Add elements ``[offset, offset + chunk.numel())``; ``prev_chunk`` is the same range
        of the previous step's copy (makes ``update_l2`` exact)."""
        x = host_array(chunk)
        old = None if prev_chunk is None else host_array(prev_chunk)
        if old is not None and len(old) != len(x):
            raise SchemaError(
                f"{self.path}: previous chunk has {len(old)} elements, this one {len(x)}: "
                "pass the same element range of the previous step"
            )
        segs = _chunk_segments(self.path, self.numel, self.probe_size, offset, len(x))
        lo = int(np.searchsorted(self.idx, offset))
        hi = lo + len(segs.probe_index)
        st = segment_stats(x, segs, hi - lo)
        upd = None if old is None else float(segment_updates(x, old, segs)[0])
        with self._lock:
            for k in ("sumsq", "finite", "nan", "inf"):
                self._sums[k] += st[k][0].item()
            self._sums["maxabs"] = max(self._sums["maxabs"], st["maxabs"][0].item())
            self._seen += len(x)
            if upd is not None:
                self._upd_sumsq += upd
                self._upd_seen += len(x)
            self.probe[lo:hi] = st["probe"][0]

    def result(self) -> dict[str, Any]:
        """The summary dict (``schema.SUMMARY_FIELDS``: plain floats/ints/None, ready for
        tagged JSON), finished by the kernel's :func:`finish_columns` as one row."""
        with self._lock:
            if self._seen != self.numel:
                raise CaptureError(
                    f"{self.path}: summarised {self._seen} of {self.numel} elements "
                    "(a chunk was not added)"
                )
            st = {k: np.array([v]) for k, v in self._sums.items()}
            st["probe"], st["probe_len"] = self.probe[None, :], np.array([len(self.probe)])
            exact = None
            if self._upd_seen == self.numel and self.numel:
                exact = np.array([self._upd_sumsq])
            prev = None if self.prev_probe is None else self.prev_probe[None, :]
        cols = finish_columns(np.array([self.numel]), st, prev, exact)
        out = {f: cols[f][0].tolist() for f in schema.SUMMARY_FIELDS}  # plain Python values
        for f in ("update_l2", "update_ratio"):
            out[f] = None if math.isnan(out[f]) else out[f]  # unknown
        return out


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
        raise SchemaError(
            f"{path}: previous copy has shape {tuple(prev.shape)}, this one {tuple(t.shape)}"
        )
    acc = SummaryAccumulator(path, t.numel(), prev_probe=prev_probe, probe_size=probe_size)
    acc.add(0, t, prev)
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
        that token's copy (``summary_kernel.digest``)."""
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
    """The kernel's :class:`DigestPlan` for tensors of a flat buffer: ``items`` are (path,
    store dtype, byte offset, numel); probes as ``probe_indices``."""
    return DigestPlan(
        [
            (
                p,
                numpy_dtype(dt),
                off,
                n,
                probe_indices(p, n, probe_size) if n else np.empty(0, np.intp),
            )
            for p, dt, off, n in items
        ],
        probe_size,
    )
