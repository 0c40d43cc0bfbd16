"""Child for the orphan test: a trainer that hands its flusher a step's commit, then dies.

    python orphan_child.py RUN

Starts a flusher process, stops it (SIGSTOP), and commits one flat step through it: the
commit request goes into the pipe and waits there. Prints ``flusher <pid>``, then ``sent``
once the request is in the pipe; the test then SIGKILLs this process.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dstt.store import Repository
from dstt.store.flusher import parent as flusher_mod
from store.commit.test_stepcommit import _commit_step


def main(run: str) -> None:
    fl = flusher_mod.Flusher(1 << 16, 2)
    assert fl.proc is not None
    os.kill(fl.proc.pid, signal.SIGSTOP)
    print(f"flusher {fl.proc.pid}", flush=True)
    send = flusher_mod._send

    def sending(out: IO[bytes], msg: Any) -> None:
        send(out, msg)
        if msg[0] == "commit":
            print("sent", flush=True)

    flusher_mod._send = sending
    _commit_step(Repository.create(run), fl, 5)  # waits for a reply that never comes
    print("committed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
