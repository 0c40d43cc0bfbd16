"""Bad input and damaged runs: each is a typed error (a DsttError that is also the builtin a
caller would catch) whose message names the file, step or timeline at fault."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dstt.errors import (
    ChecksumError,
    CorruptRunError,
    DsttError,
    FormatVersionError,
    MissingFileError,
    NotARunError,
    ReadOnlyRunError,
    RunLockedError,
    StepNotFoundError,
    StorageError,
    TimelineError,
)
from dstt.store import LocalStorage, Repository, load, save
from dstt.store.commit.transaction import Transaction
from dstt.store.format.envelope import checksum
from dstt.store.format.layout import (
    HEAD_KEY,
    STEPS_PREFIX,
    array_meta_key,
    commit_key,
    ref_key,
    side_file_key,
    step_file_key,
)
from dstt.store.format.manifest import parse_header
from dstt.store.format.records import CommitHeader, Location
from dstt.store.storage.memory import FaultyStorage, MemoryStorage

from ._util import assert_same_arrays, commit_arrays, sample, zip_entry


def two_steps(path: Path | MemoryStorage) -> dict[int, dict[str, np.ndarray]]:
    arrays = {
        s: {
            "params/w": sample("float32", (8, 4), seed=s),
            "params/b": sample("bfloat16", (3,), seed=10 + s),
        }
        for s in (1, 2)
    }
    for s, a in arrays.items():
        save(
            path,
            s,
            a,
            objects={"rng": {"s": s}},
            metrics={"loss": 0.5, "lr": 1e-05},
            chunk_bytes=64,
        )
    return arrays


# -- not a run -------------------------------------------------------------------------------


def test_missing_directory_is_not_a_run(tmp_path: Path) -> None:
    where = tmp_path / "nope"
    for call in (lambda: Repository.open(where), lambda: load(where)):
        with pytest.raises(NotARunError) as ei:
            call()
        assert isinstance(ei.value, FileNotFoundError)
        assert str(where) in str(ei.value)


@pytest.mark.parametrize("content", ["empty", "files", "plain_zarr_group", "bad_json"])
def test_directory_that_is_not_a_run(tmp_path: Path, content: str) -> None:
    d = tmp_path / "d"
    d.mkdir()
    if content == "files":
        (d / "notes.txt").write_text("hello")
    elif content == "plain_zarr_group":
        (d / "zarr.json").write_text('{"zarr_format": 3, "node_type": "group"}')
    elif content == "bad_json":
        (d / "zarr.json").write_text("{not json")
    with pytest.raises(NotARunError) as ei:
        Repository.open(d)
    assert isinstance(ei.value, FileNotFoundError)
    assert str(d) in str(ei.value)
    with pytest.raises(FileNotFoundError):  # catchable without knowing dstt
        load(d)


def test_save_refuses_a_foreign_non_empty_directory(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x")
    with pytest.raises(NotARunError, match="not empty"):
        save(d, 1, {"params/w": np.zeros(2, np.float32)})
    assert sorted(os.listdir(d)) == ["model.safetensors"]  # nothing written into it
    # a stray "step" or "steps" folder (the name format 2 stores steps under) is not
    # mistaken for an interrupted create
    for name in ("step", STEPS_PREFIX):
        e = tmp_path / f"e_{name}"
        (e / name).mkdir(parents=True)
        (e / name / "data.csv").write_text("1,2")
        with pytest.raises(NotARunError):
            Repository.create(e)
        assert sorted(os.listdir(e)) == [name]


# -- damaged manifests -------------------------------------------------------------------------


def _flips(data: bytes, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
    """Every one-bit corruption of ``data[start:stop]`` (the rest left alone)."""
    for i in range(start, len(data) if stop is None else stop):
        for bit in range(8):
            b = bytearray(data)
            b[i] ^= 1 << bit
            yield bytes(b)


def _table(h: CommitHeader | None) -> Location:
    """Where a commit's arrays table lies: a byte range of the step's side file."""
    assert h is not None
    assert h.arrays is not None
    assert h.arrays.key == side_file_key(h.slot)
    return h.arrays


@pytest.mark.parametrize("which", ["header", "arrays", "ref", "HEAD"])
def test_every_single_bit_flip_in_a_manifest_is_caught(which: str) -> None:
    """Exhaustive: each of the 8 x len(document) one-bit corruptions raises CorruptRunError,
    unless it decodes to the very same document (e.g. '1e-05' -> '1E-05'). The arrays table
    is a byte range of the side file: every bit of that range is flipped."""
    st = MemoryStorage()
    two_steps(st)
    r0 = Repository(st).reader()
    head = r0.head()
    assert head is not None
    key = {
        "header": commit_key(head.slot),
        "arrays": side_file_key(head.slot),
        "ref": ref_key("main"),
        "HEAD": HEAD_KEY,
    }[which]
    good = st.data[key]
    start, stop = 0, len(good)
    if which == "arrays":
        loc = _table(head)
        start, stop = loc.offset, loc.offset + loc.nbytes
        assert good[start:stop].startswith(b'{"crc32c":')  # really the table's envelope
        assert stop == len(good)  # the table is the side file's last record
        assert start > 0  # the rng object comes first
    want = (head, r0.arrays(head), r0.timelines, r0.current_timeline)
    caught = benign = 0
    for bad in _flips(good, start, stop):
        st.data[key] = bad
        try:
            r = Repository(st).reader()
            h = r.head()
            got = (h, r.arrays(h), r.timelines, r.current_timeline) if h else None
        except CorruptRunError as e:
            assert key in str(e), str(e)  # names the file
            caught += 1
            continue
        if r.damaged_refs or r.head_problem:  # a ref or HEAD: caught, and the run stays
            assert key in f"{r.damaged_refs} {r.head_problem}"  # readable (the ref rebuilt
            assert got is not None  # from the headers, the current timeline the last written)
            assert (got[0], got[1], set(got[2]), got[3]) == (*want[:2], set(want[2]), want[3])
            caught += 1
            continue
        assert got == want, (which, bad)
        benign += 1
    st.data[key] = good
    assert caught + benign == 8 * (stop - start)
    assert benign <= 2  # only the 'e' -> 'E' exponent of 1e-05 parses to the same header
    if which == "arrays":
        assert benign == 0  # the header's crc32c of the table's byte range catches everything
    assert Repository(st).verify().ok  # restored


def test_flipped_byte_on_disk_is_reported_with_the_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    arrays = two_steps(run)
    h = Repository.open(run).reader().head()
    assert h is not None
    loc = _table(h)
    for key, err in ((side_file_key(h.slot), ChecksumError), (commit_key(h.slot), None)):
        shutil.rmtree(tmp_path / "copy", ignore_errors=True)
        shutil.copytree(run, tmp_path / "copy")
        f = tmp_path / "copy" / key
        data = bytearray(f.read_bytes())
        if key == side_file_key(h.slot):  # a byte in the middle of the arrays table
            data[loc.offset + loc.nbytes // 2] ^= 0x04
        else:
            data[len(data) // 2] ^= 0x04
        f.write_bytes(bytes(data))
        with pytest.raises(CorruptRunError) as ei:
            load(tmp_path / "copy")
        assert isinstance(ei.value, ValueError)
        assert err is None or isinstance(ei.value, err)
        assert str(f) in str(ei.value)
        rep = Repository.open(tmp_path / "copy").verify()
        assert not rep.ok
        assert any(str(f) in p.message or p.key == key for p in rep.problems)
        if key == side_file_key(h.slot):  # the older step is still fine
            assert_same_arrays(load(tmp_path / "copy", step=1).arrays, arrays[1])
            # and the damaged step's objects (same side file, before the table) still read
            assert Repository.open(tmp_path / "copy").reader().read_object(h, "rng") == {"s": 2}


# -- damaged chunks and objects ----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "grown"])
def test_damaged_chunk(tmp_path: Path, damage: str) -> None:
    """Chunk 1 of params/w lives in the step's zip at the offset its record says; damage
    there (or to the whole zip) is reported against the zip, and only that step suffers."""
    run = tmp_path / "run"
    arrays = two_steps(run)
    r = Repository.open(run).reader()
    h = r.head()
    assert h is not None
    rec = r.arrays(h)["params/w"].chunks[1]
    key = rec.key
    assert key == step_file_key(h.slot)
    f = run / key
    data = f.read_bytes()
    assert zip_entry(f, "params/w/c/1/0") == (rec.offset, rec.nbytes)
    if damage == "missing":  # the whole step file
        f.unlink()
    elif damage == "truncated":  # the zip cut off in the middle of the chunk
        f.write_bytes(data[: rec.offset + rec.nbytes - 7])
    elif damage == "flipped":
        b = bytearray(data)
        b[rec.offset + 3] ^= 0x80
        f.write_bytes(bytes(b))
    else:  # one byte more inside the chunk: everything after it moves
        f.write_bytes(data[: rec.offset + 3] + b"\x00" + data[rec.offset + 3 :])
    with pytest.raises(CorruptRunError) as ei:
        load(run)
    assert isinstance(ei.value, ValueError)
    assert str(f) in str(ei.value)
    if damage == "flipped":
        assert isinstance(ei.value, ChecksumError)
    if damage == "missing":
        assert "missing" in str(ei.value)
    with pytest.raises(CorruptRunError):  # the chunk itself, not only the step, is bad
        r.read_chunk(h, "params/w", 1)
    if damage != "missing":  # chunk 0 precedes the damage and still reads
        assert bytes(r.read_chunk(h, "params/w", 0)) == arrays[2]["params/w"][:4].tobytes()
    rep = Repository.open(run).verify()
    assert rep.problems
    assert {p.key for p in rep.problems} == {key}
    msgs = [p.message for p in rep.problems]
    if damage == "flipped":  # the chunk's crc32c and the zip entry's CRC-32 both fail
        assert len(msgs) == 2, msgs
        assert any("crc32c" in m for m in msgs), msgs
        assert any("CRC-32" in m for m in msgs), msgs
    else:  # the zip itself cannot be listed any more
        assert any("cannot be listed" in m for m in msgs), msgs
    assert rep.chunks > 1  # it went on checking the rest
    assert_same_arrays(load(run, step=1).arrays, arrays[1])  # other steps unaffected


def test_damaged_object_and_array_document_are_reported(tmp_path: Path) -> None:
    """An object is a byte range of the side file; an array's zarr.json is an entry of the
    step zip (what a plain Zarr reader decodes the chunks with): verify checks both."""
    run = tmp_path / "run"
    two_steps(run)
    h = Repository.open(run).reader().head()
    assert h is not None
    o = h.objects["rng"]
    assert o.key == side_file_key(h.slot)
    side = run / o.key
    data = bytearray(side.read_bytes())
    assert bytes(data[o.offset : o.offset + o.nbytes]) == b'{"s":2}'
    data[o.offset : o.offset + o.nbytes] = b'{"s":3}'  # same size, other value
    side.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="rng") as ei:
        load(run)
    assert str(side) in str(ei.value)
    # the params/w zarr.json in the zip now declares another dtype, of the same length
    zkey = step_file_key(h.slot)
    z = run / zkey
    off, size = zip_entry(z, array_meta_key("params/w"))
    raw = bytearray(z.read_bytes())
    doc = bytes(raw[off : off + size])
    assert doc.count(b'"float32"') == 1
    raw[off : off + size] = doc.replace(b'"float32"', b'"float64"')
    z.write_bytes(bytes(raw))
    rep = Repository.open(run).verify()
    assert {p.key for p in rep.problems} == {o.key, zkey}
    assert any(p.key == zkey and "data_type" in p.message for p in rep.problems), rep.problems
    assert any(p.key == o.key and "rng" in p.message for p in rep.problems), rep.problems
    assert rep.chunks > 0  # the chunks themselves are fine and were all checked


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_missing_arrays_table(tmp_path: Path, damage: str) -> None:
    """The arrays table is the last record of the side file: without the side file, or with
    the file cut short inside the table, the step cannot be located and says so."""
    run = tmp_path / "run"
    arrays = two_steps(run)
    h = Repository.open(run).reader().head()
    assert h is not None
    loc = _table(h)
    side = run / loc.key
    if damage == "missing":
        side.unlink()
    else:
        side.write_bytes(side.read_bytes()[: loc.offset + loc.nbytes // 2])
    with pytest.raises(
        CorruptRunError, match="missing" if damage == "missing" else "arrays table"
    ) as ei:
        load(run)
    assert loc.key in str(ei.value)
    rep = Repository.open(run).verify()
    assert {p.key for p in rep.problems} == {loc.key}
    assert any("arrays table" in p.message or "missing" in p.message for p in rep.problems)
    if damage == "truncated":  # the object before the table is still whole
        assert len(rep.problems) == 1
        assert rep.objects == 2  # rng of steps 1 and 2
        assert Repository.open(run).reader().read_object(h, "rng") == {"s": 2}
    assert_same_arrays(load(run, step=1).arrays, arrays[1])


def test_missing_file_error_is_both_storage_and_file_not_found(tmp_path: Path) -> None:
    run = tmp_path / "run"
    two_steps(run)
    with pytest.raises(MissingFileError) as ei:
        LocalStorage(run).read("params/nothing/here")
    assert isinstance(ei.value, FileNotFoundError)
    assert isinstance(ei.value, StorageError)
    assert "params/nothing/here" in str(ei.value)


# -- versions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [1, 3])
def test_unknown_format_version_of_the_run(tmp_path: Path, fmt: int) -> None:
    """Format 3 is a newer dstt's; format 1 (a file per chunk per step) is no longer read."""
    run = tmp_path / "run"
    two_steps(run)
    doc = json.loads((run / "zarr.json").read_text())
    assert doc["attributes"]["dstt"]["format"] == 2
    doc["attributes"]["dstt"]["format"] = fmt
    (run / "zarr.json").write_text(json.dumps(doc))
    for call in (lambda: Repository.open(run), lambda: load(run), lambda: save(run, 3, {})):
        with pytest.raises(FormatVersionError, match=f"format {fmt}") as ei:
            call()
        assert str(run) in str(ei.value)
        assert ("dstt<0.2" if fmt == 1 else "Upgrade dstt") in str(ei.value)
    assert not (run / commit_key(2)).exists()  # nothing written into it


