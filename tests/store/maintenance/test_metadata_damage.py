"""One damaged metadata file loses nothing committed (issue 36): a lost ref, HEAD, header or
root ``zarr.json`` is reported by ``verify``, leaves the other steps readable, stops gc from
deleting what it can no longer prove abandoned, and ``verify --repair`` rebuilds it from the
commit headers (and the index's copy of each)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from dstt.cli import main
from dstt.errors import CorruptRunError
from dstt.store import Repository
from dstt.store.format.layout import HEAD_KEY, commit_key, ref_key, step_file_key

from .._util import commit_arrays, same_bits

STEPS = (1, 2, 3, 4, 5)


def _value(step: int) -> np.ndarray:
    return np.arange(32, dtype=np.float32).reshape(8, 4) + 100 * step


def _run(path: Path) -> Repository:
    repo = Repository.create(path)
    for s in STEPS:
        commit_arrays(repo, s, {"params/w": _value(s)}, objects={"rng": {"s": s}})
    return repo


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _data_files(root: Path) -> dict[str, bytes]:
    """The step files and commit headers: what must never go."""
    return {k: v for k, v in _files(root).items() if k.startswith(("steps/", "_dstt/commits/"))}


def _readable(repo: Repository, steps: tuple[int, ...], timeline: str | None = None) -> None:
    r = repo.reader()
    for s in steps:
        h = r.find(s, timeline)
        assert same_bits(r.read_array(h, "params/w"), _value(s)), s
        assert r.read_object(h, "rng") == {"s": s}


def _keys(repo: Repository) -> set[str]:
    rep = repo.verify()
    return {p.key for p in rep.problems}


def test_lost_ref_hides_nothing_and_gc_deletes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rm _dstt/refs/main.json`` once made verify say 'ok: 0 commits', every read raise and
    ``gc --keep-last 1`` delete all 5 steps as orphans."""
    run = tmp_path / "run"
    repo = _run(run)
    (run / ref_key("main")).unlink()
    data = _data_files(run)
    _readable(repo, STEPS)  # the ref rebuilt in memory from the headers
    assert repo.reader().recovered["main"].head == repo.reader().find(5).slot
    assert {ref_key("main"), HEAD_KEY} <= _keys(repo)
    assert main(["verify", str(run)]) == 1
    assert "main.json" in capsys.readouterr().out
    with pytest.raises(CorruptRunError, match="verify --repair"):
        repo.gc(keep_last=1)
    assert _data_files(run) == data  # gc deleted nothing
    assert main(["verify", "--repair", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"REPAIRED {ref_key('main')}" in out
    assert "ok:" in out
    assert (run / ref_key("main")).exists()
    _readable(repo, STEPS)
    assert [s for _, s in repo.gc(keep_last=1).pruned_steps] == [1, 2, 3, 4]  # gc works again


def test_lost_ref_of_another_timeline_is_reported_and_kept(tmp_path: Path) -> None:
    """A non-current timeline's ref gone: nothing reads it, so only verify notices; gc keeps
    its commits (a timeline without a ref is not proven abandoned); repair brings it back."""
    run = tmp_path / "run"
    repo = _run(run)
    tl = repo.rollback(3)
    commit_arrays(repo, 4, {"params/w": _value(40)}, objects={"rng": {"s": 40}})
    repo.switch("main")
    want = repo.reader().ref(tl.name)
    (run / ref_key(tl.name)).unlink()
    data = _data_files(run)
    assert set(repo.reader().timelines) == {"main"}
    rep = repo.verify()
    assert not rep.ok
    assert ref_key(tl.name) in {p.key for p in rep.problems}
    gc = repo.gc()
    assert gc.orphan_slots == ()
    assert _data_files(run) == data
    fixed = repo.verify(repair=True)
    assert fixed.ok, fixed.problems
    assert any(ref_key(tl.name) in line for line in fixed.repaired)
    got = repo.reader().ref(tl.name)
    assert (got.head, got.base_slot, got.base_step, got.base_timeline) == (
        want.head,
        want.base_slot,
        want.base_step,
        want.base_timeline,
    )
    assert same_bits(repo.reader().read_array(repo.reader().head(tl.name), "params/w"), _value(40))


def test_damaged_head_header_costs_that_step_only(tmp_path: Path) -> None:
    run = tmp_path / "run"
    repo = _run(run)
    repo.reindex()  # the index holds a copy of every header
    head = repo.reader().find(5)
    key = run / commit_key(head.slot)
    good = key.read_bytes()
    key.write_bytes(good[:40])
    r = Repository(repo.storage).reader()
    r.index.enabled = False  # the header files alone: the walk steps over the damaged one
    assert [h.step for h in r.lineage()] == [1, 2, 3, 4]
    assert commit_key(head.slot) in _keys(repo)
    data = _data_files(run)
    assert Repository(repo.storage).gc().orphan_slots == ()  # the index's copy reaches it
    assert _data_files(run) == data
    rep = repo.verify(repair=True)
    assert rep.ok, rep.problems
    assert any("restored from the index" in line for line in rep.repaired)
    assert key.read_bytes() == good
    _readable(repo, STEPS)


def test_damaged_unindexed_head_header_keeps_its_files(tmp_path: Path) -> None:
    """No copy anywhere: repair moves the ref to the newest intact commit, says so, and the
    damaged step's files stay (gc cannot prove it abandoned); the next commit goes above it."""
    run = tmp_path / "run"
    repo = _run(run)
    for seg in (run / "_dstt" / "index").glob("*"):
        seg.unlink()
    head = repo.reader().find(5)
    (run / commit_key(head.slot)).write_bytes(b"{")
    _readable(repo, (1, 2, 3, 4))
    with pytest.raises(CorruptRunError, match="damaged"):
        repo.reader().find(5)
    rep = repo.verify(repair=True)
    assert any("unreadable and stays" in line for line in rep.repaired)
    assert commit_key(head.slot) in {p.key for p in rep.problems}  # still reported
    assert repo.reader().head() == repo.reader().find(4)
    repo.gc(keep_last=1)
    assert (run / step_file_key(head.slot)).exists()
    assert (run / commit_key(head.slot)).exists()
    h = commit_arrays(repo, 5, {"params/w": _value(5)}, objects={"rng": {"s": 5}})
    assert h.slot > head.slot


@pytest.mark.parametrize("damage", ["delete", "garbage"])
def test_damaged_head_file(tmp_path: Path, damage: str) -> None:
    run = tmp_path / "run"
    repo = _run(run)
    if damage == "delete":
        (run / HEAD_KEY).unlink()
    else:
        (run / HEAD_KEY).write_bytes(b'{"crc32c":1,"body":{}}')
    r = repo.reader()
    assert r.current_timeline == "main"
    assert r.head_problem
    _readable(repo, STEPS)
    assert HEAD_KEY in _keys(repo)
    rep = repo.verify(repair=True)
    assert rep.ok, rep.problems
    assert repo.reader().head_problem is None


@pytest.mark.parametrize("damage", ["node_type", "garbage"])
def test_damaged_root_zarr_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    run = tmp_path / "run"
    _run(run)
    root = run / "zarr.json"
    if damage == "node_type":
        doc = json.loads(root.read_bytes())
        doc["node_type"] = "array"
        root.write_text(json.dumps(doc))
    else:
        root.write_bytes(b"\x00garbage")
    assert main(["verify", str(run)]) == 1  # a problem (exit 1), not an unreadable run
    assert "PROBLEM zarr.json" in capsys.readouterr().out
    assert main(["verify", "--repair", str(run)]) == 0
    assert "REPAIRED zarr.json" in capsys.readouterr().out
    assert json.loads(root.read_bytes())["node_type"] == "group"
    _readable(Repository.open(run), STEPS)


def test_foreign_zip_entry_is_reported(tmp_path: Path) -> None:
    run = tmp_path / "run"
    repo = _run(run)
    key = step_file_key(repo.reader().find(3).slot)
    with zipfile.ZipFile(run / key, "a") as z:
        z.writestr("notes.txt", "appended")
    rep = repo.verify()
    assert any(p.key == key and "foreign" in p.message for p in rep.problems), rep.problems
    _readable(repo, STEPS)


def test_gc_deletes_nothing_past_a_damaged_header(tmp_path: Path) -> None:
    """A middle header with no copy anywhere: the walk steps over it, so what is reachable is
    no longer proven; gc refuses (typed, naming the file) and deletes nothing."""
    run = tmp_path / "run"
    repo = _run(run)
    for seg in (run / "_dstt" / "index").glob("*"):
        seg.unlink()
    middle = repo.reader().find(3)
    (run / commit_key(middle.slot)).write_bytes(b"")
    _readable(repo, (1, 2, 4, 5))
    data = _data_files(run)
    with pytest.raises(CorruptRunError, match=commit_key(middle.slot)):
        repo.gc(keep_last=1)
    assert _data_files(run) == data
