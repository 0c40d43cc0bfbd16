"""A timeline as one virtual Zarr store, read by plain xarray through fsspec's reference
file system in a process that imports neither dstt nor torch, bit for bit against
``dstt.open(run).trajectory``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from virtual_helpers import read_plain

import dstt
from dstt.errors import ConfigError


def train(run: Path, steps: int, *, resume: bool = False, width: int = 6, **kw: object) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with dstt.session(model, opt, run=run, every=1, resume=resume, **kw) as s:  # type: ignore[arg-type]
        for _ in range(s.step, steps):
            loss = model(torch.randn(4, width)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            s.log(loss=loss.item())


NAMES = {"0.weight": "params/0/weight", "2.bias": "params/2/bias"}
OPTIM = ("exp_avg", "0.weight", "optim/exp_avg/0/weight")


def test_plain_xarray_reads_every_trajectory_bit_for_bit(tmp_path: Path) -> None:
    run_dir, refs = tmp_path / "run", tmp_path / "run.refs.json"
    train(run_dir, 5)
    run = dstt.open(run_dir)
    rep = run.virtual(refs)
    assert rep.steps == (1, 2, 3, 4, 5)
    assert not rep.left_out_steps
    paths = [*NAMES.values(), OPTIM[2]]
    got = read_plain(refs, paths)
    assert got["modules"] == [], "the reader must not import dstt or torch"
    assert got["steps"] == [1, 2, 3, 4, 5]
    want = np.asarray(run.metrics()["loss"].values, dtype=np.float64)
    assert got["loss"] == want.tolist()
    for name, path in NAMES.items():
        ref = run.trajectory(name).values
        entry = got[path]
        assert isinstance(entry, dict)
        assert entry["dims"][0] == "step"
        assert bytes.fromhex(entry["bytes"]) == np.ascontiguousarray(ref).tobytes(), name
    # optimizer state: a trajectory of one state tensor, read the same way
    state = np.stack([run.reader.read_array(h, OPTIM[2]) for h in run.commits()])
    entry = got[OPTIM[2]]
    assert isinstance(entry, dict)
    assert bytes.fromhex(entry["bytes"]) == np.ascontiguousarray(state).tobytes()


def test_rerunning_appends_the_new_steps_and_keeps_the_old_references(tmp_path: Path) -> None:
    run_dir, refs = tmp_path / "run", tmp_path / "run.refs.json"
    train(run_dir, 3)
    dstt.open(run_dir).virtual(refs)
    before = json.loads(refs.read_text())["refs"]
    train(run_dir, 5, resume=True)
    rep = dstt.open(run_dir).virtual(refs)
    assert rep.added == (4, 5)
    assert rep.steps == (1, 2, 3, 4, 5)
    after = json.loads(refs.read_text())["refs"]
    old_chunks = {k: v for k, v in before.items() if isinstance(v, list)}
    assert old_chunks, "chunk references were written"
    assert all(after[k] == v for k, v in old_chunks.items())
    got = read_plain(refs, ["params/0/weight"])
    ref = dstt.open(run_dir).trajectory("0.weight").values
    entry = got["params/0/weight"]
    assert isinstance(entry, dict)
    assert bytes.fromhex(entry["bytes"]) == np.ascontiguousarray(ref).tobytes()
    assert dstt.open(run_dir).virtual(refs).added == ()  # up to date: nothing added


def test_delta_encoded_steps_are_left_out_and_listed(tmp_path: Path) -> None:
    run_dir, refs = tmp_path / "run", tmp_path / "run.refs.json"
    train(run_dir, 6, width=512, encoding=dstt.DeltaPolicy(raw_when_busy=False))
    run = dstt.open(run_dir)
    encoded = {
        h.step
        for h in run.commits()
        if any(c.encoding != "raw" for r in run.arrays(h).values() for c in r.chunks)
    }
    assert encoded, "a DeltaPolicy run that never waits for CPU encodes some steps"
    rep = run.virtual(refs)
    assert set(rep.left_out_steps) == encoded
    assert set(rep.steps) | set(rep.left_out_steps) == set(range(1, 7))
    assert all("delta-encoded" in why for why in rep.left_out_steps.values())
    root = json.loads(json.loads(refs.read_text())["refs"]["run/zarr.json"])
    assert root["attributes"]["dstt"]["left_out_steps"]
    got = read_plain(refs, ["params/0/weight"])
    ref = np.stack([run.at(k).tensor("0.weight").values for k in rep.steps])
    entry = got["params/0/weight"]
    assert isinstance(entry, dict)
    assert bytes.fromhex(entry["bytes"]) == np.ascontiguousarray(ref).tobytes()


def test_an_output_of_another_run_is_refused(tmp_path: Path) -> None:
    train(tmp_path / "a", 2)
    train(tmp_path / "b", 2)
    refs = tmp_path / "refs.json"
    dstt.open(tmp_path / "a").virtual(refs)
    with pytest.raises(ConfigError, match="another output"):
        dstt.open(tmp_path / "b").virtual(refs)


def test_the_cli_writes_the_references(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dstt.cli import EXIT_OK, main

    train(tmp_path / "run", 2)
    code = main(["virtual", str(tmp_path / "run"), "-o", str(tmp_path / "r.json"), "--json"])
    assert code == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps"] == 2
    assert doc["added"] == [1, 2]
    assert main(["virtual", str(tmp_path / "run"), "-o", str(tmp_path / "r.json")]) == EXIT_OK
    text = capsys.readouterr().out
    assert "2 steps (steps 1..2)" in text
    assert "0 steps added" in text
    assert "remote_protocol" not in text  # step files on the local disk


def test_a_run_in_memory_is_refused(tmp_path: Path) -> None:
    from dstt.store import Repository
    from dstt.store.storage.memory import MemoryStorage

    storage = MemoryStorage()
    Repository.create(storage)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with dstt.session(model, opt, run=Repository(storage), every=1) as s:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        s.log(loss=1.0)
    with pytest.raises(ConfigError, match="memory"):
        dstt.open(Repository(storage)).virtual(tmp_path / "refs.json")
    assert not (tmp_path / "refs.json").exists()


def _boxes(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]]
) -> Any:
    """``_box_chunks`` of a logical array of ``shape`` stored as ``boxes`` (offsets, sizes,
    rows per chunk), each box a real record of one chunk file per chunk."""
    from dstt.inspect.virtual import _box_chunks
    from dstt.store._internal import ArrayRecord, Box, LogicalArray
    from dstt.store.format.records import ChunkRecord

    table: dict[str, ArrayRecord] = {}
    made = []
    for r, (offsets, sizes, rows) in enumerate(boxes):
        src = f"dtensor/w{len(boxes)}/r{r}/params/w"
        n = -(-sizes[0] // rows) if sizes[0] else 0
        chunks = tuple(ChunkRecord(f"r{r}.zip", 4, 0, offset=100 * j) for j in range(n))
        table[src] = ArrayRecord(src, "float32", sizes, rows, chunks)
        made.append(Box(src, offsets, sizes))
    return _box_chunks(LogicalArray("params/w", "float32", shape, boxes=tuple(made)), table)


def test_the_box_grid_holds_column_splits_and_replicas_and_names_what_it_cannot() -> None:
    # tensor parallel along dim 1: (4, 6) as two (4, 3) boxes, each one chunk
    grid, cells = _boxes((4, 6), [((0, 0), (4, 3), 4), ((0, 3), (4, 3), 4)])
    assert grid == (4, 3)
    assert {k: c.key for k, c in cells.items()} == {(0, 0): "r0.zip", (0, 1): "r1.zip"}
    # rows split in chunks of 2 within each box, and a replica of box 0 (HSDP)
    grid, cells = _boxes((8, 3), [((0, 0), (4, 3), 2), ((4, 0), (4, 3), 2), ((0, 0), (4, 3), 2)])
    assert grid == (2, 3)
    assert [(k, c.key, c.offset) for k, c in sorted(cells.items())] == [
        ((0, 0), "r0.zip", 0),
        ((1, 0), "r0.zip", 100),
        ((2, 0), "r1.zip", 0),
        ((3, 0), "r1.zip", 100),
    ]
    # an empty box (fewer rows than ranks) holds nothing and breaks nothing
    grid, cells = _boxes((2, 3), [((0, 0), (2, 3), 2), ((2, 0), (0, 3), 1)])
    assert (grid, list(cells)) == ((2, 3), [(0, 0)])
    # an uneven split: the last box is chunked smaller than the grid
    assert "chunked differently" in str(_boxes((5,), [((0,), (3,), 3), ((3,), (2,), 2)]))
    # a box off the grid: rows 0-2 and 3-5 chunked by 2 (the second starts at row 3)
    assert "does not fall on the chunk grid" in str(
        _boxes((6,), [((0,), (3,), 2), ((3,), (3,), 2)])
    )
    # a gap: nobody stored rows 2-3
    assert "cover 1 of the 2 chunks" in str(_boxes((4,), [((0,), (2,), 2)]))
