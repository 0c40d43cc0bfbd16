"""One delta codec: the flat encoder (``codec/flatdelta.py``) is the chunk-by-chunk reference
(``reference.py``) made fast. Over random runs — shapes, dtypes, edge chunks, small changes,
identical chunks, noise, raw steps, Adam state with predictions (right and wrong), policies —
both make the same decision for every chunk with the same bytes and records, every delta
decodes bit-exactly, and a step fed chunk by chunk (``put_chunk``) is stored byte for byte as
the same step fed flat (``put_flat_chunks``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dstt.store import Repository, load
from dstt.store.codec.buffers import Scratch
from dstt.store.codec.flatdelta import FlatShadow, encode_flat, seed_shadow
from dstt.store.codec.layout_state import LayoutState
from dstt.store.codec.predict import Prediction, adam_predictions
from dstt.store.codec.xor import DeltaPolicy
from dstt.store.format.flat import FlatLayout
from dstt.store.storage.memory import MemoryStorage

from .._util import flat_buffer, same_bits
from .reference import Chunk, ReferenceEncoder, decode

DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "float64": np.float64,
}
P, M, V = "params/adam/w", "optim/exp_avg/adam/w", "optim/exp_avg_sq/adam/w"


@dataclass
class Run:
    """A random run: its arrays' first values, how each changes per step, its policy."""

    first: dict[str, np.ndarray]
    moves: list[dict[str, str]]  # per step after the first: array -> how it changes
    raw: list[bool]  # per step: written raw (a keyframe, or the writer could not keep up)
    adam: bool
    wrong: list[bool]  # per step: the prediction's coefficients are off (costs bytes)
    policy: DeltaPolicy
    chunk_bytes: int
    seed: int


@st.composite
def runs(draw: st.DrawFn) -> Run:
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    first: dict[str, np.ndarray] = {}
    for k in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(sorted(DTYPES)))
        shape = draw(st.sampled_from([(), (1,), (7,), (33,), (5, 3), (16, 4), (9, 7), (40, 9)]))
        first[f"params/a{k}"] = rng.standard_normal(shape).astype(DTYPES[dtype])
    adam = draw(st.integers(0, 3)) > 0
    if adam:
        shape = draw(st.sampled_from([(24, 8), (40, 9), (7,)]))
        first[M] = np.zeros(shape, np.float32)
        first[V] = np.zeros(shape, np.float32)
        first[P] = rng.standard_normal(shape).astype(np.float32)
    n = draw(st.integers(2, 7))
    names = [p for p in first if p not in (M, V, P)]
    moves = [
        {p: draw(st.sampled_from(["same", "nudge", "nudge", "sparse", "noise"])) for p in names}
        for _ in range(n - 1)
    ]
    policy = DeltaPolicy(  # weighted towards policies under which deltas pay
        keyframe_every=draw(st.sampled_from([None, None, None, 2, 5])),
        read_amplification=draw(st.sampled_from([8.0, 8.0, 2.0, 1.0])),
        max_chain=draw(st.sampled_from([32, 32, 4, 2])),
        delta=draw(st.integers(0, 5)) > 0,
        dedup=draw(st.integers(0, 5)) > 0,
        min_ratio=draw(st.sampled_from([1.15, 1.15, 1.0, 3.0])),
        retry_every=draw(st.sampled_from([8, 2, 1])),
        cname=draw(st.sampled_from(["auto", "zstd", "lz4"])),
    )
    return Run(
        first,
        moves,
        [False] + [draw(st.integers(0, 7)) == 0 for _ in range(n - 1)],
        adam,
        [draw(st.integers(0, 3)) == 0 for _ in range(n)],
        policy,
        draw(st.sampled_from([64, 128, 512, 4096])),
        draw(st.integers(0, 2**16)),
    )


