"""A timeline as one virtual Zarr store, read by plain xarray through fsspec's reference
file system in a process that imports neither dstt nor torch, bit for bit against
``dstt.open(run).trajectory``."""

from __future__ import annotations

import json
from pathlib import Path

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
