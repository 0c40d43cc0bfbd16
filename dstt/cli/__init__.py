"""``dstt``: the command line over a run (``ls log show diff verify index rollback timeline
gc export replay import virtual explain``).

Thin by design: argparse, one call into :mod:`dstt.run` (or the store behind it), printing.

* ``parser``   — ``build_parser`` and ``main`` (the ``dstt`` script): every command's flags,
  and the exit code of each kind of error;
* ``common``   — what every command shares: exit codes, which errors are the user's input,
  finding the run, printing (text or ``--json``), progress bars;
* ``inspect``  — the commands that look at a run: ls, log, show, diff, verify, index, export;
* ``changes``  — the commands that change it: rollback, the timeline group, gc;
* ``replay``   — re-executing a step from the user's script;
* ``imports``  — ``dstt import``: checkpoints other tools wrote, as steps of a run;
* ``virtual``  — ``dstt virtual``: a timeline as one virtual Zarr store (references);
* ``explain``  — ``dstt explain``: why the loss spiked (``run.explain``).

Nothing in dstt imports this package; it sits above the run, inspection and the integrations
(``dstt import``). ``python -m dstt.cli`` runs ``main`` (``__main__``). Commands that print no
arrays import no xarray, pandas or torch: each command module imports what it needs when it
runs.

The run is the optional first positional ``RUN`` of a command or ``--run PATH``, else
``$DSTT_RUN``, else the current directory; whichever is given may be any folder inside the run,
which is found the way git finds a repository: the nearest of the folder and its parents that
is a run (holds ``zarr.json`` with dstt attributes and ``_dstt/``). So ``dstt rollback --to
1180`` works from anywhere inside the run. ``--json`` prints one JSON document on stdout for
scripts; progress bars (tqdm) go to stderr on a terminal only.

Exit codes: 0 ok · 1 ``verify`` found problems · 2 usage or bad input (no run there, unknown
step, timeline, tensor or metric, bad flag) · 3 the run could not be read or written (locked by
a writer, damaged, I/O error), or any other ``DsttError`` · 4 internal error (a bug; the
traceback is printed) · 141 stdout was closed early (``dstt log | head``): the rest is dropped
quietly, as a tool killed by SIGPIPE would exit (128 + 13). User mistakes are ``DsttError``s,
so "internal error" means a bug. Errors are one line on stderr, ``dstt: <what is wrong and what
to do>``, without a traceback.

Rejected alternatives: click/typer — a dependency for eight subcommands that argparse covers;
exit 0 on a closed pipe — a script could not tell a truncated listing from a complete one.
"""

from __future__ import annotations

from .common import EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_OK, EXIT_PIPE, EXIT_PROBLEMS, EXIT_RUN
from .parser import main

__all__ = [
    "EXIT_BAD_INPUT",
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_PIPE",
    "EXIT_PROBLEMS",
    "EXIT_RUN",
    "main",
]