def test_unknown_format_version_of_a_commit() -> None:
    st = MemoryStorage()
    two_steps(st)
    h = Repository(st).reader().head()
    assert h is not None
    key = commit_key(h.slot)
    body = json.loads(st.data[key])["body"]
    assert body["format"] == 2
    body["format"] = 3  # what a newer dstt would write, with a valid checksum
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    st.data[key] = b'{"crc32c":%d,"body":' % checksum(raw) + raw + b"}\n"
    with pytest.raises(FormatVersionError, match="Upgrade dstt") as ei:
        Repository(st).reader().head()
    assert key in str(ei.value)
    assert isinstance(ei.value, CorruptRunError)
    with pytest.raises(FormatVersionError):
        parse_header(st.data[key], key)


# -- steps and timelines --------------------------------------------------------------------------


def test_step_that_does_not_exist(tmp_path: Path) -> None:
    run = tmp_path / "run"
    two_steps(run)
    with pytest.raises(StepNotFoundError) as ei:
        load(run, step=7)
    assert isinstance(ei.value, KeyError)
    msg = str(ei.value)
    assert "7" in msg
    assert str(run) in msg
    assert "1, 2" in msg  # what exists instead
    r = Repository.open(run).reader()
    h = r.head()
    assert h is not None
    with pytest.raises(StepNotFoundError, match="params/nope"):
        r.read_array(h, "params/nope")
    with pytest.raises(StepNotFoundError, match="nope"):
        r.read_object(h, "nope")


