"""Random damage to a run written by ``dstt.session``: bit flips and truncations in chunk
files, arrays tables, objects, the step coordinate, commit headers, refs and HEAD.

For every damage: ``verify`` reports it and names the file; restoring the damaged step
(``dstt.session(..., resume=True)``, ``dstt.store.load``) raises a ``CorruptRunError``
(``ChecksumError`` when a crc32c caught it) naming the file instead of returning wrong bytes;
and the steps the damage did not touch still read back bit-exactly through ``dstt.open``.
tests/store/test_errors.py covers one fixed damage per file kind on a hand-made run; here the
files, offsets, lengths and their number are random, on a real training run, through the
session and the inspection layers.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dstt
from dstt.errors import ChecksumError, CorruptRunError
from dstt.store import CommitHeader, Repository, Snapshot, load
from dstt.store.layout import HEAD_KEY, chunk_key, commit_arrays_key, commit_key, ref_key

from ._helpers import assert_params, cli, model_and_optimizer, params, same_bits, train

STEPS = 5
#: objects the session reads back on resume (the write-time summaries are not restored)
RESTORED = {"rng", "data", "optim/param_groups", "optim/state"}


@dataclass
class Pristine:
    run: Path
    headers: dict[int, CommitHeader]  # by step
    snaps: dict[int, Snapshot]  # verified content of every step
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
def damaged(pristine: Pristine, tmp_path: Path) -> Iterator[Path]:
    run = tmp_path / "run"
    shutil.copytree(pristine.run, run)
    yield run


def damage(path: Path, how: str, rng: random.Random) -> bytes:
    """Flip one random bit, or cut the file to a random shorter length; returns the bytes."""
    data = bytearray(path.read_bytes())
    assert data, path
    if how == "flip":
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    else:
        del data[rng.randrange(len(data)):]
    path.write_bytes(bytes(data))
    return bytes(data)


def named(key: str, problems: list[Any]) -> bool:
    """Whether a verify problem (a ``Problem`` or its CLI JSON) names the file ``key``."""
    pairs = [(p["key"], p["message"]) if isinstance(p, dict) else (p.key, p.message)
             for p in problems]
    return any(k == key or key in m for k, m in pairs)


def snapshot_matches(got: Snapshot, want: Snapshot) -> None:
    assert got.header == want.header
    assert sorted(got.arrays) == sorted(want.arrays)
    for k, a in want.arrays.items():
        assert same_bits(got.arrays[k], a), k
    assert json.dumps(got.objects, default=repr, sort_keys=True) == json.dumps(
        want.objects, default=repr, sort_keys=True)


def resume(run: Path) -> dict[str, np.ndarray]:
    """Open the run with ``resume=True`` and return the restored parameters."""
    model, opt = model_and_optimizer(seed=123)  # a different init: restore must overwrite it
    with dstt.session(model, opt, run=run, resume=True) as s:
        assert s.step > 0
        return params(model)


# -- per-step files: chunks, arrays tables, objects, the step coordinate -----------------------

def pick_step_file(p: Pristine, rng: random.Random) -> tuple[str, int, str]:
    """A random file belonging to one step: (kind, step, key)."""
    step = rng.randint(1, STEPS)
    h = p.headers[step]
    kind = rng.choices(["chunk", "arrays", "object", "step"], weights=(6, 2, 3, 1))[0]
    if kind == "chunk":
        table = Repository.open(p.run).reader().arrays(h)
        rec = table[rng.choice(sorted(table))]
        return kind, step, rng.choice(rec.chunks).key
    if kind == "arrays":
        return kind, step, commit_arrays_key(h.slot)
    if kind == "object":
        name = rng.choice(sorted(h.objects))
        return f"object:{name}", step, h.objects[name].key
    return kind, step, chunk_key("step", h.slot, ())


@pytest.mark.parametrize("case", range(12))
def test_random_damage_to_step_files(pristine: Pristine, damaged: Path, case: int) -> None:
    rng = random.Random(f"step-files-{case}")
    picks: dict[str, tuple[str, int]] = {}
    for _ in range(rng.randint(1, 4)):
        kind, step, key = pick_step_file(pristine, rng)
        picks[key] = (kind, step)
    for key in picks:
        damage(damaged / key, rng.choice(["flip", "truncate"]), rng)
    # files whose damage makes the step unreadable (the step coordinate is for plain Zarr
    # readers only; dstt never reads it back)
    hurt = {step for kind, step in picks.values() if kind != "step"}
    by_step: dict[int, set[str]] = {}
    for key, (kind, step) in picks.items():
        if kind != "step":
            by_step.setdefault(step, set()).add(key)

    # verify names exactly the damaged files, and nothing else (a chunk cannot be located
    # when its step's arrays table is damaged too: the table is reported instead)
    no_table = {step for kind, step in picks.values() if kind == "arrays"}
    reported = {k for k, (kind, step) in picks.items()
                if kind != "chunk" or step not in no_table}
    rep = Repository.open(damaged).verify()
    assert {p.key for p in rep.problems} == reported, rep.problems
    if case < 2:  # the CLI says the same, with exit status 1
        code, doc, _ = cli("verify", "--run", str(damaged))
        assert code == 1 and not doc["ok"]
        assert {p["key"] for p in doc["problems"]} == reported

    # restore: a damaged step is refused with a typed error naming one of its damaged files
    for step in range(1, STEPS + 1):
        if step in hurt:
            with pytest.raises(CorruptRunError) as ei:
                load(damaged, step=step)
            assert any(k in str(ei.value) for k in by_step[step]), str(ei.value)
        else:
            snapshot_matches(load(damaged, step=step), pristine.snaps[step])
    head_keys = {k for k, (kind, step) in picks.items() if step == pristine.head and (
        kind in ("chunk", "arrays") or kind.removeprefix("object:") in RESTORED)}
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
    chunk_hits = {(step, key.rsplit("/", 1)[0]) for key, (kind, step) in picks.items()
                  if kind == "chunk"}
    for step, path in sorted(chunk_hits):
        name = path.removeprefix("params/").replace("/", ".")
        if not path.startswith("params/") or step not in pristine.headers:
            continue
        if any(s == step and k == "arrays" for _, (k, s) in picks.items()):
            continue
        with pytest.raises(CorruptRunError):
            run.trajectory(name).values  # noqa: B018
        fine = [s for s in range(1, STEPS + 1) if s not in hurt]
        if fine:
            traj = run.trajectory(name, steps=fine).values
            for i, s in enumerate(fine):
                assert same_bits(traj[i], pristine.params[s][name])


# -- Zarr metadata: what plain Zarr readers (and a resumed writer) rely on -----------------------

READ_FIELDS = ("zarr_format", "node_type", "data_type", "chunk_grid", "chunk_key_encoding",
               "fill_value", "codecs", "dimension_names", "shape")


@pytest.mark.parametrize("case", range(6))
def test_random_damage_to_zarr_metadata(pristine: Pristine, damaged: Path, case: int) -> None:
    """dstt never reads an array's zarr.json back, so damage there cannot hurt a restore; but
    plain Zarr readers need it, so ``verify`` must report it unless it changed nothing a reader
    uses — and then zarr-python must still read the committed values."""
    import zarr

    rng = random.Random(f"zarr-{case}")
    head = pristine.headers[pristine.head]
    table = Repository.open(damaged).reader().arrays(head)
    path = rng.choice([*sorted(table), "step"])
    key = f"{path}/zarr.json"
    good = json.loads((damaged / key).read_bytes())
    bad_bytes = damage(damaged / key, rng.choice(["flip", "truncate"]), rng)
    try:
        bad = json.loads(bad_bytes)
        harmless = all(bad.get(f) == good.get(f) for f in READ_FIELDS)
    except ValueError:
        harmless = False
    rep = Repository.open(damaged).verify()
    if harmless:
        assert rep.ok, rep.problems
        z = zarr.open_array(str(damaged / path), mode="r", zarr_format=3)
        want = pristine.snaps[head.step].arrays.get(path, np.int64(head.step))
        assert same_bits(np.asarray(z[head.slot]), np.asarray(want))
    else:
        assert [p.key for p in rep.problems] == [key], rep.problems
    snapshot_matches(load(damaged), pristine.snaps[pristine.head])  # dstt reads on regardless
    assert_params(resume(damaged), pristine.params[pristine.head])


# -- timeline documents: commit headers, the ref, HEAD -----------------------------------------

def same_document(bad: bytes, good: bytes) -> bool:
    """Whether damaged JSON still decodes to the same document ('1e-05' -> '1E-05')."""
    try:
        return bool(json.loads(bad) == json.loads(good))
    except ValueError:
        return False


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("which", ["head header", "middle header", "ref", "HEAD"])
def test_random_damage_to_timeline_documents(pristine: Pristine, damaged: Path, which: str,
                                             how: str) -> None:
    rng = random.Random(f"{which}-{how}")
    middle = rng.randint(2, STEPS - 1)
    key = {"head header": commit_key(pristine.headers[pristine.head].slot),
           "middle header": commit_key(pristine.headers[middle].slot),
           "ref": ref_key("main"), "HEAD": HEAD_KEY}[which]
    good = (damaged / key).read_bytes()
    for _ in range(50):  # a flip that decodes to the same document is no damage: draw again
        bad = damage(damaged / key, how, rng)
        if not same_document(bad, good):
            break
        (damaged / key).write_bytes(good)
    else:
        pytest.fail("no damaging flip found")

    rep = Repository.open(damaged).verify()
    assert not rep.ok and named(key, rep.problems), rep.problems
    code, doc, _ = cli("verify", "--run", str(damaged))
    assert code == 1 and named(key, doc["problems"])

    if which == "middle header":
        # the head and everything above the damage stay reachable; resume is unaffected
        assert_params(resume(damaged), pristine.params[pristine.head])
        snapshot_matches(load(damaged), pristine.snaps[pristine.head])
        run = dstt.open(damaged)
        for step in range(1, STEPS + 1):
            if step > middle:
                snap = run.at(step)
                assert_params({n: snap.to_numpy(n) for n in snap.names()},
                              pristine.params[step])
                snapshot_matches(load(damaged, step=step), pristine.snaps[step])
            else:  # below the damage the parent chain is lost: refused, naming the file
                with pytest.raises(CorruptRunError, match=re.escape(key)):
                    run.at(step)
                with pytest.raises(CorruptRunError, match=re.escape(key)):
                    load(damaged, step=step)
        # verify still checked the commits above the damage
        assert rep.commits == STEPS - middle
        return

    # the head (or the whole timeline) is unreadable: every entry point refuses, typed
    for call in (lambda: load(damaged), lambda: resume(damaged),
                 lambda: load(damaged, step=1), lambda: dstt.open(damaged).at(1)):
        with pytest.raises(CorruptRunError) as ei:
            call()
        assert key in str(ei.value)
        assert isinstance(ei.value, ValueError)
    code, _, err = cli("ls", "--run", str(damaged))
    assert code == 3 and key in err  # "run unreadable", one line naming the file


def test_a_flipped_chunk_bit_is_a_checksum_error(pristine: Pristine, damaged: Path) -> None:
    """The type says what happened: a crc32c mismatch is a ``ChecksumError``; a truncation
    (size mismatch) a plain ``CorruptRunError``."""
    h = pristine.headers[pristine.head]
    table = Repository.open(damaged).reader().arrays(h)
    key = table["params/tok/weight"].chunks[0].key
    damage(damaged / key, "flip", random.Random(1))
    with pytest.raises(ChecksumError, match=re.escape(key)):
        resume(damaged)
    (damaged / key).write_bytes((pristine.run / key).read_bytes()[:-1])
    with pytest.raises(CorruptRunError, match="truncated") as ei:
        resume(damaged)
    assert not isinstance(ei.value, ChecksumError)


def test_a_refused_resume_leaves_the_live_model_untouched(pristine: Pristine,
                                                          damaged: Path) -> None:
    h = pristine.headers[pristine.head]
    table = Repository.open(damaged).reader().arrays(h)
    # optimizer states are restored after the parameters
    last = sorted(p for p in table if p.startswith("optim/"))[-1]
    damage(damaged / table[last].chunks[-1].key, "flip", random.Random(2))
    model, opt = model_and_optimizer(seed=123)
    before = params(model)
    with pytest.raises(CorruptRunError), dstt.session(model, opt, run=damaged, resume=True):
        pass
    assert_params(params(model), before)