def steps(run: Run) -> list[tuple[dict[str, np.ndarray], dict[str, Prediction]]]:
    """Each step's arrays and predictions."""
    rng = np.random.default_rng(run.seed)
    now = {p: a.copy() for p, a in run.first.items()}
    out = []
    for k in range(len(run.raw)):
        if k:
            for p, how in run.moves[k - 1].items():
                a = now[p]
                if how == "nudge":
                    now[p] = (a.astype(np.float64) * (1 + 1e-3)).astype(a.dtype)
                elif how == "sparse" and a.size:
                    a = a.copy()
                    a.reshape(-1)[rng.integers(0, a.size)] += 1
                    now[p] = a
                elif how == "noise":
                    now[p] = rng.standard_normal(a.shape).astype(a.dtype)
        preds: dict[str, Prediction] = {}
        if run.adam:  # AdamW in float32 on noisy gradients
            lr, b1, b2, eps, wd = 1e-3, 0.9, 0.95, 1e-8, 0.1
            p, m, v = now[P], now[M], now[V]
            g = (rng.standard_normal(p.shape) * 0.01 + 0.02 * p).astype(np.float32)
            p = p * np.float32(1 - lr * wd)
            m = m + np.float32(1 - b1) * (g - m)
            v = v * np.float32(b2) + np.float32(1 - b2) * g * g
            t = k + 1
            denom = np.sqrt(v) / np.float32(math.sqrt(1 - b2**t)) + np.float32(eps)
            p = p - np.float32(lr / (1 - b1**t)) * (m / denom)
            now[P], now[M], now[V] = p, m, v
            preds = dict(
                adam_predictions(
                    param=P,
                    exp_avg=M,
                    exp_avg_sq=V,
                    lr=lr * (3 if run.wrong[k] else 1),
                    betas=(b1, b2),
                    eps=eps,
                    weight_decay=wd,
                    decoupled=True,
                    step=float(t),
                )
            )
        out.append(({p: a.copy() for p, a in now.items()}, preds))
    return out


def _chunks(layout: FlatLayout, buf: np.ndarray) -> list[Chunk]:
    arrays = layout.arrays
    return [
        Chunk(arrays[k].path, i, arrays[k].plan.itemsize, padded - (e - s), buf[s:e].copy())
        for k, i, s, e, _, padded in layout.chunks
    ]


SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(runs())
def test_the_flat_encoder_is_the_reference_made_fast(run: Run) -> None:
    w = Repository.create(MemoryStorage()).writer(chunk_bytes=run.chunk_bytes)
    ref = ReferenceEncoder(run.policy)
    st_: LayoutState | None = None
    base: FlatShadow | None = None
    for slot, ((arrays, preds), raw) in enumerate(zip(steps(run), run.raw, strict=True)):
        layout, buf = flat_buffer(w, arrays)
        if st_ is None:
            st_ = LayoutState(layout)
        chunks = _chunks(layout, buf)
        before = ref.kept
        outs = ref.step(chunks, slot, preds, raw=raw)
        if raw or base is None:
            base = _shadow(layout, slot, buf, [o.raw_crc for o in outs], None, None, None)
            continue
        got = encode_flat(run.policy, st_, buf, base, slot, preds, Scratch())
        assert got.kinds.tolist() == [o.kind for o in outs]
        assert got.raw_crcs.tolist() == [o.raw_crc for o in outs]
        assert got.depth.tolist() == [o.depth for o in outs]
        assert [got.codecs.get(j) for j in range(len(outs))] == [
            None if o.codec is None else tuple(o.codec) for o in outs
        ]
        assert got.payloads == [o.payload for o in outs if o.payload is not None]
        assert got.deps == ({base.slot} if any(o.kind for o in outs) else set())
        for c, o in zip(chunks, outs, strict=True):  # and every chunk decodes bit-exactly
            event(f"{o.kind}:{o.codec[0] if o.codec else ''}")  # 0 key, 1 delta, 2 dedup
            assert decode(c, o, before, chunks).tobytes() == c.data.tobytes(), (c.path, o)
        base = _shadow(layout, slot, buf, got.raw_crcs, got.depth, got.codecs, None)


