"""``dstt index`` and ``dstt verify --repair``: the index rebuilt from the commit headers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dstt
from dstt.cli import EXIT_OK, EXIT_PROBLEMS, main
from dstt.store import Repository
from dstt.store.format.layout import INDEX_PREFIX


def _run(path: Path, n: int = 20) -> None:
    with Repository.create(path).writer(index_every=4) as w:
        for s in range(n):
            txn = w.begin(s)
            a = np.full(6, s, np.float32)
            txn.declare("params/w", "float32", a.shape)
            txn.put_chunk("params/w", 0, a.view(np.uint8))
            txn.commit({"loss": 1.0 / (s + 1)})


def _segments(path: Path) -> list[Path]:
    return sorted((path / INDEX_PREFIX).glob("*.idx"))


def test_index_rebuilds_a_deleted_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _run(tmp_path / "run")
    for p in _segments(tmp_path / "run"):
        p.unlink()
    assert main(["index", str(tmp_path / "run"), "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == {"rows": 20}
    assert _segments(tmp_path / "run")
    assert dstt.open(tmp_path / "run").steps == list(range(20))


def test_verify_reports_a_damaged_index_and_repair_rebuilds_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(tmp_path / "run")
    seg = _segments(tmp_path / "run")[0]
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0xFF
    seg.write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "run")]) == EXIT_PROBLEMS
    assert INDEX_PREFIX in capsys.readouterr().out
    assert dstt.open(tmp_path / "run").steps == list(range(20))  # reads stay right meanwhile
    assert main(["verify", "--repair", str(tmp_path / "run"), "--json"]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"]
    assert doc["repaired"]
    assert main(["verify", str(tmp_path / "run")]) == EXIT_OK
