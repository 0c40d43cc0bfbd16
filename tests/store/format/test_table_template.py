"""The arrays table of a flat step spliced from cached columns is byte for byte the table
built array by array, and falls back to building where a step is not one flat write."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dstt.store import Repository, load
from dstt.store.format.manifest import TableTemplate, dump_arrays, parse_arrays
from dstt.store.storage.memory import MemoryStorage

from .._util import put_array

# 0-d · empty · one chunk · several chunks (with chunk_bytes=256: a non-framed layout)
SPECS = [
    ("params/a/w", "float32", (3, 5), ("out", "in")),
    ("params/a/b", "float16", (7,), None),
    ("optim/a/w/step", "int64", (), None),
    ("params/e", "float32", (0,), None),
    ("params/big", "float32", (70, 9), ("row", "col")),
]


def _layout(w):
    return w.flat_layout([(p, dt, shape, dims) for p, dt, shape, dims in SPECS])


def _flat_step(w, layout, step: int, rng: np.random.Generator):
    buf = np.zeros(layout.nbytes, dtype=np.uint8)
    values = {}
    for a in layout.arrays:
        v = (
            rng.standard_normal(a.shape).astype(a.dtype)
            if a.dtype != "int64"
            else np.asarray(step, dtype=np.int64)
        )
        buf[a.offset : a.offset + a.nbytes] = np.frombuffer(v.tobytes(), np.uint8)
        values[a.path] = v
    txn = w.begin(step)
    txn.put_flat(layout, buf)
    return txn, values


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 256], ids=["framed", "chunked"])
def test_spliced_table_is_the_built_table_and_reads_back(chunk_bytes: int) -> None:
    mem = MemoryStorage()
    repo = Repository.create(mem)
    rng = np.random.default_rng(0)
    with repo.writer(chunk_bytes=chunk_bytes) as w:
        layout = _layout(w)  # the engine keeps its layout while the tensors hold
        for step in (1, 2, 3):
            txn, values = _flat_step(w, layout, step, rng)
            fast = txn.columns.arrays_table()
            assert fast == dump_arrays(txn.slot, txn.columns.table())
            txn.commit()
            table = parse_arrays(fast, "test")
            assert list(table) == [s[0] for s in SPECS]
            assert table["params/a/w"].dims == ("out", "in")
        assert len(w._tables) == 1  # one template, reused by every step
    snap = load(mem)
    for path, v in values.items():
        np.testing.assert_array_equal(snap.arrays[path], v)


def test_a_step_with_other_arrays_builds_its_table() -> None:
    repo = Repository.create(MemoryStorage())
    with repo.writer(chunk_bytes=256) as w:
        txn, _ = _flat_step(w, _layout(w), 1, np.random.default_rng(1))
        put_array(txn, "params/extra", np.arange(5, dtype=np.float32))
        table = parse_arrays(txn.columns.arrays_table(), "test")
        assert "params/extra" in table
        assert len(table) == len(SPECS) + 1
        assert not w._tables  # no template for a step that is not one flat write
        txn.commit()


def test_template_refuses_columns_of_another_length() -> None:
    tpl = TableTemplate(["a"], ["float32"], [(2,)], [2], [None], [12])
    with pytest.raises(ValueError, match="1 chunks got 2 offsets"):
        tpl.dump(1, "steps/x.zip", [0, 1], [5, 6])


def test_the_root_document_spliced_per_step_is_the_one_encoded_whole() -> None:
    """Per step only the root's attributes are encoded; the consolidated metadata of the
    cached documents is spliced in: the bytes must be those of the whole document."""
    from dstt.store.format.layout import plan_chunks
    from dstt.store.format.zarr_meta import (
        array_document,
        consolidated_metadata,
        dump,
        group_document,
        root_attributes,
        root_document,
        root_document_bytes,
    )

    arrays = {
        f"params/l{i}/w": dump(
            array_document(f"params/l{i}/w", "float32", plan_chunks((3, i + 1), 4, 1 << 20))
        )
        for i in range(3)
    }
    groups = {"params": dump(group_document())} | {
        f"params/l{i}": dump(group_document()) for i in range(3)
    }
    members = [(p, "group", d) for p, d in groups.items()] + [
        (p, "array", d) for p, d in arrays.items()
    ]
    attrs = root_attributes(step=7, timeline="main", slot=6)
    got = root_document_bytes(attrs, consolidated_metadata(members))
    want = dump(root_document(attrs, [(p, json.loads(d)) for p, _, d in members]))
    assert got == want
    assert b"\n" not in got
    assert b": " not in got  # compact: no indentation, no padding
