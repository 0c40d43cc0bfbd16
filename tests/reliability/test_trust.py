"""Nothing stored in a run, or in a checkpoint being imported, runs code unless trusted.

A run holds a pickled object (``extra_state`` that is not plain data) whose ``__reduce__``
writes a marker file when unpickled. Replay, restore (``load_into``, ``state_dict``),
export and resume decode only the objects a provider restores, and a pickle only with
``trusted=True`` (a resume of one's own run is trusted; it still unpickles nothing it was not
asked to restore). Imports of ``torch.save`` files, zip and legacy formats, refuse the pickle
unless ``trusted=True``. A damaged head object no provider restores warns at resume instead
of blocking it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import dstt
from dstt.errors import ChecksumError, DsttWarning, UnsafeObjectError
from dstt.store import Repository
from dstt.testing.models import SyntheticBatches

from ._helpers import model_and_optimizer, train

PICKLED = "ignore:object .* is not plain data:RuntimeWarning"
STEPS = 4


def plant(path: str) -> str:
    """What unpickling a ``Planted`` calls: the code a malicious pickle would run."""
    Path(path).write_text("ran")
    return "planted"


class Planted:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return plant, (self.marker,)


class Evil:
    """``extra_state`` whose state is not plain data (stored with pickle)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker
        self.loaded: list[Any] = []

    def state_dict(self) -> dict[str, Any]:
        return {"x": Planted(self.marker)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded.append(state)


@pytest.fixture
def evil_run(tmp_path: Path) -> tuple[Path, Path]:
    run, marker = tmp_path / "run", tmp_path / "marker"
    with pytest.warns(RuntimeWarning, match="pickle"):
        train(run, STEPS, extra_state={"evil": Evil(marker)})
    head = Repository.open(run).reader().head()
    assert head is not None
    assert head.objects["extra/evil"].encoding == "pickle"
    assert not marker.exists()
    return run, marker


def test_replay_unpickles_no_object_it_does_not_restore(evil_run: tuple[Path, Path]) -> None:
    run, marker = evil_run
    batches = list(SyntheticBatches(STEPS, seed=0))
    model, opt = model_and_optimizer(0)
    r = dstt.open(run).replay(
        3, model, opt, batches=[batches[2]], loss_fn=lambda m, b: m(*b)[1], per_sample=False
    )
    assert r.faithful
    assert not marker.exists()


def test_restore_export_and_objects_unpickle_only_when_trusted(
    evil_run: tuple[Path, Path], tmp_path: Path
) -> None:
    run, marker = evil_run
    snap = dstt.open(run).at(STEPS)
    model, opt = model_and_optimizer(1)
    snap.load_into(model, opt)
    snap.state_dict()
    snap.export(tmp_path / "out.safetensors")
    snap.export(tmp_path / "out.pt", format="torch")
    assert not marker.exists()
    with pytest.raises(UnsafeObjectError, match="trusted=True"):
        snap.object("extra/evil")
    assert not marker.exists()
    assert snap.object("extra/evil", trusted=True) == {"x": "planted"}
    assert marker.exists()


@pytest.mark.filterwarnings(PICKLED)
def test_resume_unpickles_only_what_a_provider_restores(evil_run: tuple[Path, Path]) -> None:
    run, marker = evil_run
    kept = Evil(marker)
    train(run, STEPS + 1, resume=True, extra_state={"evil": kept})  # one's own run: trusted
    assert marker.exists()  # asked for: restored
    assert kept.loaded == [{"x": "planted"}]
    marker.unlink()
    train(run, STEPS + 3, resume=True)  # the evil state is no longer in the session
    assert not marker.exists()
    assert Repository.open(run).reader().head().step == STEPS + 3  # type: ignore[union-attr]


def test_a_damaged_object_no_provider_restores_warns_at_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(run, STEPS)
    reader = Repository.open(run).reader()
    head = reader.head()
    assert head is not None
    rec = head.objects["summaries"]
    path = run / rec.key
    data = bytearray(path.read_bytes())
    data[rec.offset + rec.nbytes // 2] ^= 0x10  # one bit flipped inside the object
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        Repository.open(run).reader().read_object(head, "summaries")
    with pytest.warns(DsttWarning, match="summaries"):
        _, losses = train(run, STEPS + 2, resume=True)
    assert len(losses) == 2
    assert Repository.open(run).reader().head().step == STEPS + 2  # type: ignore[union-attr]


@pytest.mark.parametrize("zipfile", [True, False], ids=["zip", "legacy"])
def test_import_refuses_a_pickle_unless_trusted(tmp_path: Path, zipfile: bool) -> None:
    marker = tmp_path / "marker"
    model, _ = model_and_optimizer(0)
    src = tmp_path / "step_5.pt"
    torch.save(
        {"model": model.state_dict(), "step": 5, "evil": Planted(marker)},
        src,
        _use_new_zipfile_serialization=zipfile,
    )
    report = dstt.import_checkpoints(src, tmp_path / "run", model=model)
    assert not report.ok
    assert "trusted=True" in report.skipped[0].reason
    assert not marker.exists()
    report = dstt.import_checkpoints(src, tmp_path / "run2", model=model, trusted=True)
    assert marker.exists()


def test_replay_unpickles_restored_state_only_when_trusted(tmp_path: Path) -> None:
    run, marker = tmp_path / "run", tmp_path / "marker"
    with pytest.warns(RuntimeWarning, match="pickle"):
        train(run, STEPS, scheduler=Evil(marker))  # a scheduler whose state is not plain
    batches = list(SyntheticBatches(STEPS, seed=0))

    def again(**trust: bool) -> Any:
        model, opt = model_and_optimizer(0)
        return dstt.open(run).replay(
            3,
            model,
            opt,
            scheduler=Evil(marker),
            batches=[batches[2]],
            loss_fn=lambda m, b: m(*b)[1],
            per_sample=False,
            **trust,
        )

    with pytest.raises(UnsafeObjectError, match="trusted=True"):
        again()
    assert not marker.exists()
    assert again(trusted=True).faithful
    assert marker.exists()
