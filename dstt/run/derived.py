"""Rebuilt light steps written to the run (``run.rebuilt(steps, persist=True)``, ``dstt
rebuild``), so a later process opens them without replaying.

Each is its derived commit (a one-commit repository, marked ``light/rebuilt`` with its base)
copied under ``_dstt/rebuilt/<timeline>/<step>/``, its ``keys.json`` written last: outside
every ref, index and step file, so never trained history — gc and verify do not read it, and
it is dropped when the base it was rebuilt from is no longer that timeline's (a rollback,
a gc of the base keeps it: its state is still that step's). Opened whole into memory.
Rejected: a commit on the run's timeline (gc, retention, ``run.steps`` and resume would take
a replayed state for a trained one); a sidecar directory (not on every storage, e.g. S3).
"""

from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

    from .snapshot import Snapshot

__all__ = [
    "REBUILT_PREFIX",
    "load_rebuilt",
    "rebuildable",
    "rebuilt_steps",
    "save_rebuilt",
    "written_bases",
]

#: where rebuilt steps are written in the run's storage
REBUILT_PREFIX = "_dstt/rebuilt"
_FILES = "keys.json"


def _folder(timeline: str, step: int) -> str:
    return f"{REBUILT_PREFIX}/{quote(timeline, safe='')}/{int(step):012d}"


def rebuildable(run: Any, step: int, timeline: str) -> bool:
    """Whether ``run.at(step)`` is a rebuilt light step: ``step`` is light on ``timeline``
    and the run has replay objects (``use_replay``) or a rebuild of it written."""
    if not run._rebuilder.active and step not in _written(run, timeline):  # noqa: SLF001
        return False  # nothing to rebuild it with, and none written: as a stored step's lookup
    return step in run._lines.light_steps(timeline)  # noqa: SLF001 - the run's own helper


def rebuilt_steps(
    run: Any,
    steps: Iterable[int],
    timeline: str | None,
    progress: Callable[[int, int], None] | None,
    persist: bool,
) -> dict[int, Snapshot]:
    """``Run.rebuilt``: the written ones read back, the others rebuilt by the run's
    ``Rebuilder``; with ``persist`` every one written."""
    name = timeline or run.timeline
    wanted = sorted({int(k) for k in steps})
    found = {k: s for k in wanted if (s := load_rebuilt(run, name, k)) is not None}
    rest = [k for k in wanted if k not in found]
    rebuilder, lines = run._rebuilder, run._lines  # noqa: SLF001 - the run's own parts
    out = {**found, **rebuilder.rebuilt(rest, lines, timeline=name, progress=progress)}
    return save_rebuilt(run, out) if persist else out


#: per reader of a run (``run.refresh()`` makes a new one), the steps written per timeline
_WRITTEN: weakref.WeakKeyDictionary[Any, dict[str, set[int]]] = weakref.WeakKeyDictionary()


def _written(run: Any, timeline: str) -> set[int]:
    """The steps of ``timeline`` with a rebuilt step written: one listing per timeline and
    reader, so ``run.at`` of a stored step costs no storage call per call."""
    seen = _WRITTEN.setdefault(run.reader, {})
    if timeline not in seen:
        folder = f"{REBUILT_PREFIX}/{quote(timeline, safe='')}"
        seen[timeline] = {int(n) for n in run.repo.storage.list(folder) if n.isdigit()}
    return seen[timeline]


def written_bases(run: Any, timeline: str) -> dict[int, int]:
    """``{step: base}`` of the light steps of ``timeline`` with a rebuilt step written that
    ``at`` reads (its base still that timeline's): what ``dstt log`` and the scrubber mark.
    Reads each one's small list of files, not its tensors."""
    steps = _written(run, timeline)
    if not steps:
        return {}
    slots = {h.step: int(h.slot) for h in run.commits(timeline, pruned=True)}
    st = run.repo.storage
    out: dict[int, int] = {}
    for k in sorted(steps):
        key = _files(timeline, k)
        if not st.exists(key):
            continue  # half written: never read
        doc = json.loads(st.read(key))
        if slots.get(doc["base"]) == doc["base_slot"]:
            out[k] = int(doc["base"])
    return out


def _files(timeline: str, step: int) -> str:
    return f"{_folder(timeline, step)}/{_FILES}"


def save_rebuilt(run: Any, snaps: Mapping[int, Snapshot]) -> dict[int, Snapshot]:
    """Write the rebuilt ``snaps`` (held in memory) to ``run``'s storage, each one's list of
    files last, so a half-written one is never read; those written already are left. Returns
    ``snaps``."""
    for snap in snaps.values():
        if not run.repo.storage.exists(_files(snap.timeline, snap.step)):
            _save(run, snap)
        _written(run, snap.timeline).add(snap.step)
    return dict(snaps)


def _save(run: Any, snap: Snapshot) -> None:
    from dstt.inspect.rebuild import REBUILT_OBJECT
    from dstt.store._internal import MemoryStorage

    src = snap.run.reader.storage
    assert isinstance(src, MemoryStorage)  # a derived commit's own repository (rebuilt_commit)
    files = sorted(src.data)
    folder = _folder(snap.timeline, snap.step)
    dst = run.repo.storage
    for key in files:
        dst.write(f"{folder}/{key}", src.read(key))
    base = snap.object(REBUILT_OBJECT)["base"]
    slot = next(int(h.slot) for h in run.commits(snap.timeline, pruned=True) if h.step == base)
    doc = {"step": snap.step, "base": base, "base_slot": slot, "keys": files}
    dst.write_durable(f"{folder}/{_FILES}", json.dumps(doc).encode())


def load_rebuilt(run: Any, timeline: str, step: int) -> Snapshot | None:
    """The rebuilt step ``step`` of ``timeline`` written to ``run``, or None (none written,
    or rebuilt from a base the timeline no longer has)."""
    import dataclasses

    from dstt.inspect.rebuild import REBUILT_OBJECT, Rebuilt
    from dstt.store._internal import MemoryStorage, Repository

    from .rebuilt import _Derived
    from .snapshot import Snapshot

    st = run.repo.storage
    folder = _folder(timeline, step)
    key = _files(timeline, step)
    if step not in _written(run, timeline) or not st.exists(key):
        return None
    doc = json.loads(st.read(key))
    base = [h for h in run.commits(timeline, pruned=True) if h.step == doc["base"]]
    if not base or int(base[0].slot) != doc["base_slot"]:
        return None  # rebuilt on a timeline that has changed since
    mem = MemoryStorage()
    for f in doc["keys"]:
        mem.write(f, st.read(f"{folder}/{f}"))
    derived = _Derived(run, Repository(mem), timeline)
    header = derived.reader.head()
    if header is None:
        return None
    snap = Snapshot(derived, header, timeline)
    mark: dict[str, Any] = snap.object(REBUILT_OBJECT)
    fields = {f.name for f in dataclasses.fields(Rebuilt)}
    snap.rebuilt = Rebuilt(**{k: v for k, v in mark.items() if k in fields})
    return snap
