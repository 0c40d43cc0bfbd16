"""Random damage to a run written by ``dstt.session``: bit flips and truncations in the byte
ranges of step files (chunks) and side files (arrays tables, objects), in the Zarr metadata and
ZIP structure of step files, and in commit headers, refs and HEAD.

For every damage: ``verify`` reports it and names the file; restoring the damaged step
(``dstt.session(..., resume=True)``, ``dstt.store.load``) raises a ``CorruptRunError``
(``ChecksumError`` when a crc32c caught it) naming the file instead of returning wrong bytes;
and the steps the damage did not touch still read back bit-exactly through ``dstt.open``.
Format 2 keeps a whole step in two files, so a truncation destroys everything after its
offset in the file: what a damage hurts is derived from the byte ranges each step reads.
tests/store/test_errors.py covers one fixed damage per file kind on a hand-made run; here the
files, offsets, lengths and their number are random, on a real training run, through the
session and the inspection layers.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dstt
from dstt.errors import ChecksumError, CorruptRunError
from dstt.store import CommitHeader, Repository, StoredStep, load
from dstt.store.format.layout import HEAD_KEY, commit_key, ref_key, step_file_key

from ._helpers import (
    assert_params,
    cli,
    model_and_optimizer,
    params,
    same_bits,
    train,
)

STEPS = 5
#: objects the session reads back on resume (the write-time summaries are not restored)
RESTORED = {"rng", "data", "optim/param_groups", "optim/state"}


@dataclass
class Pristine:
    run: Path
    headers: dict[int, CommitHeader]  # by step
    snaps: dict[int, StoredStep]  # verified content of every step
    params: dict[int, dict[str, np.ndarray]]  # live parameters after every step

    @property
    def head(self) -> int:
        return max(self.headers)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Pristine:
    run = tmp_path_factory.mktemp("corruption") / "run"
    after, _ = train(run, STEPS)
    r = Repository.open(run).reader()
    headers = {h.step: h for h in r.lineage()}
    assert sorted(headers) == list(range(1, STEPS + 1))
    assert Repository.open(run).verify().ok
    return Pristine(run, headers, {s: load(run, step=s) for s in headers}, after)


@pytest.fixture
def damaged(pristine: Pristine, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(pristine.run, run)
    return run


def damage(path: Path, how: str, rng: random.Random) -> bytes:
    """Flip one random bit, or cut the file to a random shorter length; returns the bytes."""
    data = bytearray(path.read_bytes())
    assert data, path
    if how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    else:
        del data[rng.randrange(len(data)) :]
    path.write_bytes(bytes(data))
    return bytes(data)


def named(key: str, problems: list[Any]) -> bool:
    """Whether a verify problem (a ``Problem`` or its CLI JSON) names the file ``key``."""
    pairs = [
        (p["key"], p["message"]) if isinstance(p, dict) else (p.key, p.message) for p in problems
    ]
    return any(k == key or key in m for k, m in pairs)


def snapshot_matches(got: StoredStep, want: StoredStep) -> None:
    assert got.header == want.header
    assert sorted(got.arrays) == sorted(want.arrays)
    for k, a in want.arrays.items():
        assert same_bits(got.arrays[k], a), k
    assert json.dumps(got.objects, default=repr, sort_keys=True) == json.dumps(
        want.objects, default=repr, sort_keys=True
    )


def resume(run: Path) -> dict[str, np.ndarray]:
    """Open the run with ``resume=True`` and return the restored parameters."""
    model, opt = model_and_optimizer(seed=123)  # a different init: restore must overwrite it
    with dstt.session(model, opt, run=run, resume=True) as s:
        assert s.step > 0
        return params(model)


# -- per-step files: chunks, arrays tables, objects, the ZIP tail ------------------------------


def zip_layout(path: Path) -> dict[str, tuple[int, int, int]]:
    """Entries of a stored zip, read with the standard library (independent of dstt's zip
    code): name -> (local header offset, data offset, data size)."""
    out = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            f.seek(info.header_offset)
            local = f.read(30)
            n_name, n_extra = struct.unpack("<HH", local[26:30])
            data = info.header_offset + 30 + n_name + n_extra
            out[info.filename] = (info.header_offset, data, info.file_size)
    return out


@dataclass(frozen=True)
class Read:
    """A byte range restoring a step reads: ``what`` is ``chunk:<array>``, ``arrays`` or
    ``object:<name>``."""

    key: str
    start: int
    stop: int
    what: str


def reads_of(p: Pristine, step: int) -> list[Read]:
    h = p.headers[step]
    assert h.arrays is not None
    out = [Read(h.arrays.key, h.arrays.offset, h.arrays.offset + h.arrays.nbytes, "arrays")]
    out += [
        Read(o.key, o.offset, o.offset + o.nbytes, f"object:{n}")
        for n, o in sorted(h.objects.items())
    ]
    for path, rec in sorted(Repository.open(p.run).reader().arrays(h).items()):
        for c in rec.chunks:
            assert c.encoding == "raw"
            assert c.key == step_file_key(h.slot)  # own files only
            out.append(Read(c.key, c.offset, c.offset + c.nbytes, f"chunk:{path}"))
    return out


@dataclass
class Damage:
    """Bit flips and truncations, per file; a truncation loses everything after it."""

    flips: dict[str, list[tuple[int, int]]]
    cut: dict[str, int]

    def hits(self, r: Read) -> bool:
        return (
            any(r.start <= pos < r.stop for pos, _ in self.flips.get(r.key, []))
            or self.cut.get(r.key, r.stop) < r.stop
        )

    def apply(self, run: Path) -> None:
        for key in set(self.flips) | set(self.cut):
            data = bytearray((run / key).read_bytes())
            for pos, bit in self.flips.get(key, []):
                data[pos] ^= 1 << bit
            if key in self.cut:
                del data[self.cut[key] :]
            (run / key).write_bytes(bytes(data))


def pick_damage(p: Pristine, rng: random.Random, n: int) -> tuple[Damage, list[tuple[str, int]]]:
    """``n`` random damages in the files of random steps; returns them and (kind, step) each."""
    dmg, picks = Damage({}, {}), []
    for _ in range(n):
        step = rng.randint(1, STEPS)
        kind = rng.choices(["chunk", "arrays", "object", "zip tail"], weights=(6, 2, 3, 1))[0]
        reads = [r for r in reads_of(p, step) if r.what.startswith(kind.split()[0])]
        if kind == "zip tail":  # the Zarr documents and the central directory: dstt never
            key = step_file_key(p.headers[step].slot)  # reads them back, plain Zarr does
            size = (p.run / key).stat().st_size
            meta = min(
                off
                for name, (off, _, _) in zip_layout(p.run / key).items()
                if name.endswith("zarr.json")
            )
            assert all(r.stop <= meta for r in reads_of(p, step) if r.key == key)
            lo, hi, how = meta, size, "truncate"  # a flip there: see the tests below
        else:
            r = rng.choice(reads)
            key, lo, hi, how = r.key, r.start, r.stop, rng.choice(["flip", "truncate"])
        pos = rng.randrange(lo, hi)
        if how == "flip":
            dmg.flips.setdefault(key, []).append((pos, rng.randrange(8)))
        else:
            dmg.cut[key] = min(pos, dmg.cut.get(key, pos))
        picks.append((kind, step))
    return dmg, picks


@pytest.mark.parametrize("case", range(12))
def test_random_damage_to_step_files(pristine: Pristine, damaged: Path, case: int) -> None:
    rng = random.Random(f"step-files-{case}")
    dmg, picks = pick_damage(pristine, rng, rng.randint(1, 4))
    dmg.apply(damaged)
    # what each step reads that the damage hit (a truncation also hits what lies after it)
    hit = {s: [r for r in reads_of(pristine, s) if dmg.hits(r)] for s in range(1, STEPS + 1)}
    hurt = {s for s, rs in hit.items() if rs}
    by_step = {s: {r.key for r in rs} for s, rs in hit.items() if rs}
    assert hurt or any(kind == "zip tail" for kind, _ in picks)

    # verify names exactly the damaged files, and nothing else (a chunk cannot be located
    # when its step's arrays table is damaged too: the table is reported instead; a step
    # file that lost its tail cannot be listed, whatever else is damaged)
    reported = set()
    for s in range(1, STEPS + 1):
        table_hit = any(r.what == "arrays" for r in hit[s])
        reported |= {r.key for r in hit[s] if not r.what.startswith("chunk:") or not table_hit}
        if step_file_key(pristine.headers[s].slot) in dmg.cut:
            reported.add(step_file_key(pristine.headers[s].slot))
    rep = Repository.open(damaged).verify()
    assert {p.key for p in rep.problems} == reported, rep.problems
    if case < 2:  # the CLI says the same, with exit status 1
        code, doc, _ = cli("verify", "--run", str(damaged))
        assert code == 1
        assert not doc["ok"]
        assert {p["key"] for p in doc["problems"]} == reported

    # restore: a damaged step is refused with a typed error naming one of its damaged files
    for step in range(1, STEPS + 1):
        if step in hurt:
            with pytest.raises(CorruptRunError) as ei:
                load(damaged, step=step)
            assert any(k in str(ei.value) for k in by_step[step]), str(ei.value)
        else:
            snapshot_matches(load(damaged, step=step), pristine.snaps[step])
    head_keys = {
        r.key
        for r in hit[pristine.head]
        if r.what.removeprefix("object:") in RESTORED or not r.what.startswith("object:")
    }
    if head_keys:
        with pytest.raises(CorruptRunError) as ei:
            resume(damaged)
        assert any(k in str(ei.value) for k in head_keys), str(ei.value)
    else:
        assert_params(resume(damaged), pristine.params[pristine.head])

    # inspection: untouched steps read back bit-exactly; damaged ones raise, never lie
    run = dstt.open(damaged)
    assert run.steps == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        want = pristine.params[step]
        if step not in hurt:
            snap = run.at(step)
            assert_params({n: snap.to_numpy(n) for n in snap.names()}, want)
            continue
        with pytest.raises(CorruptRunError):
            snap = run.at(step)  # reads the arrays table
            for n in snap.names(optim=True):
                snap.to_numpy(n)
            for name in snap.objects:
                snap.object(name)
    # a trajectory over the untouched steps works; across a damaged chunk it raises
    chunk_hits = {
        (s, r.what.removeprefix("chunk:"))
        for s, rs in hit.items()
        for r in rs
        if r.what.startswith("chunk:") and not any(x.what == "arrays" for x in rs)
    }
    for path in sorted({path for _, path in chunk_hits}):
        if not path.startswith("params/"):
            continue
        name = path.removeprefix("params/").replace("/", ".")
        with pytest.raises(CorruptRunError):
            run.trajectory(name).values  # noqa: B018
        fine = [s for s in range(1, STEPS + 1) if s not in hurt]
        if fine:
            traj = run.trajectory(name, steps=fine).values
            for i, s in enumerate(fine):
                assert same_bits(traj[i], pristine.params[s][name])


# -- Zarr metadata and ZIP structure: what plain Zarr readers rely on ---------------------------


def plain_zarr_reads(path: Path, want: dict[str, np.ndarray]) -> bool:
    """Whether zarr-python, reading the step file alone, still gets every committed array
    bit-exactly (it checks each entry's ZIP CRC-32 and the chunks' crc32c)."""
    import zarr
    from zarr.core.dtype import data_type_registry
    from zarr.storage import ZipStore

    data_type_registry._lazy_load()  # zarr 3.1: bfloat16 from dstt's entry point
    try:
        store = ZipStore(path, mode="r")
        zarr.open_group(store, mode="r", zarr_format=3)  # the root document too
        return all(
            same_bits(np.asarray(zarr.open_array(store, path=p, mode="r", zarr_format=3)[...]), a)
            for p, a in want.items()
        )
    except Exception:  # any failure of the plain reader: "not readable"
        return False


def check_plain_damage(pristine: Pristine, damaged: Path, *, exact: bool) -> None:
    """After damage to the head's step file that dstt never reads back: verify reports that
    file (and only it) whenever zarr-python can no longer read the step — ``exact``: and
    reports nothing when it still can; dstt itself reads and resumes regardless."""
    head = pristine.headers[pristine.head]
    key = step_file_key(head.slot)
    harmless = plain_zarr_reads(damaged / key, pristine.snaps[head.step].arrays)
    rep = Repository.open(damaged).verify()
    if harmless and exact:
        assert rep.ok, rep.problems
    elif harmless:  # stricter than zarr-python (other readers use more of the directory)
        assert {p.key for p in rep.problems} <= {key}, rep.problems
    else:
        assert rep.problems, rep.problems
        assert {p.key for p in rep.problems} == {key}, rep.problems
    snapshot_matches(load(damaged), pristine.snaps[pristine.head])  # dstt reads on regardless
    assert_params(resume(damaged), pristine.params[pristine.head])


@pytest.mark.parametrize("case", range(6))
def test_random_damage_to_zarr_metadata(pristine: Pristine, damaged: Path, case: int) -> None:
    """dstt never reads a step file's zarr.json documents back, so damage there cannot hurt a
    restore; but plain Zarr readers need them, so ``verify`` must report it unless it changed
    nothing a reader uses — and then zarr-python must still read the committed values."""
    rng = random.Random(f"zarr-{case}")
    head = pristine.headers[pristine.head]
    key = step_file_key(head.slot)
    assert plain_zarr_reads(pristine.run / key, pristine.snaps[head.step].arrays)
    entries = zip_layout(damaged / key)
    table = Repository.open(damaged).reader().arrays(head)
    doc = rng.choice([*(f"{p}/zarr.json" for p in sorted(table)), "zarr.json"])
    _, start, size = entries[doc]
    pos = rng.randrange(start, start + size)
    if rng.random() < 0.5:
        Damage({key: [(pos, rng.randrange(8))]}, {}).apply(damaged)
    else:  # the documents and the directory lie after every chunk: those stay readable
        Damage({}, {key: pos}).apply(damaged)
    check_plain_damage(pristine, damaged, exact=True)


@pytest.mark.parametrize("case", range(6))
def test_random_damage_to_the_zip_structure(pristine: Pristine, damaged: Path, case: int) -> None:
    """A bit flip in the central directory or in an entry's local header: plain Zarr readers
    go through both (dstt reads by offset), so ``verify`` must report every such damage that
    stops zarr-python from reading the step."""
    rng = random.Random(f"zip-{case}")
    head = pristine.headers[pristine.head]
    key = step_file_key(head.slot)
    entries = zip_layout(damaged / key)
    size = (damaged / key).stat().st_size
    if case % 2:
        lo, hi = max(data + n for _, data, n in entries.values()), size  # central directory
    else:
        lo, hi = entries[rng.choice(sorted(entries))][:2]  # a local header
    Damage({key: [(rng.randrange(lo, hi), rng.randrange(8))]}, {}).apply(damaged)
    check_plain_damage(pristine, damaged, exact=False)


def test_a_directory_name_that_is_not_utf8_is_reported(pristine: Pristine, damaged: Path) -> None:
    """The names are flagged UTF-8: a flip that makes one undecodable is damage like any other
    (a problem naming the step file), not a crash of ``verify``."""
    head = pristine.headers[pristine.head]
    key = step_file_key(head.slot)
    entries = zip_layout(damaged / key)
    data = (damaged / key).read_bytes()
    cd = data.index(b"PK\x01\x02", max(d + n for _, d, n in entries.values()))
    Damage({key: [(cd + 46, 7)]}, {}).apply(damaged)  # first name byte: ASCII -> 0b1xxxxxxx
    with pytest.raises(UnicodeDecodeError):
        (damaged / key).read_bytes()[cd + 46 : cd + 56].decode()
    check_plain_damage(pristine, damaged, exact=False)


# -- timeline documents: commit headers, the ref, HEAD -----------------------------------------


def same_document(bad: bytes, good: bytes) -> bool:
    """Whether damaged JSON still decodes to the same document ('1e-05' -> '1E-05')."""
    try:
        return bool(json.loads(bad) == json.loads(good))
    except ValueError:
        return False


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("which", ["head header", "middle header", "ref", "HEAD"])
def test_random_damage_to_timeline_documents(
    pristine: Pristine, damaged: Path, which: str, how: str
) -> None:
    rng = random.Random(f"{which}-{how}")
    middle = rng.randint(2, STEPS - 1)
    key = {
        "head header": commit_key(pristine.headers[pristine.head].slot),
        "middle header": commit_key(pristine.headers[middle].slot),
        "ref": ref_key("main"),
        "HEAD": HEAD_KEY,
    }[which]
    good = (damaged / key).read_bytes()
    for _ in range(50):  # a flip that decodes to the same document is no damage: draw again
        bad = damage(damaged / key, how, rng)
        if not same_document(bad, good):
            break
        (damaged / key).write_bytes(good)
    else:
        pytest.fail("no damaging flip found")

    rep = Repository.open(damaged).verify()
    assert not rep.ok, rep.problems
    assert named(key, rep.problems), rep.problems
    code, doc, _ = cli("verify", "--run", str(damaged))
    assert code == 1
    assert named(key, doc["problems"])

    run = dstt.open(damaged)
    lost = {"head header": pristine.head, "middle header": middle}.get(which)
    for step in range(1, STEPS + 1):  # one damaged document costs at most its own step
        if step == lost:
            continue
        snap = run.at(step)
        assert_params({n: snap.to_numpy(n) for n in snap.names()}, pristine.params[step])
        snapshot_matches(load(damaged, step=step), pristine.snaps[step])
    if which == "middle header":
        # the head and everything above the damage stay reachable; resume is unaffected
        assert_params(resume(damaged), pristine.params[pristine.head])
        snapshot_matches(load(damaged), pristine.snaps[pristine.head])
        assert rep.commits == STEPS - 1  # every commit but the damaged one checked
    elif which == "head header":  # the head itself: refused, typed, naming the file
        for call in (lambda: load(damaged), lambda: resume(damaged)):
            with pytest.raises(CorruptRunError) as ei:
                call()
            assert key in str(ei.value)
            assert isinstance(ei.value, ValueError)
    else:  # a ref or HEAD: rebuilt in memory from the commit headers, resume too
        assert_params(resume(damaged), pristine.params[pristine.head])
    if lost is not None:
        with pytest.raises(CorruptRunError, match=re.escape(key)):
            run.at(lost)
    code, _, err = cli("ls", "--run", str(damaged))
    assert code == 0, err
    # verify --repair rebuilds what the headers and the index hold; reads stay exact
    code, doc, _ = cli("verify", "--repair", "--run", str(damaged))
    if which in ("ref", "HEAD"):
        assert code == 0, doc
        assert doc["rebuilt"], doc
    elif which == "head header":  # the ref moved to the newest intact commit, said so
        assert any("unreadable and stays" in line for line in doc["rebuilt"]), doc
        assert_params(resume(damaged), pristine.params[pristine.head - 1])  # resumable
    else:  # a middle header the index holds no copy of: still reported, nothing guessed
        assert code == 1
        assert named(key, doc["problems"])
    snap = dstt.open(damaged).at(1)
    assert_params({n: snap.to_numpy(n) for n in snap.names()}, pristine.params[1])


def test_a_flipped_chunk_bit_is_a_checksum_error(pristine: Pristine, damaged: Path) -> None:
    """The type says what happened: a crc32c mismatch is a ``ChecksumError``; a truncation
    (size mismatch) a plain ``CorruptRunError``."""
    h = pristine.headers[pristine.head]
    table = Repository.open(damaged).reader().arrays(h)
    c = table["params/tok/weight"].chunks[0]
    rng = random.Random(1)
    Damage({c.key: [(rng.randrange(c.offset, c.offset + c.nbytes), rng.randrange(8))]}, {}).apply(
        damaged
    )
    with pytest.raises(ChecksumError, match=re.escape(c.key)):
        resume(damaged)
    # the step file cut inside the chunk: a size mismatch, not a checksum one
    (damaged / c.key).write_bytes((pristine.run / c.key).read_bytes()[: c.offset + c.nbytes - 1])
    with pytest.raises(CorruptRunError, match="truncated") as ei:
        resume(damaged)
    assert not isinstance(ei.value, ChecksumError)


def test_a_refused_resume_leaves_the_live_model_untouched(
    pristine: Pristine, damaged: Path
) -> None:
    h = pristine.headers[pristine.head]
    table = Repository.open(damaged).reader().arrays(h)
    # optimizer states are restored after the parameters
    last = sorted(p for p in table if p.startswith("optim/"))[-1]
    c = table[last].chunks[-1]
    Damage({c.key: [(c.offset + c.nbytes // 2, 3)]}, {}).apply(damaged)
    model, opt = model_and_optimizer(seed=123)
    before = params(model)
    with pytest.raises(CorruptRunError), dstt.session(model, opt, run=damaged, resume=True):
        pass
    assert_params(params(model), before)
