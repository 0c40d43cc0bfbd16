"""A Ctrl-C while a session closes: the last steps are committed first, then it stops.

Closing a session drains the steps still in flight and commits them. While
:func:`finish_before_interrupt` is active, a first Ctrl-C prints one line and is raised once
the close has finished; a second one (or the first, when the close itself is the answer to a
Ctrl-C) interrupts at once: the way out of a close that hangs. Rejected alternative: ignoring
SIGINT while closing — a hung close (a dead disk) could then not be interrupted at all. Only
the main thread can install a signal handler; elsewhere, and when a program installed its own
SIGINT handler, nothing changes. Details: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterator
    from types import FrameType

__all__ = ["finish_before_interrupt"]

MESSAGE = (
    "dstt: Ctrl-C — committing the steps already trained before stopping "
    "(Ctrl-C again to abandon them)"
)


@contextmanager
def finish_before_interrupt(*, again: bool = False) -> Iterator[None]:
    """Defer a first SIGINT until the block ends, then raise it as ``KeyboardInterrupt``;
    ``again``: a Ctrl-C was already received, so the next one interrupts at once."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    hits = [again]

    def deferred(signum: int, frame: FrameType | None) -> None:
        if hits[0]:
            raise KeyboardInterrupt
        hits[0] = True
        print(MESSAGE, file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, deferred)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if hits[0] and not again:
        raise KeyboardInterrupt
