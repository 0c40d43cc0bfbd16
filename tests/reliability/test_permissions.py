"""A read-only run: inspection works in full (``dstt.open``, ``at``, ``trajectory``, ``dstt ls``,
``dstt verify`` ...); writing is refused at session start with ``ReadOnlyRunError`` — before
any training step and before the live model is touched — and nothing in the run changes.

As root, mode bits stop nothing, so two real mechanisms are used: the ext4 immutable attribute
(``chattr +i``, as in tests/store/test_errors.py) and a read-only bind mount (EROFS). Each is
skipped, with the reason, only where the kernel or container refuses it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dstt
from dstt.errors import ReadOnlyRunError
from dstt.store import load

from ._helpers import (
    assert_params,
    cli,
    model_and_optimizer,
    params,
    stored_params,
    train,
)

STEPS = 4


def run_cmd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True)


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("chattr +i needs root and chattr")
    res = run_cmd("chattr", "-R", "+i", str(path))
    if res.returncode != 0:
        run_cmd("chattr", "-R", "-i", str(path))
        pytest.skip(f"chattr +i not supported here: {res.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-R", "-i", str(path)], check=True)


@contextlib.contextmanager
def read_only_bind(path: Path) -> Iterator[None]:
    """Mount ``path`` over itself, read-only (writes fail with EROFS)."""
    res = run_cmd("mount", "--bind", str(path), str(path))
    if res.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {res.stderr.strip()}")
    try:
        res = run_cmd("mount", "-o", "remount,bind,ro", str(path))
        if res.returncode != 0:
            pytest.skip(f"cannot remount read-only here: {res.stderr.strip()}")
        yield
    finally:
        if run_cmd("umount", str(path)).returncode != 0:
            run_cmd("umount", "-l", str(path))


MECHANISMS = {"chattr +i": immutable, "read-only bind mount": read_only_bind}


def tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    run = tmp_path_factory.mktemp("ro") / "run"
    after, _ = train(run, STEPS)
    return run, after


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_read_only_run_inspects_fully_and_refuses_writers_at_start(
    trained: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path, mechanism: str
) -> None:
    src, after = trained
    run = tmp_path / "run"
    shutil.copytree(src, run)
    before = tree_digest(run)
    with MECHANISMS[mechanism](run):
        # inspection, in this process
        r = dstt.open(run)
        assert r.steps == list(range(1, STEPS + 1))
        for s in (1, STEPS):
            assert_params(stored_params(run, s), after[s])
        traj = r.trajectory("layers.1.mlp.0.weight").values
        np.testing.assert_array_equal(
            traj, np.stack([after[s]["layers.1.mlp.0.weight"] for s in range(1, STEPS + 1)])
        )
        assert list(r.metrics()["step"].values) == list(range(1, STEPS + 1))
        assert r.summaries().sizes["step"] == STEPS
        assert r.verify().ok
        assert load(run).header.step == STEPS
        # ... and through the CLI in other processes
        for args in (
            ["ls"],
            ["log"],
            ["show", "--step", "2"],
            ["verify"],
            ["diff", "1", str(STEPS)],
        ):
            code, doc, err = cli(*args, "--run", str(run))
            assert code == 0, (args, err)
            assert doc is not None, (args, err)
        # writing is refused when the session starts, before any training or restore
        for resume in (True, False):
            model, opt = model_and_optimizer(seed=7)
            untouched = params(model)
            s = dstt.session(model, opt, run=run, resume=resume)
            with pytest.raises(ReadOnlyRunError) as ei:
                s.start()
            assert isinstance(ei.value, PermissionError)
            assert str(run) in str(ei.value)
            assert s.step == 0
            assert_params(params(model), untouched)
        for args in (["gc", "--keep-last", "1"], ["rollback", "--to", "2"]):
            code, _, err = cli(*args, "--run", str(run))
            assert code == 3, (args, err)
            assert str(run) in err, (args, err)
        assert tree_digest(run) == before  # not one byte changed
    # writable again: the run resumes and commits
    _, losses = train(run, STEPS + 2, resume=True)
    assert len(losses) == 2
    assert dstt.open(run).steps == list(range(1, STEPS + 3))


@pytest.mark.parametrize("folder", ["_dstt/refs", "_dstt/commits", "steps"])
def test_a_read_only_commit_folder_is_refused_at_start_too(
    trained: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path, folder: str
) -> None:
    """Only a folder every commit writes to is immutable, not the run root: the session must
    still refuse at its start rather than fail at the first commit, mid-training."""
    src, _ = trained
    run = tmp_path / "run"
    shutil.copytree(src, run)
    with immutable(run / folder):
        model, opt = model_and_optimizer()
        with pytest.raises(ReadOnlyRunError, match=folder.split("/")[-1]):
            dstt.session(model, opt, run=run, resume=True).start()
