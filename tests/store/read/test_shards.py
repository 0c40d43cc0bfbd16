"""Logical arrays (``read/shards.py``): a tensor spread over the ranks' flat buffers, described
by shard maps and read across them; bad maps are corrupt runs. Without torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dstt.errors import CorruptRunError
from dstt.store import Repository
from dstt.store.read.shards import LogicalArray, Piece, logical_arrays, read_logical, shard_map

from .._util import put_array, same_bits


def _sharded_commit(
    repo: Repository, pieces: dict[str, list[Piece]], shape: tuple[int, ...] = (4, 5)
) -> object:
    """Two ranks each hold a flat buffer; logical ``params/w`` spans both."""
    flat0 = np.arange(12, dtype=np.float32)
    flat1 = np.arange(12, 24, dtype=np.float32)
    with repo.writer(chunk_bytes=16) as w:
        t = w.begin(1)
        put_array(t, "zero/r0/fp32", flat0)
        put_array(t, "zero/r1/fp32", flat1)
        for name, ps in pieces.items():
            t.put_object(name, shard_map([LogicalArray("params/w", "float32", shape, tuple(ps))]))
        return t.commit()


def test_logical_array_reads_across_ranks(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    # logical w (20 elements) = r0[2:12] ++ r1[0:10]
    h = _sharded_commit(
        repo,
        {
            "shards/r0": [Piece("zero/r0/fp32", 2, 0, 10)],
            "shards/r1": [Piece("zero/r1/fp32", 0, 10, 10)],
        },
    )
    r = repo.reader()
    la = logical_arrays(r, h)
    assert list(la) == ["params/w"]
    want = np.concatenate([np.arange(2, 12), np.arange(12, 22)]).astype(np.float32)
    assert same_bits(read_logical(r, h, la["params/w"]), want)
    assert same_bits(read_logical(r, h, la["params/w"], 7, 13), want[7:13])
    assert read_logical(r, h, la["params/w"], 5, 5).size == 0


@pytest.mark.parametrize(
    ("pieces", "match"),
    [
        ({"shards/r0": [Piece("zero/r0/fp32", 0, 0, 10)]}, "cover 10 of its 20"),
        (
            {"shards/r0": [Piece("zero/r0/fp32", 0, 0, 12), Piece("zero/r1/fp32", 0, 10, 10)]},
            "gap or overlap",
        ),
        ({"shards/r0": [Piece("zero/r9/fp32", 0, 0, 20)]}, "does not hold"),
        (
            {"shards/r0": [Piece("zero/r0/fp32", 5, 0, 10), Piece("zero/r1/fp32", 0, 10, 10)]},
            "out of its source",
        ),
    ],
)
def test_bad_shard_maps_are_corrupt(tmp_path: Path, pieces: dict, match: str) -> None:
    repo = Repository.create(tmp_path / "run")
    h = _sharded_commit(repo, pieces)
    with pytest.raises(CorruptRunError, match=match):
        logical_arrays(repo.reader(), h)


def test_shard_maps_must_agree_on_shape(tmp_path: Path) -> None:
    repo = Repository.create(tmp_path / "run")
    with repo.writer(chunk_bytes=16) as w:
        t = w.begin(1)
        put_array(t, "zero/r0/fp32", np.zeros(4, np.float32))
        t.put_object(
            "shards/r0",
            shard_map(
                [LogicalArray("params/w", "float32", (2, 2), (Piece("zero/r0/fp32", 0, 0, 2),))]
            ),
        )
        t.put_object(
            "shards/r1",
            shard_map(
                [LogicalArray("params/w", "float32", (4,), (Piece("zero/r0/fp32", 2, 2, 2),))]
            ),
        )
        h = t.commit()
    with pytest.raises(CorruptRunError, match="in another shard map"):
        logical_arrays(repo.reader(), h)


# -- boxes (dimension-sharded tensors: TP Shard(1), 2-d meshes) at non-zero offsets ----------


def _boxed_commit(
    repo: Repository, shape: tuple[int, ...], cuts: list[list[int]], dtype: str = "float32"
) -> tuple[object, np.ndarray]:
    """The logical ``params/w`` (``shape``, values 0, 1, 2 ... so a misplaced element shows)
    cut into boxes at ``cuts`` (per dimension), each stored as its own array of the box's
    shape and chunked small (several chunks per box): what a 2-d mesh writes."""
    from itertools import product

    from dstt.store.read.shards import Box

    want = np.arange(np.prod(shape)).astype(dtype).reshape(shape)
    boxes, stored = [], {}
    for n, corner in enumerate(product(*[range(len(c) - 1) for c in cuts])):
        lo = tuple(c[i] for c, i in zip(cuts, corner, strict=True))
        hi = tuple(c[i + 1] for c, i in zip(cuts, corner, strict=True))
        src = f"tp/r{n}/w"
        stored[src] = np.ascontiguousarray(want[tuple(map(slice, lo, hi))])
        boxes.append(Box(src, lo, tuple(h - lo_ for lo_, h in zip(lo, hi, strict=True))))
    with repo.writer(chunk_bytes=24) as w:
        t = w.begin(1)
        for src, a in stored.items():
            put_array(t, src, a)
        t.put_object(
            "shards/all",
            shard_map([LogicalArray("params/w", dtype, shape, boxes=tuple(boxes))]),
        )
        return t.commit(), want


@pytest.mark.parametrize(
    ("shape", "cuts"),
    [
        ((5, 12), [[0, 5], [0, 5, 12]]),  # tensor parallel Shard(1): columns split
        ((6, 8, 10), [[0, 2, 6], [0, 3, 8], [0, 4, 10]]),  # every dimension split
        ((7, 9), [[0, 3, 7], [0, 2, 9]]),  # a 2-d mesh, uneven
    ],
)
def test_box_reads_at_nonzero_offsets_in_every_dimension(
    tmp_path: Path, shape: tuple[int, ...], cuts: list[list[int]]
) -> None:
    """A box read at a non-zero column (or any dimension's) offset must return exactly the
    numpy reference's elements, whole and by region, logical and stored whole alike."""
    from dstt.store.read.shards import read_region

    repo = Repository.create(tmp_path / "run")
    h, want = _boxed_commit(repo, shape, cuts)
    r = repo.reader()
    la = logical_arrays(r, h)
    a = la["params/w"]
    assert same_bits(read_logical(r, h, a).reshape(shape), want)
    flat = want.reshape(-1)
    row = int(np.prod(shape[1:]))
    for start, stop in ((1, flat.size), (row + 1, 3 * row - 1), (row - 1, row + 2), (5, 6)):
        assert same_bits(read_logical(r, h, a, start, stop), flat[start:stop]), (start, stop)
    rng = np.random.default_rng(0)
    regions = [
        (tuple(1 for _ in shape), tuple(n - 1 for n in shape)),  # every offset non-zero
        (tuple(n - 1 for n in shape), tuple(1 for _ in shape)),  # the last element
        (tuple(c[1] for c in cuts), tuple(n - c[1] for n, c in zip(shape, cuts, strict=True))),
    ]
    for _ in range(40):
        lo = [int(rng.integers(0, n)) for n in shape]
        regions.append(
            (
                tuple(lo),
                tuple(int(rng.integers(1, n - o + 1)) for n, o in zip(shape, lo, strict=True)),
            )
        )
    # the same regions of the stored-whole tensor (``a is None``: plain rows + columns)
    with repo.writer(chunk_bytes=24) as w:
        t = w.begin(2)
        put_array(t, "params/w", want)
        h2 = t.commit()
    for offsets, sizes in regions:
        ref = want[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))]
        got = read_region(r, h, "params/w", offsets, sizes, la)
        assert same_bits(got, ref), (offsets, sizes)
        assert same_bits(read_region(r, h2, "params/w", offsets, sizes), ref), (offsets, sizes)
