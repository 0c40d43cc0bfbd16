"""Resuming a step that ``dstt import`` brought in: say what its source did not hold.

An imported step (one with the object ``import/source``) holds what its source held, and a
resume restores that bit-exactly. No RNG state: a ``DsttWarning`` names the source and the
process keeps its own RNG. No optimizer or scheduler state while the session has one: a
``SchemaError`` says what to do (``run.at(k).load_into(model)`` and a new run) — silently
starting a fresh optimizer would look like a resume and train differently. Rejected
alternative: storing placeholder state at import time — a resume would "restore" values the
source never had.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING, Any

from dstt import schema
from dstt.errors import DsttWarning, SchemaError
from dstt.schema import IMPORT_OBJECT

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["imported_gaps"]


@contextlib.contextmanager
def imported_gaps(
    source: Any, providers: Any, *, optimizer: bool, scheduler: bool
) -> Iterator[None]:
    """Around a restore of ``source``: checks what an imported step lacks (see the module
    docstring); a missing RNG state is tolerated (with a warning) while the block runs."""
    if not source.has_object(IMPORT_OBJECT):
        yield
        return
    info = source.object(IMPORT_OBJECT) or {}
    lacks = set(info.get("lacks") or ())
    where = f"step {source.step} was imported from {info.get('path')} ({info.get('format')})"
    need = [
        w
        for w, has in (("optimizer state", optimizer), ("scheduler state", scheduler))
        if has and w in lacks
    ]
    if need:
        raise SchemaError(
            f"{where}, which holds no {' and no '.join(need)}: resume=True cannot restore "
            "it. Load the weights with dstt.open(run).at(step).load_into(model) and start a "
            "new run (or leave the scheduler out of the session)"
        )
    relaxed = []
    if "RNG state" in lacks:
        warnings.warn(
            f"dstt: {where}, which holds no RNG state; the RNG is not restored, so "
            "the resumed run draws differently from the original",
            DsttWarning,
            stacklevel=4,
        )
        relaxed = [p for p in _objects(providers) if _base(p) == schema.RNG_OBJECT and p.required]
    for p in relaxed:
        p.required = False
    try:
        yield
    finally:
        for p in relaxed:
            p.required = True


def _base(p: Any) -> str | None:
    return getattr(p, "base", getattr(p, "name", None))


def _objects(providers: Any) -> Iterator[Any]:
    for p in getattr(providers, "providers", ()):
        if hasattr(p, "required"):
            yield p
