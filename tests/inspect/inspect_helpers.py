"""Helpers for the inspection tests: write runs straight through the store (no training).

Imported by name (``from inspect_helpers import ...``): tests/inspect is on sys.path under
pytest's default import mode, and is not a package (it would shadow the stdlib ``inspect``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dstt.store import Reader, Repository, Storage
from dstt.store.api import dtype_name
from dstt.store.storage.memory import DelegatingStorage

#: what a read touched: ("array", (step, path, chunk index)), ("object", (step, name)) or
#: ("table", step) -- the arrays table of a commit
Touched = tuple[str, Any]


class CountingStorage(DelegatingStorage):
    """Delegates to another storage and records every read as ``(key, start, length)``.

    A step's tensors, objects and arrays table are byte ranges of a few files per step (the
    step's zip and side file), so counting reads per key says nothing; instead each read is
    resolved to what its bytes hold, using the commits reachable from any timeline (read
    through the *inner* storage, so resolving is not counted): chunks of arrays (arrays
    tables: chunk file and offset), objects (commit headers: side file and offset) and arrays
    tables. A read is resolved to every recorded byte range it overlaps; a whole-file read
    (``read``, recorded with ``length`` None) to everything in that file.
    """

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        #: every read, in order: (key, start, length); length None = the whole file
        self.reads: list[tuple[str, int, int | None]] = []
        self._mu = threading.Lock()

    def _record(self, key: str, start: int, length: int | None) -> None:
        with self._mu:
            self.reads.append((key, start, length))

    def read(self, key: str) -> bytes:
        self._record(key, 0, None)
        return self.inner.read(key)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self._record(key, start, length)
        return self.inner.read_range(key, start, length)

    # -- resolving reads ------------------------------------------------------------------
    def _extents(self) -> dict[str, list[tuple[int, int, Touched]]]:
        """Per file key: (start, stop, what) of every chunk, object and arrays table of every
        commit reachable from a timeline (sorted by start)."""
        r = Reader(self.inner)
        out: dict[str, list[tuple[int, int, Touched]]] = {}

        def add(key: str, offset: int, nbytes: int, what: Touched) -> None:
            out.setdefault(key, []).append((offset, offset + nbytes, what))

        seen: set[int] = set()
        for timeline in r.timelines:
            for h in r.walk(timeline):
                if h.pruned or h.slot in seen:
                    continue
                seen.add(h.slot)
                if h.arrays is not None:
                    add(h.arrays.key, h.arrays.offset, h.arrays.nbytes, ("table", h.step))
                for name, o in h.objects.items():
                    add(o.key, o.offset, o.nbytes, ("object", (h.step, name)))
                for path, a in r.arrays(h).items():
                    for i, c in enumerate(a.chunks):  # a dedup record points at an older file
                        add(c.key, c.offset, c.nbytes, ("array", (h.step, path, i)))
        for v in out.values():
            v.sort(key=lambda e: (e[0], e[1]))
        return out

    def resolved(self) -> list[tuple[tuple[str, int, int | None], set[Touched]]]:
        """Every read so far with what its bytes hold (empty: headers, refs, zip metadata)."""
        extents = self._extents()
        with self._mu:
            reads = list(self.reads)
        out = []
        for key, start, length in reads:
            stop = None if length is None else start + length
            touched = {
                what
                for lo, hi, what in extents.get(key, ())
                if stop is None or (lo < stop and start < hi)
            }
            out.append(((key, start, length), touched))
        return out

    def _touched(self, kind: str) -> set[Any]:
        return {what for _, ts in self.resolved() for k, what in ts if k == kind}

    def chunk_reads(self) -> set[tuple[int, str, int]]:
        """(step, array path, chunk index) of every chunk whose bytes were read."""
        return self._touched("array")

    def data_reads(self) -> set[str]:
        """Array paths whose tensor bytes were read (at any step)."""
        return {path for _, path, _ in self.chunk_reads()}

    def object_reads(self) -> set[tuple[int, str]]:
        """(step, object name) of every object whose bytes were read."""
        return self._touched("object")

    def table_reads(self) -> set[int]:
        """Steps whose arrays tables were read."""
        return self._touched("table")

    def whole_file_reads(self) -> set[str]:
        """Keys read whole (``read``, not ``read_range``)."""
        with self._mu:
            return {key for key, _, length in self.reads if length is None}


Arrays = Mapping[str, np.ndarray]


def commit(txn: Any, arrays: Arrays) -> None:
    """Declare and write every array of one step into an open transaction."""
    for name, arr in arrays.items():
        a = np.asarray(arr)
        a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)
        plan = txn.declare(name, dtype_name(a.dtype), a.shape)
        flat = a.reshape(-1).view(np.uint8)
        for i in range(plan.n_chunks):
            start, stop = plan.byte_range(i)
            txn.put_chunk(name, i, flat[start:stop])


def write_steps(
    repo: Repository,
    steps: list[int],
    arrays_at: Callable[[int], Arrays],
    *,
    metrics_at: Callable[[int], dict[str, Any]] | None = None,
    objects_at: Callable[[int], dict[str, Any]] | None = None,
    chunk_bytes: int | None = None,
) -> None:
    """Commit ``arrays_at(step)`` for each step with one writer (fast: no per-step reopen)."""
    opts = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    with repo.writer(**opts) as w:
        for s in steps:
            txn = w.begin(s)
            commit(txn, arrays_at(s))
            for name, obj in (objects_at(s) if objects_at else {}).items():
                txn.put_object(name, obj)
            txn.commit(metrics_at(s) if metrics_at else {"loss": 1.0 / (s + 1)})


def new_repo(path: Path) -> Repository:
    return Repository.create(path, durability="none")


def small_model(step: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny 'model': two layers, a bf16 weight, a buffer, a 0-d tensor, an optimizer state."""
    rng = np.random.default_rng([seed, step])
    return {
        "params/emb/weight": rng.standard_normal((10, 4)).astype(np.float32),
        "params/layers/0/attn/q_proj/weight": rng.standard_normal((16, 8)).astype(
            ml_dtypes.bfloat16
        ),
        "params/layers/0/attn/q_proj/bias": rng.standard_normal(16).astype(np.float32),
        "params/layers/1/attn/q_proj/weight": rng.standard_normal((16, 8)).astype(np.float32),
        "params/layers/1/mlp/weight": rng.standard_normal((32, 8)).astype(np.float32),
        "buffers/layers/0/mask": np.array([True, False, True]),
        "params/scale": np.array(step, dtype=np.float32),
        "optim/exp_avg/layers/0/attn/q_proj/weight": rng.standard_normal((16, 8)).astype(
            np.float32
        ),
    }
