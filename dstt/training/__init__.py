"""The training side: the session around a user's loop, and what it captures per kind of
training (plain PyTorch, PyTorch-native parallelism, DeepSpeed). Modules: ``factory``
(``session()``, ``open_session()``), ``options`` (``SessionOptions``), ``session``
(``Session``), ``steps`` (``StepCapture``: what the hooks do per step), ``distributed``
(``RankedSession``, ``DistributedSession``), ``deepspeed`` (``DeepSpeedSession``),
``stopping`` (a Ctrl-C while closing), ``checks``, ``metrics``, ``retention``, ``data``
(up-front checks, ``s.log``, background gc, data attribution), ``imported`` (resuming an
imported step). Imports flow store ← engine ← training. It is ``training``, not ``session``:
a ``dstt.session`` package would shadow the ``dstt.session(...)`` function as soon as one of
its modules was imported. Rejected alternative: importing the multi-rank sessions with the
package (a plain session's start would import them). Details: docs/decisions.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dstt._lazy import lazy_names as _lazy_names

from .factory import open_session, session
from .options import CopyMode, ErrorPolicy, RacePolicy, SessionOptions
from .session import Session

if TYPE_CHECKING:
    from .deepspeed import DeepSpeedSession
    from .distributed import DistributedSession, RankedSession

__all__ = [
    "CopyMode",
    "DeepSpeedSession",
    "DistributedSession",
    "ErrorPolicy",
    "RacePolicy",
    "RankedSession",
    "Session",
    "SessionOptions",
    "open_session",
    "session",
]

#: the multi-rank sessions load on first use: a plain session's start imports neither
_HOME = {
    "DeepSpeedSession": "deepspeed",
    "DistributedSession": "distributed",
    "RankedSession": "distributed",
}


__getattr__, __dir__ = _lazy_names(__name__, _HOME, __all__)
