"""``dstt import SRC... --run R``: checkpoints already on disk become steps of a run.

Thin, as every command: parse → :func:`dstt.integrations.imports.import_checkpoints` → print.
The run is ``--run`` or ``$DSTT_RUN`` (created if new; a folder inside an existing run finds
it), else the run the current directory is in. Exit codes: 0 every source imported (or
already there), 1 some source was reported and skipped (unreadable, partial, refused pickle,
not after the run's head), 2 bad input (no run given, nothing importable found, ``--step``
with several sources).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .common import _P, UsageError, _bar, _command, _emit, _fields, _run_root

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator

__all__ = ["add_import", "cmd_import"]


def add_import(sub: argparse._SubParsersAction[_P], common: _P) -> None:
    """The ``import`` subcommand's parser."""
    what = (
        "import checkpoints (HF Trainer folders, torch.save files, DCP folders, DeepSpeed "
        "tags, Lightning .ckpt) as steps of a run"
    )
    sp = _command(sub, common, "import", cmd_import, what, run=False)
    sp.add_argument(
        "sources",
        nargs="+",
        metavar="SRC",
        help="a checkpoint file or folder, or a folder holding them (one level "
        "down: checkpoint-*/, global_step*/, *.ckpt, step-*/, *.pt)",
    )
    sp.add_argument("--step", type=int, help="the step of a single SRC that does not say it")
    sp.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle files that need more than torch.load(weights_only=True) "
        "(only for checkpoints you trust: unpickling can run code)",
    )
    sp.add_argument(
        "--delta",
        action="store_true",
        help="store each step as deltas from the previous one where smaller (dstt.DeltaPolicy)",
    )
    sp.add_argument(
        "--no-summaries",
        action="store_true",
        help="skip the write-time statistics of every parameter",
    )


def _run_path(args: argparse.Namespace) -> str:
    """``--run``/``$DSTT_RUN`` — a new run when nothing is there yet — else found as every
    command finds its run (a folder inside it, the current directory)."""
    from dstt.run import find_run_root

    path = getattr(args, "run", None) or os.environ.get("DSTT_RUN")
    if path and (not os.path.exists(path) or (os.path.isdir(path) and find_run_root(path) is None)):
        return str(path)
    return _run_root(args)


def cmd_import(args: argparse.Namespace) -> int:
    from dstt.errors import SourceError
    from dstt.integrations.imports import find_sources, import_checkpoints
    from dstt.store._internal import DeltaPolicy

    run = _run_path(args)
    try:
        found, unknown, _ = find_sources(args.sources, step=args.step)
    except SourceError as e:
        raise UsageError(str(e)) from None
    if not found:
        reasons = "; ".join(f"{u.path}: {u.reason}" for u in unknown)
        raise UsageError(f"nothing to import: {reasons or 'no source given'}")
    with _bar(args, len(found), "ckpt") as bar:
        report = import_checkpoints(
            args.sources,
            run,
            step=args.step,
            trusted=args.trusted,
            encoding=DeltaPolicy() if args.delta else None,
            summaries=not args.no_summaries,
            progress=lambda done, total, src: bar.update(1),
        )
    doc = {
        **_fields(report, "run seconds bytes_read"),
        "imported": [_fields(i, "step source format slot lacks") for i in report.imported],
        "skipped": [_fields(s, "source step reason problem") for s in report.skipped],
        "ignored": [_fields(u, "path reason") for u in report.ignored],
    }

    def text() -> Iterator[str]:
        for i in report.imported:
            lacks = f"  (no {', no '.join(i.lacks)})" if i.lacks else ""
            yield f"imported step {i.step:>8}  {i.format:<11} {i.source}{lacks}"
        for s in report.skipped:
            step = f"step {s.step}" if s.step is not None else "step ?"
            yield f"{'skipped' if s.problem else 'kept'} {step}  {s.source}: {s.reason}"
        mb = report.bytes_read / 1e6
        yield (
            f"{len(report.imported)} imported into {report.run} ({mb:.1f} MB read in "
            f"{report.seconds:.1f} s), {sum(s.problem for s in report.skipped)} skipped"
        )

    return _emit(args, doc, text, ok=report.ok)
