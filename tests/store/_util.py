"""Shared helpers of the store tests: deterministic sample arrays and bit-exact comparison."""

from __future__ import annotations

import math
import struct
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from dstt.store import Repository
from dstt.store.commit.transaction import Transaction

DTYPES = [
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
]


def np_dtype(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def sample(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Random *bit patterns* of a dtype: NaN payloads, -0.0, subnormals and infs included."""
    rng = np.random.default_rng(seed)
    dt = np_dtype(name)
    n = math.prod(shape)
    if name == "bool":
        return (rng.integers(0, 2, n) == 1).reshape(shape)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes (so NaN == NaN and -0.0 != 0.0)."""
    a, b = np.asarray(a), np.asarray(b)
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def zip_entry(path: Path, name: str) -> tuple[int, int]:
    """``(offset, size)`` of the bytes of entry ``name`` of a stored zip, found with the
    standard library's reader (independent of dstt's own zip code)."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
        assert info.compress_type == zipfile.ZIP_STORED, name
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
    assert local[:4] == b"PK\x03\x04", name
    n_name, n_extra = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + n_name + n_extra, info.file_size


def assert_same_arrays(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bits(got[k], want[k]), (k, got[k], want[k])


def put_array(txn: Transaction, path: str, arr: np.ndarray, order: list[int] | None = None) -> int:
    """Declare ``arr`` in ``txn`` and write its chunks (in ``order`` if given); chunk count."""
    a = np.ascontiguousarray(arr)
    name = "bfloat16" if a.dtype == np_dtype("bfloat16") else a.dtype.name
    plan = txn.declare(path, name, a.shape)
    flat = a.reshape(-1).view(np.uint8)
    for i in order if order is not None else range(plan.n_chunks):
        start, stop = plan.byte_range(i)
        txn.put_chunk(path, i, flat[start:stop])
    return plan.n_chunks


#: how the delta and prediction tests write a step (``write_how``)
WRITE = {"how": "chunks"}


@pytest.fixture(params=["chunks", "flat"])
def write_how(request: pytest.FixtureRequest) -> Any:
    """A test twice: chunk by chunk (``put_chunk``), and as flat steps the batched encoder
    writes (``put_flat_chunks``, ``codec/flatdelta.py``); the test reads ``WRITE["how"]``."""
    WRITE["how"] = request.param
    yield request.param
    WRITE["how"] = "chunks"


def put_flat_arrays(txn: Transaction, arrays: Mapping[str, np.ndarray]) -> Any:
    """Write ``arrays`` (in their order) as one flat step with ``put_flat_chunks``, as the
    engine does: one layout per writer and set of arrays, reused across steps (the batched
    encoder bases a step on the last one written from the same layout). Returns it."""
    layout, buf = flat_buffer(txn.writer, arrays)
    txn.put_flat_chunks(layout, buf)
    return layout


def flat_buffer(w: Any, arrays: Mapping[str, np.ndarray]) -> tuple[Any, np.ndarray]:
    """The writer's cached flat layout of ``arrays`` and a buffer holding them."""
    specs = tuple(
        (p, "bfloat16" if a.dtype == np_dtype("bfloat16") else a.dtype.name, tuple(a.shape))
        for p, a in arrays.items()
    )
    cache = w.__dict__.setdefault("_test_layouts", {})
    layout = cache.get(specs)
    if layout is None:
        layout = cache[specs] = w.flat_layout(specs)
    buf = np.zeros(layout.nbytes, np.uint8)
    for a in layout.arrays:
        buf[a.offset : a.offset + a.nbytes] = (
            np.ascontiguousarray(arrays[a.path]).reshape(-1).view(np.uint8)
        )
    return layout, buf


def commit_arrays(
    repo: Repository,
    step: int,
    arrays: Mapping[str, np.ndarray],
    *,
    objects: Mapping[str, Any] | None = None,
    chunk_bytes: int = 64,
    timeline: str | None = None,
    metrics: Mapping[str, Any] | None = None,
) -> Any:
    with repo.writer(chunk_bytes=chunk_bytes) as w:
        txn = w.begin(step, timeline=timeline)
        for p, a in arrays.items():
            put_array(txn, p, a)
        for n, o in (objects or {}).items():
            txn.put_object(n, o)
        return txn.commit(metrics)


def crash_at_every_write(
    commit: Callable[[Any, int], Any],
    want: Callable[[int], Mapping[str, np.ndarray]],
    **writer_options: Any,
) -> tuple[int, bool]:
    """Commit steps 1 and 2 with ``commit(writer, step)`` (returns the transaction), then
    step 3 with a power cut at its k-th storage write, for k = 1, 2, ... until step 3
    completes. After every cut the run must hold step 2 or 3 whole (``want(step)``) and
    verify clean. Returns (writes step 3 took, whether it wrote any delta)."""
    from dstt.store import load
    from dstt.store.storage.memory import FaultyStorage, MemoryStorage

    class Cut(Exception):
        pass

    k, saw_delta = 0, False
    while True:
        k += 1
        mem = MemoryStorage()
        armed = {"on": False, "n": 0}

        def cut(key: str, _a: dict[str, Any] = armed, _k: int = k) -> None:
            if _a["on"]:
                _a["n"] += 1
                if _a["n"] == _k:
                    raise Cut(key)

        repo = Repository.create(FaultyStorage(mem, on_write=cut))
        finished = False
        with repo.writer(**writer_options) as w:
            commit(w, 1)
            commit(w, 2)
            armed["on"] = True  # the shadow now holds step 2: step 3 is written as deltas
            try:
                txn = commit(w, 3)
                saw_delta = saw_delta or txn.stats.deltas > 0
                finished = True
            except Cut:
                pass
        after = mem.crash()
        head = Repository(after).reader().head()
        assert head is not None
        assert head.step in (2, 3)
        got = load(after).arrays
        for name, a in want(head.step).items():
            assert same_bits(got[name], a), (k, name)
        assert Repository(after).verify().ok
        if finished:
            return k, saw_delta


def deep_equal(a: Any, b: Any) -> bool:
    """Structural equality that also checks types, NaN == NaN and numpy arrays bit-exactly."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return same_bits(a, b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(deep_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        if len(a) != len(b):
            return False
        kb = list(b)
        for i, (k, v) in enumerate(a.items()):  # insertion order is kept too
            if not deep_equal(k, kb[i]) or not deep_equal(v, b[kb[i]]):
                return False
        return True
    return bool(a == b)
