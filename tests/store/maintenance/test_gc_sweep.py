"""gc removes the debris of interrupted writes: temp files and the step files of headerless
slots."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from dstt.errors import StorageError
from dstt.store import LocalStorage, Repository, load, save
from dstt.store.commit.transaction import Transaction
from dstt.store.format.layout import COMMITS_PREFIX, STEPS_PREFIX, side_file_key, step_file_key
from dstt.store.storage.memory import FaultyStorage


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def _partial_step(txn: Transaction) -> None:
    plan = txn.declare("params/w", "float32", (4, 4))
    txn.put_chunk("params/w", 0, np.zeros(16, np.float32).view(np.uint8)[: plan.nbytes])
    txn.put_object("pos", 4)


def test_gc_sweeps_aborted_slots_and_temporaries(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for s in range(1, 4):
        save(run, s, {"params/w": np.full((4, 4), s, np.float32)}, objects={"pos": s})
    clean = _files(run)
    repo = Repository.open(run)
    with repo.writer() as w:  # a step that dies before it publishes its files
        txn = w.begin(4)
        _partial_step(txn)
    # a step whose zip and side file were published, but whose commit header never landed
    st = FaultyStorage(LocalStorage(run), fail_keys=rf"^{COMMITS_PREFIX}/")
    with Repository(st).writer() as w:
        txn = w.begin(4)
        _partial_step(txn)
        with pytest.raises(StorageError, match="commits"):
            txn.commit()
        slot = txn.slot
    (run / STEPS_PREFIX / "000000000009.zip.tmp.123.456").write_bytes(b"torn")
    debris = _files(run) - clean
    published = {step_file_key(slot), side_file_key(slot)}
    assert published <= debris  # the headerless slot's step files
    temps = debris - published
    assert len(temps) == 3, temps
    assert all(".tmp." in f for f in temps), temps  # zip, side, torn
    assert not (run / COMMITS_PREFIX / f"{slot:012d}.json").exists()
    assert load(run).header.step == 3  # none of it is visible

    dry = repo.gc(dry_run=True)
    assert dry.dry_run
    assert _files(run) - clean == debris  # a dry run touches nothing
    report = repo.gc()
    assert report.pruned_steps == ()
    assert report.orphan_slots == ()
    # the temporaries go; the headerless slot newer than every ref's head stays: a header
    # lost to damage looks the same, and gc deletes nothing it cannot prove abandoned
    assert report.files_removed == 3
    assert _files(run) - clean == published
    assert repo.verify().ok  # debris of a timeline that has a ref: not a problem
    assert load(run).arrays["params/w"][0, 0] == 3
    # the next commit goes above the headerless slot (never over its files) ...
    h = save(run, 4, {"params/w": np.full((4, 4), 4, np.float32)})
    assert h.slot == slot + 1
    assert load(run, 4).arrays["params/w"][0, 0] == 4
    assert load(run, 4).objects == {}  # not the dead step's object
    assert not any(".tmp." in f for f in os.listdir(run / STEPS_PREFIX))
    # ... and then it is older than a head: proven abandoned, the next gc removes it
    assert Repository.open(run).gc().files_removed == 2
    assert not published & _files(run)
    assert load(run, 4).arrays["params/w"][0, 0] == 4
    assert Repository.open(run).verify().ok
