"""XOR deltas, keyframes and dedup: every slot reconstructs bit-exactly, across rollback and gc,
and a crash in the middle of an encoded commit leaves the previous commit readable."""

from __future__ import annotations

import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dstt.store import Repository, load
from dstt.store.codec.xor import DeltaPolicy
from dstt.store.format.layout import step_file_key

from .._util import WRITE, crash_at_every_write, put_flat_arrays, write_how  # noqa: F401
from .reference import chain_limit

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


class _Trainer:
    """Deterministic 'training': small multiplicative updates, one frozen tensor."""

    def __init__(self, seed: int, dtype: str) -> None:
        self.rng = np.random.default_rng(seed)
        self.dtype = DTYPES[dtype]
        self.name = dtype
        self.w = self.rng.standard_normal((300, 40)).astype(np.float32)
        self.m = np.zeros((300, 40), np.float32)
        self.frozen = self.rng.standard_normal(777).astype(self.dtype)

    def step(self) -> dict[str, np.ndarray]:
        g = self.rng.standard_normal(self.w.shape).astype(np.float32)
        self.m = 0.9 * self.m + 0.1 * g
        self.w = self.w - 1e-3 * self.m
        return {
            "params/w": self.w.astype(self.dtype),
            "optim/exp_avg/w": self.m.astype(self.dtype),
            "params/frozen": self.frozen,
            "params/scalar": np.array(1.0, self.dtype),
        }


pytestmark = pytest.mark.usefixtures("write_how")


def _commit(w, step: int, arrays: dict[str, np.ndarray]):  # type: ignore[no-untyped-def]
    txn = w.begin(step)
    if WRITE["how"] == "flat":
        put_flat_arrays(txn, arrays)
        txn.commit()
        return txn
    for name, a in arrays.items():
        plan = txn.declare(
            name, "bfloat16" if a.dtype == ml_dtypes.bfloat16 else a.dtype.name, a.shape
        )
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        for i in range(plan.n_chunks):
            s, e = plan.byte_range(i)
            txn.put_chunk(name, i, flat[s:e])
    txn.commit()
    return txn


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_every_slot_is_bit_exact(tmp_path: Path, dtype: str) -> None:
    run = tmp_path / "run"
    repo = Repository.create(run)
    t = _Trainer(0, dtype)
    written = {}
    kinds = {"key": 0, "delta": 0, "dedup": 0}
    with repo.writer(encoding=DeltaPolicy(keyframe_every=5), chunk_bytes=8192) as w:
        for step in range(1, 23):
            arrays = t.step()
            written[step] = {k: v.copy() for k, v in arrays.items()}
            st = _commit(w, step, arrays).stats
            kinds["key"] += st.keyframes
            kinds["delta"] += st.deltas
            kinds["dedup"] += st.dedups
    assert kinds["delta"] > 0
    assert kinds["dedup"] > 0
    assert kinds["key"] > 0
    for step, arrays in written.items():
        got = load(run, step).arrays
        for name, a in arrays.items():
            assert _same(got[name], a), (step, name)
    assert repo.verify().ok
    # chains are bounded by K: no chunk is more than K-1 deltas from its keyframe
    r = repo.reader()
    for h in r.lineage():
        for rec in r.arrays(h).values():
            for i, c in enumerate(rec.chunks):
                depth, cur = 0, c
                while cur.base is not None:
                    depth += 1
                    cur = r.arrays(r.header(cur.base))[rec.path].chunks[i]
                assert depth <= 4, (h.step, rec.path, i)


def test_frozen_tensors_are_not_rewritten(tmp_path: Path) -> None:
    run = tmp_path / "run"
    repo = Repository.create(run)
    t = _Trainer(1, "float32")
    with repo.writer(encoding=DeltaPolicy()) as w:
        for step in range(1, 6):
            _commit(w, step, t.step())
    r = repo.reader()
    first = r.lineage()[0]
    for h in r.lineage():  # every step references the bytes written by the first one
        assert [c.key for c in r.arrays(h)["params/frozen"].chunks] == [step_file_key(first.slot)]
        assert r.arrays(h)["params/frozen"].chunks == r.arrays(first)["params/frozen"].chunks
    holders = []
    for h in r.lineage():  # and only the first step file holds a chunk entry of it
        with zipfile.ZipFile(run / step_file_key(h.slot)) as zf:
            names = zf.namelist()
        assert "params/frozen/zarr.json" in names  # every step is a whole Zarr hierarchy
        if any(n.startswith("params/frozen/c/") for n in names):
            holders.append(h.slot)
    assert holders == [first.slot]  # written once
    assert _same(load(run, 5).arrays["params/frozen"], t.frozen)