def test_empty_run_has_no_step(tmp_path: Path) -> None:
    Repository.create(tmp_path / "run")
    with pytest.raises(StepNotFoundError, match="no committed step"):
        load(tmp_path / "run")


def test_pruned_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    arrays = two_steps(run)
    report = Repository.open(run).gc(keep_last=1)
    assert report.pruned_steps == (("main", 1),)
    assert report.files_removed > 0
    with pytest.raises(StepNotFoundError, match="pruned") as ei:
        load(run, step=1)
    assert isinstance(ei.value, KeyError)
    assert "2" in str(ei.value)
    assert_same_arrays(load(run, step=2).arrays, arrays[2])
    with pytest.raises(StepNotFoundError, match="pruned"):  # cannot branch off it either
        Repository.open(run).rollback(1)


def test_reader_holding_a_step_that_gc_prunes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    two_steps(run)
    r = Repository.open(run).reader()
    old = r.find(1)
    Repository.open(run).gc(keep_last=1)
    with pytest.raises(StepNotFoundError, match="pruned"):
        r.read_array(old, "params/w")


def test_unknown_or_bad_timeline(tmp_path: Path) -> None:
    run = tmp_path / "run"
    two_steps(run)
    repo = Repository.open(run)
    for call in (
        lambda: load(run, timeline="nope"),
        lambda: repo.reader().head("nope"),
        lambda: repo.switch("nope"),
        lambda: repo.rollback(1, timeline="nope"),
    ):
        with pytest.raises(TimelineError, match="nope") as ei:
            call()
        assert isinstance(ei.value, ValueError)
        assert "main" in str(ei.value)  # lists the real ones
    with repo.writer() as w, pytest.raises(TimelineError, match="nope"):
        w.begin(3, timeline="nope")
    with pytest.raises(TimelineError, match="already exists"):
        repo.rollback(1, name="main")
    for bad in ("", "a/b", "../x", "-x", "x" * 65):
        with pytest.raises(TimelineError, match="invalid timeline name"):
            repo.rollback(1, name=bad)
    assert set(repo.reader().timelines) == {"main"}