def _shadow(
    layout: FlatLayout,
    slot: int,
    buf: np.ndarray,
    raw: Any,
    depth: np.ndarray | None,
    codecs: dict[int, tuple[Any, ...]] | None,
    files: Any,
) -> FlatShadow:
    n = len(layout.chunks)
    zeros = np.zeros(n, np.int64)
    return seed_shadow(
        layout,
        "main",
        slot,
        buf.copy(),
        np.full(n, files or "", dtype=object),
        zeros,
        zeros,
        np.asarray(raw, np.int64),
        raw_crcs=np.asarray(raw, np.int64),
        depth=depth,
        codecs=codecs,
    )


def _put_chunks(txn: Any, path: str, a: np.ndarray) -> None:
    """``a`` declared in ``txn`` and written chunk by chunk (0-d arrays stay 0-d)."""
    name = "bfloat16" if a.dtype == ml_dtypes.bfloat16 else a.dtype.name
    plan = txn.declare(path, name, a.shape)
    flat = a.reshape(-1).view(np.uint8)
    for i in range(plan.n_chunks):
        assert txn.put_chunk(path, i, flat[slice(*plan.byte_range(i))]) is None  # staged


@settings(SETTINGS, max_examples=25)
@given(runs())
def test_a_step_fed_chunk_by_chunk_is_stored_as_the_same_step_fed_flat(run: Run) -> None:
    stores = {"chunks": MemoryStorage(), "flat": MemoryStorage()}
    sequence = steps(run)
    for how, storage in stores.items():
        repo = Repository.create(storage)
        with repo.writer(encoding=run.policy, chunk_bytes=run.chunk_bytes) as w:
            for step, ((arrays, preds), raw) in enumerate(zip(sequence, run.raw, strict=True)):
                txn = w.begin(step + 1)
                txn.encode = not raw
                txn.predict(preds)
                if how == "flat":
                    layout, buf = flat_buffer(w, arrays)
                    txn.put_flat_chunks(layout, buf)
                else:
                    for p, a in arrays.items():
                        _put_chunks(txn, p, a)
                txn.commit()
    a, b = stores["chunks"], stores["flat"]
    keys = sorted(k for k in a.list("steps/"))
    assert keys == sorted(b.list("steps/"))
    for key in keys:  # step files (chunks, deltas) and headers (arrays tables) alike
        if not key.endswith(".json"):
            assert a.read(key) == b.read(key), key
    ra, rb = Repository.open(a).reader(), Repository.open(b).reader()
    for ha, hb in zip(ra.lineage(), rb.lineage(), strict=True):
        assert ra.arrays(ha) == rb.arrays(hb)
    for step, (arrays, _) in enumerate(sequence, start=1):
        got = load(a, step).arrays
        for p, want in arrays.items():
            assert same_bits(got[p], want), (step, p)


def test_a_staged_step_missing_chunks_is_refused_and_loses_nothing() -> None:
    """An encoding writer stages ``put_chunk``; a step whose array misses a chunk is
    refused at commit (not encoded, not hidden), and the committed steps stay as they were."""
    from dstt.errors import DsttError

    storage = MemoryStorage()
    repo = Repository.create(storage)
    a = np.arange(64, dtype=np.float32)
    with repo.writer(encoding=DeltaPolicy(), chunk_bytes=64) as w:
        txn = w.begin(1)
        _put_chunks(txn, "params/w", a)
        txn.commit()
        txn = w.begin(2)
        plan = txn.declare("params/w", "float32", a.shape)
        assert plan.n_chunks == 4
        txn.put_chunk("params/w", 0, (a + 1).view(np.uint8)[:64])  # 3 chunks never written
        with pytest.raises(DsttError, match=r"chunks \[1, 2, 3\] of 'params/w' were never"):
            txn.commit()
        txn.abort()
        txn = w.begin(2)
        _put_chunks(txn, "params/w", a + 2)
        txn.commit()
    assert same_bits(load(storage, 1).arrays["params/w"], a)
    assert same_bits(load(storage, 2).arrays["params/w"], a + 2)
    assert repo.verify().ok
