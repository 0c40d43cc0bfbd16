"""Index segments written by a short-lived job process, so training never pays for them.

Building a segment's rows is Python over every array of every queued commit (~1 s at 1,200
tensors and 64 commits); on the committer thread it held the GIL the training thread needs
(a 360-tensor loop went from 2.4x to 7x no checkpointing). So for a run on local files the
writer hands the queued slots to ``python -m dstt.store.read._index_main`` (no torch,
``SCHED_IDLE``, its own process group) and goes on committing; one job at a time. The job
writes only rows the index would hold anyway, each segment durable before a merge deletes its
inputs, so a killed job leaves a valid index.

Rejected alternatives: a thread (the same GIL), the flusher process (it serves the hot path and
knows no run), and a job per commit (an interpreter start per step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING

from dstt.store.storage.local import LocalStorage

if TYPE_CHECKING:
    from dstt.store.storage.base import Storage

__all__ = ["IndexJob"]


class IndexJob:
    """One running job process writing the rows of ``slots``."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc
        self.error = ""

    @staticmethod
    def supported(storage: Storage) -> bool:
        """For runs on local files (a job opens the run by its path), unless
        ``DSTT_INDEX_JOBS=0``."""
        return type(storage) is LocalStorage and os.environ.get("DSTT_INDEX_JOBS", "1") != "0"

    @classmethod
    def start(cls, location: str, slots: list[int], every: int) -> IndexJob | None:
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dstt.store.read._index_main"],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                process_group=0,  # a terminal's Ctrl-C is the writer's to handle, not the job's
            )
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"run": location, "slots": slots, "every": every}).encode())
            proc.stdin.close()
        except OSError:
            return None
        return cls(proc)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def wait(self) -> None:
        """Wait for the job to exit; keep the tail of its stderr and close that pipe (once:
        a job found done by ``done()`` still holds it, and an unclosed pipe is a
        ``ResourceWarning`` when the object goes)."""
        pipe = self.proc.stderr
        if pipe is not None and not pipe.closed:
            err = pipe.read()  # before waiting: a full pipe would block the job's exit
            pipe.close()
            self.error = err.decode(errors="replace")[-2000:]
        self.proc.wait()

    @property
    def ok(self) -> bool:
        self.wait()
        return self.proc.returncode == 0