def test_bad_gc_policy() -> None:
    st = MemoryStorage()
    two_steps(st)
    for kw in ({"keep_last": -1}, {"keep_every": -2}, {"keep_every": 0}):
        with pytest.raises(ValueError, match="keep_"):
            Repository(st).gc(**kw)  # type: ignore[arg-type]
    assert [h.pruned for h in Repository(st).reader().lineage()] == [False, False]


# -- locking -------------------------------------------------------------------------------------


def test_second_writer_in_the_same_process(tmp_path: Path) -> None:
    run = tmp_path / "run"
    two_steps(run)
    repo = Repository.open(run)
    with repo.writer():
        with pytest.raises(RunLockedError) as ei:
            repo.writer()
        assert isinstance(ei.value, BlockingIOError)
        assert str(run) in str(ei.value)
        assert f"pid={os.getpid()}" in str(ei.value)
        with pytest.raises(RunLockedError):
            Repository.open(run).gc()
        with pytest.raises(RunLockedError):
            repo.rollback(1)
        assert load(run).header.step == 2  # readers are never blocked
    with repo.writer():  # released on close
        pass


HOLDER = """
    import sys
    from dstt.store import Repository
    w = Repository.open(sys.argv[1]).writer()
    print("locked", flush=True)
    sys.stdin.read()
"""


