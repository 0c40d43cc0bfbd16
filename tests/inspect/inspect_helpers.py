"""Helpers for the inspection tests: write runs straight through the store (no training).

Imported by name (``from inspect_helpers import ...``): tests/inspect is on sys.path under
pytest's default import mode, and is not a package (it would shadow the stdlib ``inspect``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from dstt.store import Repository, Storage, dtype_name
from dstt.store.testing import DelegatingStorage


class CountingStorage(DelegatingStorage):
    """Delegates to another storage and counts every key read (whole or ranged)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.reads: Counter[str] = Counter()
        self._mu = threading.Lock()

    def _count(self, key: str) -> None:
        with self._mu:
            self.reads[key] += 1

    def data_reads(self) -> set[str]:
        """Keys read that hold tensor bytes (everything but metadata and dstt's own files)."""
        return {k for k in self.reads
                if not k.startswith("_dstt/") and not k.endswith("zarr.json")}

    def read(self, key: str) -> bytes:
        self._count(key)
        return self.inner.read(key)

    def read_range(self, key: str, start: int, length: int) -> bytes:
        self._count(key)
        return self.inner.read_range(key, start, length)


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


def write_steps(repo: Repository, steps: list[int], arrays_at: Callable[[int], Arrays], *,
                metrics_at: Callable[[int], dict[str, Any]] | None = None,
                objects_at: Callable[[int], dict[str, Any]] | None = None,
                chunk_bytes: int | None = None) -> None:
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
        "params/layers/0/attn/q_proj/weight":
            rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
        "params/layers/0/attn/q_proj/bias": rng.standard_normal(16).astype(np.float32),
        "params/layers/1/attn/q_proj/weight": rng.standard_normal((16, 8)).astype(np.float32),
        "params/layers/1/mlp/weight": rng.standard_normal((32, 8)).astype(np.float32),
        "buffers/layers/0/mask": np.array([True, False, True]),
        "params/scale": np.array(step, dtype=np.float32),
        "optim/exp_avg/layers/0/attn/q_proj/weight":
            rng.standard_normal((16, 8)).astype(np.float32),
    }