def test_delta_slots_read_as_missing_by_plain_zarr(tmp_path: Path) -> None:
    import zarr
    from zarr.storage import ZipStore

    run = tmp_path / "run"
    repo = Repository.create(run)
    t = _Trainer(2, "float32")
    with repo.writer(encoding=DeltaPolicy(keyframe_every=3)) as w:
        first = t.step()
        _commit(w, 1, first)
        _commit(w, 2, t.step())
    r = repo.reader()
    h1, h2 = r.find(1), r.find(2)
    assert {c.encoding for c in r.arrays(h2)["params/w"].chunks} == {"xor1"}

    def plain(slot: int) -> np.ndarray:
        a = zarr.open_array(
            ZipStore(run / step_file_key(slot), mode="r"), path="params/w", mode="r", zarr_format=3
        )
        return np.asarray(a[...])

    assert np.array_equal(plain(h1.slot), first["params/w"])  # keyframe: plain Zarr
    assert np.isnan(plain(h2.slot)).all()  # delta: documented as missing for plain readers


def test_rollback_never_chains_across_timelines(tmp_path: Path) -> None:
    run = tmp_path / "run"
    repo = Repository.create(run)
    t = _Trainer(3, "float32")
    main: dict[int, dict[str, np.ndarray]] = {}
    with repo.writer(encoding=DeltaPolicy(keyframe_every=8)) as w:
        for step in range(1, 13):
            main[step] = {k: v.copy() for k, v in t.step().items()}
            _commit(w, step, main[step])
    repo.rollback(6)
    t2 = _Trainer(4, "float32")
    branch: dict[int, dict[str, np.ndarray]] = {}
    with repo.writer(encoding=DeltaPolicy(keyframe_every=8)) as w:
        for step in range(7, 15):
            branch[step] = {k: v.copy() for k, v in t2.step().items()}
            _commit(w, step, branch[step])
    r = repo.reader()
    new = r.current_timeline
    line = {h.slot for h in r.lineage(new)}
    for h in r.lineage(new):
        for rec in r.arrays(h).values():
            for c in rec.chunks:
                assert c.base is None or c.base in line  # bases are ancestors on this lineage
    for step in range(1, 13):
        assert _same(load(run, step, timeline="main").arrays["params/w"], main[step]["params/w"])
    for step in range(7, 15):
        assert _same(load(run, step).arrays["params/w"], branch[step]["params/w"])
    assert _same(load(run, 5).arrays["params/w"], main[5]["params/w"])  # shared history


def test_gc_keeps_the_keyframes_kept_slots_need(tmp_path: Path) -> None:
    run = tmp_path / "run"
    repo = Repository.create(run)
    t = _Trainer(5, "bfloat16")
    written = {}
    with repo.writer(encoding=DeltaPolicy(keyframe_every=6)) as w:
        for step in range(1, 20):
            written[step] = {k: v.copy() for k, v in t.step().items()}
            _commit(w, step, written[step])
    report = repo.gc(keep_last=2)
    assert report.pruned_steps  # something was pruned...
    assert repo.verify().ok  # ...but nothing a kept delta needs
    for step in (18, 19):
        for name, a in written[step].items():
            assert _same(load(run, step).arrays[name], a)


def test_crash_at_every_write_of_an_encoded_commit() -> None:
    t = _Trainer(6, "float32")
    steps = [t.step() for _ in range(3)]
    k, saw_delta = crash_at_every_write(
        lambda w, step: _commit(w, step, steps[step - 1]),
        lambda step: steps[step - 1],
        encoding=DeltaPolicy(),
    )
    assert k == 5
    assert saw_delta  # cut before each of its 4 writes (step, side, header, ref)


def test_chain_limit_rule() -> None:
    p = DeltaPolicy(read_amplification=4.0, max_chain=32)
    assert chain_limit(p, None) == 2
    assert chain_limit(p, 2.0) == 7  # 1 + (4-1)*2
    assert chain_limit(p, 100.0) == 32
    assert chain_limit(DeltaPolicy(keyframe_every=9), 2.0) == 9
    with pytest.raises(ValueError, match="keyframe_every must be >= 1"):
        DeltaPolicy(keyframe_every=0)


def test_codec_choice_and_bad_codec_names() -> None:
    assert DeltaPolicy().codec_for(2) == "zstd"
    assert DeltaPolicy().codec_for(4) == "lz4"
    assert DeltaPolicy(cname="zstd").codec_for(4) == "zstd"
    with pytest.raises(ValueError, match="cname='snappy'"):
        DeltaPolicy(cname="snappy")
    with pytest.raises(ValueError, match="residual_cname='auto'"):
        DeltaPolicy(residual_cname="auto")