@pytest.mark.parametrize("release", ["exit", "sigkill"])
def test_second_writer_from_another_process(tmp_path: Path, release: str) -> None:
    run = tmp_path / "run"
    two_steps(run)
    with subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(HOLDER), str(run)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        _hold_and_release(proc, run, release)
    # the kernel drops the lock with the process, however it ended
    commit_arrays(Repository.open(run), 3, {"params/w": np.zeros((8, 4), np.float32)})
    assert load(run).header.step == 3


def _hold_and_release(proc: subprocess.Popen[str], run: Path, release: str) -> None:
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError) as ei:
            Repository.open(run).writer()
        assert f"pid={proc.pid}" in str(ei.value)
        with pytest.raises(RunLockedError):
            save(run, 3, {"params/w": np.zeros((8, 4), np.float32)})
        assert load(run).header.step == 2
    finally:
        if release == "exit":
            proc.communicate("", timeout=30)
        else:
            proc.kill()
            proc.wait(timeout=30)


# -- read-only and failing storage ----------------------------------------------------------------


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[str]:
    """Make ``path`` unwritable. As root, mode bits do not stop writes, so the ext4 immutable
    attribute is used (it stops root too); yields the mechanism used."""
    if os.geteuid() != 0:
        dirs = [path, *(p for p in path.rglob("*") if p.is_dir())]
        for d in dirs:
            d.chmod(0o555)
        try:
            yield "chmod"
        finally:
            for d in dirs:
                d.chmod(0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: cannot make a directory read-only")
    res = subprocess.run(["chattr", "-R", "+i", str(path)], capture_output=True, text=True)
    if res.returncode != 0:  # e.g. no CAP_LINUX_IMMUTABLE in a container
        subprocess.run(["chattr", "-R", "-i", str(path)], capture_output=True)
        pytest.skip(f"chattr +i not supported here: {res.stderr.strip()}")
    try:
        yield "chattr +i"
    finally:
        subprocess.run(["chattr", "-R", "-i", str(path)], check=True)


def test_read_only_run_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    arrays = two_steps(run)
    with read_only(run):
        with pytest.raises(ReadOnlyRunError) as ei:
            Repository.open(run).writer()
        assert isinstance(ei.value, PermissionError)
        assert str(run) in str(ei.value)
        with pytest.raises(ReadOnlyRunError):
            save(run, 3, arrays[2])
        with pytest.raises(ReadOnlyRunError):  # below check_writable: a plain write too
            LocalStorage(run).write(f"{STEPS_PREFIX}/{9:012d}.zip", b"PK")
        with pytest.raises(ReadOnlyRunError):  # and a step file written in pieces
            LocalStorage(run).open_blob(step_file_key(9))
        # reading a read-only run works
        assert_same_arrays(load(run, step=1).arrays, arrays[1])
        assert Repository.open(run).verify().ok
    commit_arrays(Repository.open(run), 3, arrays[2])  # writable again afterwards


def test_cannot_create_a_run_inside_a_read_only_directory(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    with read_only(parent), pytest.raises(ReadOnlyRunError) as ei:
        Repository.create(parent / "run")
    assert str(parent / "run") in str(ei.value)


def _write_step(txn: Transaction, arrays: dict[str, np.ndarray]) -> None:
    for p, a in arrays.items():
        plan = txn.declare(p, "float32" if a.dtype == np.float32 else "bfloat16", a.shape)
        flat = a.reshape(-1).view(np.uint8)
        for i in range(plan.n_chunks):
            txn.put_chunk(p, i, flat[slice(*plan.byte_range(i))])


def test_disk_full_at_every_write_of_a_commit(tmp_path: Path) -> None:
    """The disk fills up after n writes, for n = 0, 1, ... until a whole commit fits."""
    run = tmp_path / "run"
    arrays = two_steps(run)
    for n in itertools.count():
        st = FaultyStorage(LocalStorage(run), fail_after_writes=n)
        new = {
            "params/w": sample("float32", (8, 4), seed=300 + n),
            "params/b": sample("bfloat16", (3,), seed=301 + n),
        }
        with Repository(st).writer(chunk_bytes=64) as w:
            txn = w.begin(3 + n)
            try:
                _write_step(txn, new)
                txn.commit()
            except StorageError as e:
                assert isinstance(e, OSError)
                assert e.errno == errno.ENOSPC
                assert str(run) in str(e)
                txn.abort()
            else:
                break  # n writes are enough for a whole commit
            # the previous commit is intact and still the head
            assert load(run).header.step == 2 + n
            assert Repository.open(run).verify().ok
            st.heal()  # space freed: the same writer commits the step
            txn = w.begin(3 + n)
            _write_step(txn, new)
            txn.commit()
        assert_same_arrays(load(run).arrays, new)
        assert st.failures == 1
    assert n == 4  # one write per file: step zip, side file (the table), header, ref
    assert Repository.open(run).verify().ok
    assert_same_arrays(load(run, step=1).arrays, arrays[1])


def test_failing_reads_are_storage_errors(tmp_path: Path) -> None:
    run = tmp_path / "run"
    two_steps(run)
    # the chunks of every step live in the step zips (read by byte range)
    st = FaultyStorage(LocalStorage(run), fail_reads=rf"^{STEPS_PREFIX}/\d+\.zip$")
    with pytest.raises(StorageError, match="I/O error"):
        load(st)
    rep = Repository(st).verify()
    assert rep.problems
    assert all(p.key.endswith(".zip") for p in rep.problems)
    assert {p.key for p in rep.problems} == {step_file_key(0), step_file_key(1)}


def test_errors_are_dstt_errors() -> None:
    for cls in (
        NotARunError,
        CorruptRunError,
        ChecksumError,
        FormatVersionError,
        StepNotFoundError,
        TimelineError,
        RunLockedError,
        ReadOnlyRunError,
        StorageError,
        MissingFileError,
    ):
        assert issubclass(cls, DsttError)


def test_failed_commit_then_gc_then_commit_with_the_same_storage(tmp_path: Path) -> None:
    """A commit that fails after its header leaves an orphan newer than every ref's head: gc
    keeps it (a lost ref update looks the same), the next writer goes above it, and then gc
    removes it (folders too) — through the very same storage object."""
    run = tmp_path / "run"
    arrays = two_steps(run)
    st = FaultyStorage(LocalStorage(run), fail_keys=r"_dstt/refs/")
    repo = Repository(st)
    new = {"params/w": sample("float32", (8, 4), seed=3), "params/b": sample("bfloat16", (3,), 4)}
    with repo.writer(chunk_bytes=64) as w:
        txn = w.begin(3)
        _write_step(txn, new)
        txn.put_object("rng", {"s": 3})
        with pytest.raises(StorageError, match="refs"):
            txn.commit()
        orphan = txn.slot
    assert load(run).header.step == 2
    st.heal()
    report = repo.gc()
    assert report.orphan_slots == ()
    assert report.pruned_steps == ()
    assert (run / "_dstt" / "commits" / f"{orphan:012d}.json").exists()
    with repo.writer(chunk_bytes=64) as w:
        txn = w.begin(3)
        _write_step(txn, new)
        txn.put_object("rng", {"s": 3})
        h = txn.commit()
    assert h.slot == orphan + 1  # above the orphan, never over its files
    report = repo.gc()
    assert report.orphan_slots == (orphan,)
    assert not (run / "_dstt" / "commits" / f"{orphan:012d}.json").exists()
    snap = load(run)
    assert_same_arrays(snap.arrays, new)
    assert snap.objects == {"rng": {"s": 3}}
    assert_same_arrays(load(run, step=2).arrays, arrays[2])
    assert Repository.open(run).verify().ok


def test_a_run_path_that_is_a_file_or_missing_says_so_plainly(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("x")
    for create in (True, False):
        with pytest.raises(NotARunError) as e:
            LocalStorage(f, create=create)
        assert "is a file, not a run" in str(e.value)
        assert "Errno" not in str(e.value)
    with pytest.raises(NotARunError) as e:
        LocalStorage(f / "run", create=True)  # a parent is a file
    assert "parent of it is a file" in str(e.value)
    with pytest.raises(NotARunError) as e:
        LocalStorage(tmp_path / "missing")
    assert str(e.value).startswith("no run directory at ")
    assert "Errno" not in str(e.value)
