"""Bit-exact round trips through ``save/load`` and through Repository → Writer → Transaction."""

from __future__ import annotations

import json
import random
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from dstt.errors import DsttError, SchemaError, UnsafeObjectError
from dstt.store import Repository, load, save
from dstt.store.format.layout import (
    STEPS_PREFIX,
    commit_key,
    side_file_key,
    step_file_key,
    zarr_chunk_key,
)
from dstt.store.storage.memory import MemoryStorage

from ._util import (
    DTYPES,
    assert_same_arrays,
    commit_arrays,
    deep_equal,
    np_dtype,
    put_array,
    same_bits,
    sample,
    zip_entry,
)

# () 0-d · (0,) and (3, 0, 2) empty · (7,) one chunk · (33, 5) many chunks with an edge chunk
SHAPES = [(), (0,), (3, 0, 2), (7,), (33, 5)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_save_load_every_dtype_and_shape(tmp_path: Path, dtype: str) -> None:
    arrays = {
        f"params/{dtype}/s{i}": sample(dtype, shape, seed=i) for i, shape in enumerate(SHAPES)
    }
    save(tmp_path / "run", 3, arrays, chunk_bytes=np_dtype(dtype).itemsize * 5 * 4)  # 4 rows
    snap = load(tmp_path / "run")
    assert snap.header.step == 3
    assert_same_arrays(snap.arrays, arrays)
    # the big one really is several chunks and the last one is an edge chunk
    r = Repository.open(tmp_path / "run").reader()
    rec = r.arrays(snap.header)[f"params/{dtype}/s4"]
    assert (rec.plan.rows, rec.plan.n_chunks) == (4, 9)  # 8 full chunks and a 1-row edge
    assert [
        r.read_array(snap.header, f"params/{dtype}/s{i}").shape for i in range(len(SHAPES))
    ] == SHAPES


@pytest.mark.parametrize("dtype", DTYPES)
def test_transaction_round_trip_threads_and_any_chunk_order(tmp_path: Path, dtype: str) -> None:
    repo = Repository.create(tmp_path / "run")
    want = {
        f"optim/exp_avg/{i}/w": sample(dtype, shape, seed=100 + i) for i, shape in enumerate(SHAPES)
    }
    with repo.writer(chunk_bytes=40) as w:
        txn = w.begin(10)
        jobs = []
        for p, a in want.items():
            plan = txn.declare(p, dtype, a.shape)
            flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            for i in range(plan.n_chunks):
                start, stop = plan.byte_range(i)
                jobs.append((p, i, flat[start:stop]))
        random.Random(dtype).shuffle(jobs)
        with ThreadPoolExecutor(4) as pool:  # put_chunk is documented thread-safe
            list(pool.map(lambda j: txn.put_chunk(*j), jobs))
        header = txn.commit({"loss": 0.5})
    r = repo.reader()
    assert r.head() == header
    for p, a in want.items():
        assert same_bits(r.read_array(header, p), a)
        rec = r.arrays(header)[p]
        for i in range(rec.plan.n_chunks):  # read_chunk returns exactly the tensor's byte range
            start, stop = rec.plan.byte_range(i)
            flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            assert bytes(r.read_chunk(header, p, i)) == flat[start:stop].tobytes()
    big = "optim/exp_avg/4/w"
    assert same_bits(r.read_rows(header, big, 4, 29), want[big][4:29])
    assert same_bits(r.read_rows(header, big, 30, 99), want[big][30:])
    assert r.read_rows(header, big, 5, 5).shape == (0, 5)


def test_edge_chunk_written_full_size_with_zero_padding(tmp_path: Path) -> None:
    a = np.arange(10 * 3, dtype=np.int32).reshape(10, 3)
    save(tmp_path / "run", 0, {"params/w": a}, chunk_bytes=48)  # 4 rows per chunk: 4+4+2
    r = Repository.open(tmp_path / "run").reader()
    h = r.head()
    assert h is not None
    rec = r.arrays(h)["params/w"]
    assert (rec.rows, rec.plan.n_chunks) == (4, 3)
    zpath = tmp_path / "run" / step_file_key(h.slot)
    assert rec.chunks[2].key == step_file_key(h.slot)
    # the edge chunk is the zip entry params/w/c/2/0, where the manifest says it is
    offset, size = zip_entry(zpath, zarr_chunk_key("params/w", (2, 0)))
    assert (rec.chunks[2].offset, rec.chunks[2].nbytes) == (offset, size)
    with zipfile.ZipFile(zpath) as zf:
        edge = zf.read(zarr_chunk_key("params/w", (2, 0)))  # checks the entry's CRC-32 too
    assert len(edge) == 4 * 3 * 4 + 4  # full chunk + crc32c trailer
    assert edge[:24] == a[8:].tobytes()
    assert edge[24:48] == bytes(24)
    assert rec.chunks[2].nbytes == len(edge)
    raw = zpath.read_bytes()
    assert raw[offset : offset + size] == edge


def test_large_tensor_many_chunks(tmp_path: Path) -> None:
    a = sample("float32", (1000, 17), seed=7)
    save(tmp_path / "run", 1, {"params/big": a}, chunk_bytes=4096)
    snap = load(tmp_path / "run", step=1)
    assert same_bits(snap.arrays["params/big"], a)
    r = Repository.open(tmp_path / "run").reader()
    assert r.arrays(snap.header)["params/big"].plan.n_chunks == -(-1000 // (4096 // 68))


def test_non_native_byte_order_is_stored_as_values(tmp_path: Path) -> None:
    a = (np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5).astype(">f4")
    b = (np.arange(5, dtype=np.int64) * -3).astype(">i8")
    assert a.dtype.byteorder == ">"
    assert b.dtype.byteorder == ">"
    save(tmp_path / "run", 1, {"params/a": a, "params/b": b})
    got = load(tmp_path / "run").arrays
    np.testing.assert_array_equal(got["params/a"], a)
    np.testing.assert_array_equal(got["params/b"], b)
    assert got["params/a"].dtype == np.dtype("<f4")


def test_non_contiguous_input(tmp_path: Path) -> None:
    base = sample("int16", (6, 8), seed=3)
    view = base[::2, 1::3]
    save(tmp_path / "run", 1, {"params/v": view})
    assert same_bits(load(tmp_path / "run").arrays["params/v"], np.ascontiguousarray(view))


OBJECTS = {
    "plain": {"a": 1, "b": [1, 2.5, "x", None, True, False], "c": {"d": {"e": -3}}},
    "tuple": (1, (2, 3), [4, (5,)]),
    "bytes": b"\x00\xffabc",
    "empty_bytes": b"",
    "nonstr_keys": {1: "int", 2.5: "float", (1, 2): "tuple", None: "none", False: "bool"},
    "dollar_keys": {"$float": "not a tag", "$tuple": [1]},
    "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 1e-310, 1.7976931348623157e308],
    "big_int": 2**80,
    "str": 'ünïcødé \u2603 "quoted"',
    "empty": {"list": [], "dict": {}, "tuple": ()},
    "np_f32": np.arange(6, dtype=np.float32).reshape(2, 3),
    "np_0d": np.array(7, dtype=np.int64),
    "np_empty": np.zeros((0, 4), dtype=np.uint8),
    "np_bool": np.array([True, False]),
    "np_bf16": np.arange(5, dtype=np.float32).astype(ml_dtypes.bfloat16),
    "np_nan": np.array([np.nan, -np.inf], dtype=np.float64),
    "np_in_tuple": ("rng", np.arange(3, dtype=np.uint32)),
    # sequences encoded as they are (no call per item): words, names, finite numbers
    "rng_words": (3, tuple(range(625)), None),
    "names": ["a.weight", "a.bias", ""],
    "finite": [0.5, -0.0, 2, True, 1e-310],
    "nan_in_tuple": (1.0, float("nan")),  # not finite: the tagged path
}


def test_objects_tagged_json_round_trip(tmp_path: Path) -> None:
    save(tmp_path / "run", 1, {}, objects=OBJECTS)
    got = load(tmp_path / "run").objects
    assert sorted(got) == sorted(OBJECTS)
    for name, want in OBJECTS.items():
        assert deep_equal(got[name], want), (name, got[name], want)


def test_objects_numpy_scalar_becomes_python_number(tmp_path: Path) -> None:
    save(tmp_path / "run", 1, {}, objects={"x": np.float32(0.5), "y": [np.int64(3)]})
    got = load(tmp_path / "run").objects
    assert deep_equal(got["x"], 0.5)
    assert deep_equal(got["y"], [3])


def test_objects_unstorable_as_json_are_refused(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    with repo.writer() as w:
        txn = w.begin(1)
        with pytest.raises(TypeError, match="pickle"):
            txn.put_object("x", {1, 2})
        with pytest.raises(TypeError, match="pickle"):
            txn.put_object("y", np.array([object()], dtype=object))
        txn.abort()
    assert repo.reader().head() is None


def test_pickle_objects_need_trusted(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    with repo.writer() as w:
        txn = w.begin(1)
        txn.put_object("user", {"s": {1, 2, 3}}, encoding="pickle")
        txn.put_object("raw", b"\x01\x02", encoding="raw")
        h = txn.commit()
    r = repo.reader()
    with pytest.raises(UnsafeObjectError, match="pickle") as ei:
        r.read_object(h, "user")
    assert isinstance(ei.value, PermissionError)
    assert h.objects["user"].key in str(ei.value)  # names the file
    with pytest.raises(UnsafeObjectError):
        load(tmp_path / "run")
    assert r.read_object(h, "user", trusted=True) == {"s": {1, 2, 3}}
    assert r.read_object(h, "raw") == b"\x01\x02"
    assert load(tmp_path / "run", trusted=True).objects == {
        "user": {"s": {1, 2, 3}},
        "raw": b"\x01\x02",
    }


def test_metrics_round_trip_including_non_finite(tmp_path: Path) -> None:
    metrics = {
        "loss": 1.25,
        "nan": float("nan"),
        "inf": float("inf"),
        "ninf": float("-inf"),
        "n": 7,
        "flag": True,
        "note": "warmup",
        "tiny": 5e-324,
    }
    save(tmp_path / "run", 4, {"params/w": np.zeros(2, np.float32)}, metrics=metrics)
    h = Repository.open(tmp_path / "run").reader().head()
    assert h is not None
    assert sorted(h.metrics) == sorted(metrics)  # key order is not kept (canonical JSON)
    for k, v in metrics.items():
        assert deep_equal(h.metrics[k], v), k
    # the header on disk is strict JSON (no NaN/Infinity tokens)
    raw = (tmp_path / "run" / commit_key(h.slot)).read_text()
    json.loads(raw, parse_constant=lambda c: pytest.fail(f"non-standard JSON token {c}"))


def test_many_steps_each_in_its_own_step_file(tmp_path: Path) -> None:
    """Format 2 has no run-wide slot axis to grow: every step is its own zip (a Zarr
    hierarchy whose arrays have the tensor's shape) plus side file, and all stay readable."""
    repo = Repository.create(tmp_path / "run", durability="none")
    want = {}
    slots = {}
    with repo.writer(chunk_bytes=32) as w:
        for step in range(0, 150):
            arrays = {
                "params/w": sample("float32", (9,), seed=step),
                "params/b": sample("bfloat16", (3, 2), seed=1000 + step),
            }
            txn = w.begin(step)
            for p, a in arrays.items():
                put_array(txn, p, a)
            slots[step] = txn.commit({"step": step}).slot
            want[step] = arrays
    assert sorted(slots.values()) == list(range(150))
    steps_dir = tmp_path / "run" / STEPS_PREFIX
    assert sorted(p.name for p in steps_dir.iterdir()) == sorted(
        [step_file_key(s).split("/")[-1] for s in range(150)]
        + [side_file_key(s).split("/")[-1] for s in range(150)]
    )
    assert not (tmp_path / "run" / "params").exists()  # no run-wide arrays any more
    r = Repository.open(tmp_path / "run").reader()
    assert [h.step for h in r.lineage()] == list(range(150))
    for h in r.lineage():
        for rec in r.arrays(h).values():  # every chunk of a step lives in that step's zip
            assert {c.key for c in rec.chunks} == {step_file_key(h.slot)}
        assert h.arrays is not None
        assert h.arrays.key == side_file_key(h.slot)
    for step in (0, 1, 63, 64, 65, 127, 128, 149):
        slot = slots[step]
        with zipfile.ZipFile(steps_dir / step_file_key(slot).split("/")[-1]) as zf:
            root = json.loads(zf.read("zarr.json"))
            assert root["attributes"]["dstt"] == {
                "format": 2,
                "step": step,
                "timeline": "main",
                "slot": slot,
            }
            for p, shape in (("params/w", [9]), ("params/b", [3, 2])):
                doc = json.loads(zf.read(f"{p}/zarr.json"))
                assert doc["shape"] == shape  # no slot axis
            assert zf.testzip() is None  # every entry's CRC-32 holds
        assert_same_arrays(load(tmp_path / "run", step=step).arrays, want[step])
    assert Repository.open(tmp_path / "run").verify().ok


def test_schema_change_is_refused(tmp_path: Path) -> None:
    a = sample("float32", (4, 3), seed=1)
    save(tmp_path / "run", 1, {"params/w": a})
    with pytest.raises(SchemaError, match="params/w") as ei:
        save(tmp_path / "run", 2, {"params/w": sample("float32", (4, 4), seed=2)})
    assert isinstance(ei.value, ValueError)
    with pytest.raises(SchemaError):
        save(tmp_path / "run", 2, {"params/w": sample("float64", (4, 3), seed=2)})
    with pytest.raises(SchemaError):
        save(tmp_path / "run", 2, {"params/w": sample("float32", (12,), seed=2)})
    snap = load(tmp_path / "run")
    assert snap.header.step == 1
    assert same_bits(snap.arrays["params/w"], a)
    # a later good step still commits
    b = sample("float32", (4, 3), seed=3)
    save(tmp_path / "run", 2, {"params/w": b})
    assert same_bits(load(tmp_path / "run").arrays["params/w"], b)


def test_arrays_may_come_and_go_between_steps() -> None:
    st = MemoryStorage()
    repo = Repository.create(st)
    a, b = sample("int8", (5,), 1), sample("int8", (2,), 2)
    commit_arrays(repo, 1, {"params/a": a})
    commit_arrays(repo, 2, {"params/b": b})
    assert_same_arrays(load(st, step=1).arrays, {"params/a": a})
    assert_same_arrays(load(st, step=2).arrays, {"params/b": b})


def test_steps_must_increase_and_failed_commit_is_invisible() -> None:
    st = MemoryStorage()
    repo = Repository.create(st)
    a = sample("float16", (4,), 1)
    commit_arrays(repo, 5, {"params/a": a})
    for bad in (5, 4):
        with pytest.raises(ValueError, match="not after the head"):
            commit_arrays(repo, bad, {"params/a": sample("float16", (4,), bad)})
    snap = load(st)
    assert snap.header.step == 5
    assert same_bits(snap.arrays["params/a"], a)
    assert Repository(st).verify().ok


def test_incomplete_or_wrong_sized_chunks_are_refused() -> None:
    repo = Repository.create(MemoryStorage())
    with repo.writer(chunk_bytes=8) as w:
        txn = w.begin(1)
        plan = txn.declare("params/w", "float32", (5,))
        assert plan.n_chunks == 3
        with pytest.raises(ValueError, match="needs 8 bytes"):
            txn.put_chunk("params/w", 0, b"\x00" * 7)
        with pytest.raises(IndexError):
            txn.put_chunk("params/w", 3, b"\x00" * 4)
        with pytest.raises(ValueError, match="not declared"):
            txn.put_chunk("params/x", 0, b"\x00" * 8)
        txn.put_chunk("params/w", 0, b"\x00" * 8)
        txn.put_chunk("params/w", 2, b"\x00" * 4)
        with pytest.raises(DsttError, match=r"chunks \[1\]"):
            txn.commit()
        assert txn.state == "failed"
    assert repo.reader().head() is None


def test_abort_leaves_nothing_visible() -> None:
    st = MemoryStorage()
    repo = Repository.create(st)
    commit_arrays(repo, 1, {"params/w": sample("int32", (3,), 1)})
    with repo.writer() as w:
        txn = w.begin(2)
        put_array(txn, "params/w", sample("int32", (3,), 2))
        txn.put_object("o", 1)
        txn.abort()
        with pytest.raises(DsttError, match="aborted"):
            txn.commit()
    assert load(st).header.step == 1


def test_bfloat16_exact_including_nan_payloads(tmp_path: Path) -> None:
    bits = np.array(
        [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x0001, 0x3F80], dtype=np.uint16
    )
    a = bits.view(ml_dtypes.bfloat16)
    save(tmp_path / "run", 1, {"params/bf": a})
    got = load(tmp_path / "run").arrays["params/bf"]
    assert got.dtype == np_dtype("bfloat16")
    assert got.view(np.uint16).tolist() == bits.tolist()


def test_object_name_stored_twice_is_refused_before_anything_is_overwritten() -> None:
    st = MemoryStorage()
    repo = Repository.create(st)
    with repo.writer() as w:
        txn = w.begin(1)
        txn.put_object("rng/torch", {"a": 1})
        with pytest.raises(ValueError, match="stored twice"):
            txn.put_object("rng/torch", {"a": 2})
        # format 2 keeps objects in the side file, named only in the header: names that a
        # file-per-object layout would have mapped to one file stay apart
        txn.put_object("rng_torch", {"b": 3})
        txn.put_object("rng.torch", 4)
        h = txn.commit()
    assert load(st).objects == {"rng/torch": {"a": 1}, "rng_torch": {"b": 3}, "rng.torch": 4}
    assert {o.key for o in h.objects.values()} == {side_file_key(h.slot)}
    assert len({o.offset for o in h.objects.values()}) == 3  # three separate byte ranges
    assert Repository(st).verify().ok


def test_chunking_of_an_existing_array_is_kept_when_chunk_bytes_changes() -> None:
    st = MemoryStorage()
    repo = Repository.create(st)
    a1, a2 = sample("int16", (40, 3), 1), sample("int16", (40, 3), 2)
    commit_arrays(repo, 1, {"params/w": a1}, chunk_bytes=60)  # 10 rows per chunk
    commit_arrays(repo, 2, {"params/w": a2}, chunk_bytes=1 << 20)
    r = repo.reader()
    assert [r.arrays(h)["params/w"].rows for h in r.lineage()] == [10, 10]
    assert same_bits(load(st, step=1).arrays["params/w"], a1)
    assert same_bits(load(st, step=2).arrays["params/w"], a2)
