"""``dstt``: the command line over a run (``ls log show diff verify index rollback timeline
gc export replay rebuild import virtual explain``). Thin by design: argparse, one call into
:mod:`dstt.run` (or the store behind it), printing. Modules: ``parser`` (every command's flags,
``main`` and the exit codes), ``common`` (what every command shares), ``inspect`` (the
commands that look at a run), ``changes`` (rollback, timeline, gc), ``replay``, ``rebuild``,
``imports`` (``dstt import``), ``virtual`` (``dstt virtual``), ``explain`` (``dstt explain``);
``__main__`` runs ``main``. Nothing in dstt imports this package; commands that print no
arrays import no xarray, pandas or torch. The run is found as git finds a repository; exit
codes: 0 ok, 1 verify found problems, 2 bad input, 3 the run, 4 a bug, 141 a closed pipe.
Rejected alternatives: click/typer — a dependency for eight subcommands that argparse covers;
exit 0 on a closed pipe — a script could not tell a truncated listing from a complete one.
Details: docs/decisions.md, "Module notes".
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
