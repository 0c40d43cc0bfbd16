"""The training side: the session around a user's loop, and what it captures per kind of
training (plain PyTorch, PyTorch-native parallelism, DeepSpeed).

* ``factory``   — ``session()`` / ``open_session()``: picks the session class for what it is given;
* ``options``   — ``SessionOptions``: every knob, frozen and validated once;
* ``session``   — ``Session``: construction, lifecycle, resume (plain PyTorch);
* ``steps``     — ``StepCapture``, held by a session: what its hooks do per step;
* ``distributed`` — ``RankedSession`` (what every multi-rank session shares) and
  ``DistributedSession``: one rank of DDP, FSDP2, tensor parallel;
* ``deepspeed`` — ``DeepSpeedSession``: one rank of a DeepSpeed engine;
* ``stopping`` — ``finish_before_interrupt``: a Ctrl-C while a session closes commits first;
* ``checks``, ``metrics``, ``retention``, ``data`` — up-front checks and skipped-step
  reports, ``s.log``, background gc, data attribution;
* ``imported`` — resuming a step ``dstt import`` brought in: what its source did not hold.

Imports flow store ← engine ← training; nothing in the engine or the store imports this
package. (It is ``training``, not ``session``: a ``dstt.session`` package would shadow the
``dstt.session(...)`` function as soon as one of its modules was imported.)
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
