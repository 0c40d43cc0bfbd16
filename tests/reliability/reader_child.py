"""Child of ``test_concurrency``: reads a run in a loop while another process changes it.

    python reader_child.py follow RUN      # a writer is committing: follow the new steps
    python reader_child.py random RUN      # gc is pruning: read random steps, old views too

It stops when its stdin is closed (after finishing the current pass). A ``sync`` line on stdin
makes it print ``sync`` at the start of its next pass, so the parent knows that pass began
after the request. Lines:

* ``seen <step> <sha256>``: the parameters of ``step`` read back (through ``dstt.open``,
  ``at``, ``trajectory``), every chunk crc-checked by the reader;
* ``gone <step>``: reading the step raised ``StepNotFoundError`` (pruned by gc);
* ``iter <n>``: one pass done; ``n`` committed steps were visible (``follow``);
* ``ls <n>``: ``dstt ls --json`` (another process) reported ``n`` steps;
* ``bad <message>``: anything else — steps not monotone, an unexpected error.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import traceback
from typing import Any

import numpy as np

import dstt
from dstt.errors import NotARunError, StepNotFoundError

TENSOR = "layers.0.qkv.weight"


def say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def digest(snap: Any) -> str:
    h = hashlib.sha256()
    for name in sorted(snap.names()):
        h.update(np.ascontiguousarray(snap.to_numpy(name)).tobytes())
    return h.hexdigest()


def rows(run: Any, steps: slice) -> None:
    """One tensor over ``steps`` as a lazy trajectory; a ``row`` line per step read."""
    traj = run.trajectory(TENSOR, steps=steps)
    values = traj.values
    for i, s in enumerate(traj["step"].values):
        say(f"row {int(s)} {hashlib.sha256(values[i].tobytes()).hexdigest()}")


def follow(path: str, stop: threading.Event, sync: threading.Event) -> None:
    prev: list[int] = []
    rng = random.Random(0)
    n = 0
    while True:
        last_pass = stop.is_set()
        if sync.is_set():
            sync.clear()
            say("sync")
        try:
            run = dstt.open(path)
        except NotARunError:  # the writer has not created the run yet
            if last_pass:
                return
            continue
        steps = run.steps
        if steps != list(range(1, len(steps) + 1)):
            say(f"bad steps are not 1..n: {steps}")
        if steps[: len(prev)] != prev:
            say(f"bad steps went backwards: {prev[-3:]} -> {steps[-3:]}")
        prev = steps
        if steps:
            for s in {steps[-1], rng.choice(steps)}:
                say(f"seen {s} {digest(run.at(s))}")
            rows(run, slice(rng.choice(steps), None))
        if n % 4 == 0:
            out = subprocess.run(
                [sys.executable, "-m", "dstt.cli", "ls", "--run", path, "--json"],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                say(f"bad dstt ls exited {out.returncode}: {out.stderr.strip()[-300:]}")
            else:
                k = json.loads(out.stdout)["n_steps"]
                say(f"ls {k}")
                if k < len(steps):
                    say(f"bad dstt ls saw {k} steps after {len(steps)} were visible")
        say(f"iter {len(steps)}")
        n += 1
        if last_pass:
            return


def random_reads(path: str, stop: threading.Event, sync: threading.Event) -> None:
    held = dstt.open(path)  # a view opened before gc, kept: its headers go stale
    known = list(held.steps)
    rng = random.Random(1)
    n = 0
    while not stop.is_set():
        run = held if n % 2 == 0 else dstt.open(path)
        s = rng.choice(known)
        try:
            if n % 3 == 2:
                s = rng.choice(known)
                rows(run, slice(s, s + 3))
            else:
                say(f"seen {s} {digest(run.at(s))}")
        except StepNotFoundError as e:
            say(f"gone {s} {str(e)[:80]!r}")
        n += 1
        say(f"iter {n}")


def main(mode: str, path: str) -> None:
    stop, sync = threading.Event(), threading.Event()

    def watch() -> None:
        for line in sys.stdin:
            if line.strip() == "sync":
                sync.set()
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        (follow if mode == "follow" else random_reads)(path, stop, sync)
    except Exception:
        say("bad " + traceback.format_exc().replace("\n", " | ")[-1500:])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
