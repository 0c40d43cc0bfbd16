"""``SessionOptions``: every knob of a capturing session, in one frozen, validated value.

``dstt.session(...)``, the Hugging Face and Lightning callbacks and the DeepSpeed checkpoint
engine each build one ``SessionOptions`` (``SessionOptions(run=..., every=...)`` or
``SessionOptions.of(run, **keywords)``) and hand it to the session class, which reads its
settings from it and nowhere else. Bad values are refused here with a ``ConfigError`` (a
``ValueError``) or ``TypeError`` that names the option, before a run is opened. The training
objects (model, optimizer, scheduler, ``extra_state``) are not options: a session captures
them, a callback finds them itself. Rejected alternative: the sixteen keyword arguments
repeated in every entry point (five copies had drifted: a callback could not pass
``retention``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal

from dstt.engine.distributed.ranks import DEFAULT_START_TIMEOUT
from dstt.errors import ConfigError
from dstt.store._internal import DeltaPolicy, Repository, Retention, Storage

from .retention import check_policy

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_MAX_GAP",
    "DEFAULT_RANK_TIMEOUT",
    "DEFAULT_START_TIMEOUT",
    "CopyMode",
    "ErrorPolicy",
    "RacePolicy",
    "RunArg",
    "SessionOptions",
]

RacePolicy = Literal["raise", "recopy", "warn"]
ErrorPolicy = Literal["raise", "skip"]
CopyMode = Literal["async", "sync", "auto"]
RunArg = str | os.PathLike[str] | Repository | Storage

MiB = 1024 * 1024
DEFAULT_BUDGET = 256 * MiB
#: ``every="auto"``: at most this many light steps in a row (a rebuild replays at most this many)
DEFAULT_MAX_GAP = 16
DEFAULT_RANK_TIMEOUT = 600.0


@dataclass(frozen=True)
class SessionOptions:
    """How a session captures a run (see :func:`dstt.session` for what each option does).

    ``run``: the run's directory, ``s3://`` URL, ``Repository`` or ``Storage``. ``every``:
    capture every ``every``-th optimizer step, or ``"auto"``: every step the engine can take
    without blocking training and within 5 % of its time (``AUTO_OVERHEAD``), the others
    recorded as *light* steps (metrics, sample indices, loss fingerprint; rebuilt by
    replay), at most ``max_gap`` light steps in a row (with
    several ranks, agreed across them). ``replay``: ``"FILE.py:FUNCTION"``, a function
    returning ``run.rebuild``'s objects as a dict (as ``dstt replay --script`` takes it),
    recorded in the run so ``dstt.open(run, replay=True)`` rebuilds light steps with it.
    ``resume``: continue the run's latest commit.
    ``budget_bytes``: the host cache. ``race_policy``/``verify``: what an in-place write that
    races the copy does. ``error_policy``: how background errors surface. ``writers``: writer
    threads (default: one less than the cores, at most 4). ``max_backlog``: steps awaiting
    their commit. ``summaries``: write-time statistics. ``encoding``: a ``DeltaPolicy``.
    ``copy``: ``"async"``, ``"sync"`` or ``"auto"``. ``retention``: background gc.
    ``rank_timeout``: seconds the ranks of a distributed session wait for one another (to
    open the run together, and rank 0 for every rank's part of a step); ``start_timeout``:
    seconds they wait for each other to start the session.
    """

    run: RunArg
    every: int | Literal["auto"] = 1
    max_gap: int = DEFAULT_MAX_GAP
    resume: bool = False
    budget_bytes: int = DEFAULT_BUDGET
    race_policy: RacePolicy = "raise"
    verify: bool = False
    error_policy: ErrorPolicy = "raise"
    writers: int | None = None
    max_backlog: int = 16
    summaries: bool = True
    encoding: DeltaPolicy | None = None
    copy: CopyMode = "async"
    retention: Retention | None = None
    rank_timeout: float = DEFAULT_RANK_TIMEOUT
    start_timeout: float = DEFAULT_START_TIMEOUT
    replay: str | None = None

    def __post_init__(self) -> None:
        run = self.run
        if not isinstance(run, str | os.PathLike | Repository | Storage):
            raise TypeError(
                f"run must be a path, an s3:// URL, a Repository or a Storage, not "
                f"{type(run).__name__}"
            )
        if isinstance(run, str | os.PathLike) and not os.fspath(run):
            raise ConfigError("run must name a directory, e.g. run='runs/exp1'")
        if self.every != "auto" and not _positive_int(self.every):
            raise ConfigError(f"every must be a positive int or 'auto', got {self.every!r}")
        if not _positive_int(self.max_gap):
            raise ConfigError(
                f"max_gap must be a positive int (light steps between two stored ones), "
                f"got {self.max_gap!r}"
            )
        if self.race_policy not in ("raise", "recopy", "warn"):
            raise ConfigError(
                f"race_policy must be 'raise', 'recopy' or 'warn', not {self.race_policy!r}"
            )
        if self.error_policy not in ("raise", "skip"):
            raise ConfigError(f"error_policy must be 'raise' or 'skip', not {self.error_policy!r}")
        if self.copy not in ("async", "sync", "auto"):
            raise ConfigError(f"copy must be 'async', 'sync' or 'auto', not {self.copy!r}")
        if not _positive_int(self.budget_bytes) or self.budget_bytes < 4096:
            raise ConfigError(f"budget_bytes={self.budget_bytes!r} is too small (at least 4096)")
        if self.writers is not None and not _positive_int(self.writers):
            raise ConfigError(f"writers must be a positive int or None, got {self.writers!r}")
        if not _positive_int(self.max_backlog):
            raise ConfigError(f"max_backlog must be a positive int, got {self.max_backlog!r}")
        if self.encoding is not None and not isinstance(self.encoding, DeltaPolicy):
            raise TypeError(f"encoding must be a dstt.DeltaPolicy or None, not {self.encoding!r}")
        if self.retention is not None:
            if not isinstance(self.retention, Retention):
                raise TypeError(
                    f"retention must be a dstt.Retention or None, not {self.retention!r}"
                )
            check_policy(self.retention)
        if self.replay is not None:
            _check_factory(self.replay)
        for name in ("rank_timeout", "start_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        object.__setattr__(self, "resume", bool(self.resume))
        object.__setattr__(self, "verify", bool(self.verify))
        object.__setattr__(self, "summaries", bool(self.summaries))

    @classmethod
    def of(cls, run: RunArg, **options: Any) -> SessionOptions:
        """``SessionOptions(run=run, **options)`` with an error that names an unknown option
        (a misspelt keyword would otherwise be a bare ``TypeError`` from the constructor)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            import difflib

            hints = [
                f"{u!r}"
                + (
                    f" (did you mean {c[0]!r}?)"
                    if (c := difflib.get_close_matches(u, sorted(known), n=1))
                    else ""
                )
                for u in unknown
            ]
            raise ConfigError(
                f"unknown session option(s) {', '.join(hints)}; the options are "
                f"{', '.join(sorted(known - {'run'}))}"
            )
        return cls(run=run, **options)

    @property
    def writer_threads(self) -> int:
        """``writers``, or the default for this machine."""
        if self.writers is not None:
            return self.writers
        # leave a core to training: on 2 cores, more writers only steal CPU from the step
        return min(4, max(1, (os.cpu_count() or 2) - 1))

    def replace(self, **changes: Any) -> SessionOptions:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_factory(spec: object) -> None:
    """``replay=``: ``FILE.py:FUNCTION`` naming a file that exists (imported only when the
    run is opened with ``replay=True``)."""
    if not isinstance(spec, str):
        raise ConfigError(f"replay must be 'FILE.py:FUNCTION' or None, not {spec!r}")
    file, sep, name = spec.rpartition(":")
    if not sep or not file.endswith(".py") or not name.isidentifier():
        raise ConfigError(
            f"replay takes FILE.py:FUNCTION (e.g. replay='train.py:make', a function that "
            f"returns run.rebuild's objects as a dict), not {spec!r}"
        )
    if not os.path.isfile(file):
        raise ConfigError(f"replay={spec!r}: no file {file!r} (from {os.getcwd()})")
