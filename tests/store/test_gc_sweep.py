"""gc removes the debris of interrupted writes: temp files and chunks of headerless slots."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from dstt.store import Repository, load, save


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_gc_sweeps_aborted_slots_and_temporaries(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for s in range(1, 4):
        save(run, s, {"params/w": np.full((4, 4), s, np.float32)}, objects={"pos": s})
    clean = _files(run)
    repo = Repository.open(run)
    with repo.writer() as w:  # a step that dies before its commit header
        txn = w.begin(4)
        plan = txn.declare("params/w", "float32", (4, 4))
        txn.put_chunk("params/w", 0, np.zeros(16, np.float32).view(np.uint8)[: plan.nbytes])
        txn.put_object("pos", 4)
    (run / "params" / "w" / "c.9.0.0.tmp.123.456").write_bytes(b"torn")
    assert len(_files(run) - clean) == 3

    report = repo.gc()
    assert report.pruned_steps == ()
    assert _files(run) == clean
    assert repo.verify().ok
    assert load(run).arrays["params/w"][0, 0] == 3
    # the next commit reuses nothing stale
    save(run, 4, {"params/w": np.full((4, 4), 4, np.float32)})
    assert load(run, 4).arrays["params/w"][0, 0] == 4
    assert not any(".tmp." in f for f in os.listdir(run / "params" / "w"))
