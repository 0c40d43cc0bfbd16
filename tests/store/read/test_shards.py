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
