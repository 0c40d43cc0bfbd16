"""Logical tensors of sharded (ZeRO-style) commits look like plain ones in every view.

Two "ranks" write flat buffers the way ZeRO stage 1/2 partitions do — the parameters of a
group concatenated and cut into equal ranges, so a parameter may span both ranks — plus
shard maps; views must show ``l1.weight`` etc. with their shapes and exact values, hide the
flat buffers, and read lazily (only the chunks holding the selected elements).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from inspect_helpers import CountingStorage

import dstt
from dstt.store import LocalStorage, Repository
from dstt.store.commit.parts import collect_parts
from dstt.store.read.shards import LogicalArray, Piece, shard_map

SHAPES = {"l1.weight": (6, 4), "l1.bias": (6,), "l2.weight": (3, 6)}


def _params(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def _write(repo: Repository, step: int, world: int = 2) -> dict[str, np.ndarray]:
    """One commit by ``world`` writers: rank r holds elements [r*P, (r+1)*P) of the flat."""
    params = _params(step)
    flat = np.concatenate([params[n].reshape(-1) for n in SHAPES])
    size = -(-flat.size // world)
    flat = np.concatenate([flat, np.zeros(size * world - flat.size, np.float32)])  # padding
    offsets, off = {}, 0
    for n, s in SHAPES.items():
        offsets[n] = off
        off += int(np.prod(s))
    writers = [repo.writer(chunk_bytes=16)] + [
        repo.writer(chunk_bytes=16, exclusive=False) for _ in range(1, world)
    ]
    slot = writers[0].next_slot
    txns = []
    for r, w in enumerate(writers):
        t = w.begin(step, slot=slot)
        src = f"zero/r{r}/g0/fp32"
        part = flat[r * size : (r + 1) * size]
        plan = t.declare(src, "float32", part.shape)
        raw = part.view(np.uint8)
        for i in range(plan.n_chunks):
            a, b = plan.byte_range(i)
            t.put_chunk(src, i, raw[a:b])
        arrays = []
        for n, s in SHAPES.items():
            o, numel = offsets[n], int(np.prod(s))
            lo, hi = max(o, r * size), min(o + numel, (r + 1) * size)
            if lo < hi:
                arrays.append(
                    LogicalArray(
                        f"params/{n.replace('.', '/')}",
                        "float32",
                        s,
                        (Piece(src, lo - r * size, lo - o, hi - lo),),
                    )
                )
        t.put_object(f"shards/r{r}", shard_map(arrays))
        txns.append(t)
    for r in range(1, world):
        txns[r].prepare(rank=r, world=world, session="s")
    parts = collect_parts(
        repo.storage, slot=slot, step=step, ranks=range(1, world), world=world, session="s"
    )
    txns[0].commit({"loss": float(step)}, parts=parts)
    for w in writers:
        w.close()
    return params


@pytest.fixture
def sharded_run(tmp_path: Path) -> tuple[Path, dict[int, dict[str, np.ndarray]]]:
    path = tmp_path / "run"
    repo = Repository.create(path)
    return path, {s: _write(repo, s) for s in (1, 2, 3)}


def test_layer_shows_logical_tensors(sharded_run: tuple[Path, dict]) -> None:
    path, want = sharded_run
    snap = dstt.open(path).at(2)
    assert snap.names() == sorted(SHAPES)  # the flat buffers are hidden
    ds = snap.layer("l1")["l1"].to_dataset()
    assert ds["weight"].shape == (6, 4)
    np.testing.assert_array_equal(ds["weight"].values, want[2]["l1.weight"])
    np.testing.assert_array_equal(snap.tensor("l2.weight").values, want[2]["l2.weight"])
    # the raw buffer stays reachable by its store path
    assert snap.tensor("zero/r1/g0/fp32").shape == (48 // 2,)


def test_trajectory_diff_export(sharded_run: tuple[Path, dict], tmp_path: Path) -> None:
    path, want = sharded_run
    run = dstt.open(path)
    traj = run.trajectory("l1.bias")
    assert traj.dims[0] == "step"
    np.testing.assert_array_equal(traj.values, np.stack([want[s]["l1.bias"] for s in (1, 2, 3)]))
    d = run.diff(1, 3)
    row = list(d["tensor"].values).index("l2.weight")
    exp = np.linalg.norm((want[3]["l2.weight"] - want[1]["l2.weight"]).astype(np.float64))
    assert d["delta_l2"].values[row] == pytest.approx(exp)
    out = tmp_path / "x.safetensors"
    pytest.importorskip("safetensors")
    run.at(3).export(out)
    from safetensors.numpy import load_file

    got = load_file(str(out))
    assert sorted(got) == sorted(SHAPES)
    np.testing.assert_array_equal(got["l1.weight"], want[3]["l1.weight"])


def test_logical_reads_are_lazy(sharded_run: tuple[Path, dict]) -> None:
    path, want = sharded_run
    counting = CountingStorage(LocalStorage(path))
    snap = dstt.open(Repository(counting)).at(3)
    counting.reads.clear()
    v = snap.tensor("l2.weight").isel({"weight_0": 0}).values  # the last parameter: rank 1
    np.testing.assert_array_equal(v, want[3]["l2.weight"][0])
    assert counting.data_reads() == {"zero/r1/g0/fp32"}  # only rank 1's flat buffer
    assert {step for step, _, _ in counting.chunk_reads()} == {3}


def test_boxes_read_exactly_at_nonzero_offsets(tmp_path: Path) -> None:
    """A tensor stored as boxes split along every dimension (TP ``Shard(1)`` on a 2-d mesh):
    the inspection views read it, and any selection at non-zero offsets in each dimension,
    exactly as the numpy reference (a wrong column offset once went unnoticed)."""
    from itertools import product

    from dstt.store.read.shards import Box

    shape, cuts = (6, 10), [[0, 2, 6], [0, 3, 10]]
    want = np.arange(60, dtype=np.float32).reshape(shape)
    repo = Repository.create(tmp_path / "run")
    with repo.writer(chunk_bytes=16) as w:
        t = w.begin(1)
        boxes = []
        for n, (i, j) in enumerate(product(range(2), range(2))):
            lo, hi = (cuts[0][i], cuts[1][j]), (cuts[0][i + 1], cuts[1][j + 1])
            src = f"tp/r{n}/w"
            part = np.ascontiguousarray(want[lo[0] : hi[0], lo[1] : hi[1]])
            plan = t.declare(src, "float32", part.shape)
            raw = part.reshape(-1).view(np.uint8)
            for c in range(plan.n_chunks):
                a, b = plan.byte_range(c)
                t.put_chunk(src, c, raw[a:b])
            boxes.append(Box(src, lo, (hi[0] - lo[0], hi[1] - lo[1])))
        t.put_object(
            "shards/all",
            shard_map([LogicalArray("params/w", "float32", shape, boxes=tuple(boxes))]),
        )
        t.commit({"loss": 1.0})
    snap = dstt.open(tmp_path / "run").at(1)
    v = snap.tensor("w")
    np.testing.assert_array_equal(v.values, want)
    d0, d1 = v.dims
    for rows, cols in ((slice(1, 5), slice(4, 9)), (slice(3, 6), slice(7, 10)), (4, slice(1, 8))):
        got = v.isel({d0: rows, d1: cols}).values
        np.testing.assert_array_equal(got, want[rows, cols])
