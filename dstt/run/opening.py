"""Opening a run: ``dstt.open(path)`` (``open_run``) checks what ``path`` is — a run, a file,
a folder inside a run, an ``s3://`` URL, a ``Repository`` — and returns a :class:`dstt.Run`
over it, or a ``NotARunError`` saying what to pass instead; ``find_run_root`` finds the run
holding a folder, as git finds a repository (the CLI's ``RUN``).

Kept apart from ``run.py``, which is the run once open: this module imports it, never the
other way. Rejected alternative: a ``Run.open`` classmethod — the path checks and the hint
search are about the file system, not about a run.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from dstt.errors import NotARunError
from dstt.store._internal import Repository, is_url

from .run import Run

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.store._internal import Storage

__all__ = ["find_run_root", "open_run"]


def open_run(
    path: str | os.PathLike[str] | Repository | Storage,
    *,
    storage_options: Mapping[str, Any] | None = None,
    replay: Any = None,
) -> Run:
    """Open a run for inspection; ``NotARunError`` if ``path`` is not one. ``path`` may be an
    ``s3://bucket/prefix`` URL (``storage_options``: see ``dstt.store.storage_for``).
    ``replay``: the objects a light step's rebuild needs (``run.rebuild``'s keywords as a
    dict, or a function returning one, ``"FILE.py:FUNCTION"``, or True: the factory the
    run's session named), so ``at``, ``trajectory``, ``diff`` and ``load_into`` reach every
    step of an ``every="auto"`` run (:meth:`Run.use_replay`)."""
    run = _open(path, storage_options)
    return run if replay is None else run.use_replay(replay)


def _open(
    path: str | os.PathLike[str] | Repository | Storage, storage_options: Mapping[str, Any] | None
) -> Run:
    if isinstance(path, Repository):
        return Run(path)
    if not isinstance(path, (str, os.PathLike)) or is_url(path):
        return Run(Repository.open(path, **(storage_options or {})))
    p = os.path.abspath(os.fspath(path))
    if not os.path.exists(p):
        raise NotARunError(f"no run at {path}: no such file or directory")
    if not os.path.isdir(p):
        raise NotARunError(
            f"{path} is a file, not a run directory; pass the run's directory "
            "(the folder holding zarr.json and _dstt/), or a new path for a new run"
        )
    try:
        return Run(Repository.open(path))
    except NotARunError:
        root = find_run_root(os.path.dirname(p))
        if root is None:
            raise
        raise NotARunError(
            f"{path} is a folder inside the run {root}; open the run itself: dstt.open({root!r})"
        ) from None


def find_run_root(path: str | os.PathLike[str]) -> str | None:
    """The run directory holding ``path`` (``path`` itself or its nearest parent that is a
    run, as git finds a repository from any folder inside it); None when there is none."""
    d = os.path.abspath(os.fspath(path))
    while True:
        if os.path.isfile(os.path.join(d, "zarr.json")) and os.path.isdir(os.path.join(d, "_dstt")):
            try:
                Repository.open(d)
                return d
            except NotARunError:
                pass
        parent = os.path.dirname(d)
        if parent == d:
            return None
        d = parent
