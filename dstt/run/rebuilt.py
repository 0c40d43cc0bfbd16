"""Light steps rebuilt on demand: ``Rebuilder`` holds what ``dstt.open(..., replay=)`` (or
``run.use_replay``) gave, replays the light steps ``every="auto"`` did not store (one pass per
gap, from the stored step before it) and keeps the last ``REBUILT_CACHE`` as snapshots of
derived commits, in memory, never in the run.

:class:`dstt.Run` holds one; it reads the run through ``RebuildingRun`` (the protocol below),
so this module imports nothing of ``run.py``. Rejected alternative: the replay state as
attributes of ``Run`` — five members and a cache only ``at``/``trajectory``/``diff`` of a light
step use, beside the timelines and views every run has.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from dstt._lru import LRU
from dstt.errors import ConfigError
from dstt.inspect.catalog import Catalog
from dstt.inspect.readers import ReaderPool

if TYPE_CHECKING:
    from dstt.store._internal import Batch, CommitHeader, Reader, Repository

    from .lines import Lines
    from .metrics import Metrics
    from .snapshot import Snapshot

__all__ = ["REBUILT_CACHE", "Rebuilder", "RebuildingRun"]

#: rebuilt light steps kept in memory per run (each a whole state: model and optimizer)
REBUILT_CACHE = 8


class RebuildingRun(Protocol):
    """What a rebuild reads its run through (``dstt.Run``)."""

    path: str

    @property
    def reader(self) -> Reader: ...

    def metrics(self, timeline: str | None = None) -> Metrics: ...

    def batches(
        self, steps: slice | Iterable[int] | None = None, *, timeline: str | None = None
    ) -> dict[int, list[Batch]]: ...


class Rebuilder:
    """The replay objects of a run and the light steps rebuilt with them (cached)."""

    def __init__(self, run: RebuildingRun) -> None:
        self._run = run
        self.replay: Any = None
        self._made: dict[str, Any] | None = None
        self._rebuilt: LRU[tuple[str, int], Snapshot] = LRU(REBUILT_CACHE)

    @property
    def active(self) -> bool:
        """Whether the run has replay objects (light steps are rebuilt on demand)."""
        return self.replay is not None

    def clear(self) -> None:
        """Forget the rebuilt steps (``run.refresh()``)."""
        self._rebuilt.clear()

    def use(self, replay: Any, lines: Lines) -> None:
        """Take ``replay`` (``Run.use_replay``): a dict, a function, ``"FILE.py:FUNCTION"``
        or True (the factory the head commit names)."""
        from dstt.inspect.rebuild import REPLAY_KEYS, load_factory

        if replay is True:  # the factory the run's sessions named (replay="train.py:make")
            replay = self._named_factory(lines)
        elif isinstance(replay, str):
            replay = load_factory(replay)
        if isinstance(replay, Mapping):
            check_replay(replay, REPLAY_KEYS)
        elif not callable(replay):
            raise ConfigError(
                f"replay= takes a dict of run.rebuild's objects ({', '.join(REPLAY_KEYS)}) or a "
                f"function returning one, not a {type(replay).__name__}"
            )
        self.replay, self._made = replay, None
        self._rebuilt.clear()

    def _named_factory(self, lines: Lines) -> Any:
        """The factory ``dstt.session(..., replay="FILE.py:FUNCTION")`` recorded in the head
        commit, imported (it runs the file: what ``replay=True`` asks for)."""
        from dstt.inspect.rebuild import load_factory
        from dstt.schema import REPLAY_OBJECT

        line = lines.commits()
        rec = (
            lines.reader.read_object(line[-1], REPLAY_OBJECT)
            if line and REPLAY_OBJECT in line[-1].objects
            else None
        )
        if not isinstance(rec, Mapping) or not isinstance(rec.get("factory"), str):
            raise ConfigError(
                f"replay=True: the head of {self._run.path} names no replay factory (a session "
                "records one with dstt.session(..., replay='train.py:make')); pass the "
                "objects instead, replay=dict(model=..., optimizer=..., dataset=...)"
            )
        return load_factory(rec["factory"], rec.get("path"))

    def _kwargs(self) -> dict[str, Any]:
        from dstt.inspect.rebuild import REPLAY_KEYS

        if self._made is None:
            made = self.replay() if callable(self.replay) else self.replay
            if not isinstance(made, Mapping):
                raise ConfigError(
                    f"the replay= function returned a {type(made).__name__}, not a dict of "
                    f"run.rebuild's objects ({', '.join(REPLAY_KEYS)})"
                )
            check_replay(made, REPLAY_KEYS)
            self._made = dict(made)
        return self._made

    def rebuilt(
        self,
        steps: Iterable[int],
        lines: Lines,
        *,
        timeline: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[int, Snapshot]:
        """``{step: Snapshot}`` of light ``steps`` (``Run.rebuilt``)."""
        from dstt.inspect.rebuild import rebuild_step, rebuilt_commit
        from dstt.inspect.replay import replay_kit_for

        from .snapshot import Snapshot

        name = timeline or lines.timeline
        wanted = sorted({int(k) for k in steps})
        out: dict[int, Snapshot] = {
            k: got for k in wanted if (got := self._rebuilt.get((name, k))) is not None
        }
        todo = [k for k in wanted if k not in out]
        if not todo:
            return out
        if self.replay is None:
            raise ConfigError(
                f"steps {todo} are light steps (every='auto' did not store them) and this run "
                "has nothing to rebuild them with: open it with dstt.open(path, "
                "replay=dict(model=..., optimizer=..., dataset=..., loss_fn=...)) or call "
                "run.use_replay(...)"
            )
        kw = dict(self._kwargs())
        trainer, module = kw.pop("trainer", None), kw.pop("module", None)
        kit = None if trainer is None else replay_kit_for(trainer, module)
        stored = {h.step: h for h in lines.commits(name)}
        logged = self._step_metrics(name, todo)
        done = 0
        reader = lines.reader

        def keep(i: int, so_far: Any, live: Any) -> None:
            nonlocal done
            if i not in want:
                return
            mine = dataclasses.replace(
                so_far,
                step=i,
                losses={s: v for s, v in so_far.losses.items() if s <= i},
                checked=[s for s in so_far.checked if s <= i],
                unchecked=[s for s in so_far.unchecked if s <= i],
            )
            repo, header = rebuilt_commit(live, mine, stored[mine.base], reader, logged.get(i))
            snap = Snapshot(_Derived(self._run, repo, name), header, name)
            snap.rebuilt = mine
            self._rebuilt.put((name, i), snap)
            out[i] = snap
            done += 1
            if progress:
                progress(done, len(todo))

        for _, ks in sorted(by_base(stored, todo).items()):
            want = set(ks)
            rebuild_step(self._run, reader, max(ks), kit=kit, timeline=name, on_step=keep, **kw)
        return out

    def _step_metrics(self, timeline: str, steps: list[int]) -> dict[int, dict[str, Any]]:
        """What each of ``steps`` logged (``s.log``), NaN left out."""
        m = self._run.metrics(timeline)
        where = {int(k): i for i, k in enumerate(m.steps.tolist())}
        rows = {k: {n: float(m.column(n)[where[k]]) for n in m.names} for k in steps if k in where}
        return {k: {n: v for n, v in row.items() if v == v} for k, row in rows.items()}


def by_base(stored: Iterable[int], steps: Iterable[int]) -> dict[int, list[int]]:
    """Light ``steps`` by the stored step before each (-1: none): one replay pass each."""
    groups: dict[int, list[int]] = {}
    for k in steps:
        groups.setdefault(max((s for s in stored if s < k), default=-1), []).append(k)
    return groups


def check_replay(made: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    """``ConfigError`` unless ``made`` is a dict of rebuild's objects that can replay."""
    unknown = sorted(set(made) - set(keys))
    if unknown:
        raise ConfigError(f"replay= has unknown keys {unknown}; expected any of {', '.join(keys)}")
    if "trainer" not in made and ("model" not in made or "optimizer" not in made):
        raise ConfigError(
            "replay= needs 'model' and 'optimizer' (built as the training script builds them), "
            "or 'trainer' (with 'module' for Lightning)"
        )


class _Derived:
    """The run a rebuilt step's snapshot reads: the derived commit's own repository (in
    memory) for its tensors and objects, the run itself for its recorded batches."""

    def __init__(self, run: RebuildingRun, repo: Repository, timeline: str) -> None:
        self._run, self._timeline = run, timeline
        self._readers = ReaderPool(repo.storage)

    @property
    def reader(self) -> Reader:
        return self._readers.primary

    def catalog(self, header: CommitHeader) -> Catalog:
        return Catalog.of(self.reader, header, listing=f"run.at({header.step}).names(optim=True)")

    def batches(
        self, steps: slice | Iterable[int] | None = None, *, timeline: str | None = None
    ) -> dict[int, list[Batch]]:
        return self._run.batches(steps, timeline=timeline or self._timeline)
