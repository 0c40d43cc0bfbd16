"""``dstt explain [--step K]``: why a loss spiked — each mechanism checked, ranked, with its
evidence (:meth:`dstt.Run.explain`, stored-state checks only: replay needs the user's model
and data, which a command line does not have).

Thin, as every command: parse → :meth:`dstt.Run.explain` → print. Exit codes: 0 explained,
2 bad input (not a run, no spike and no step given, a step not on the timeline).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common import _P, _command, _emit, _fields, _resolve_run

if TYPE_CHECKING:
    import argparse

__all__ = ["add_explain", "cmd_explain"]


def add_explain(sub: argparse._SubParsersAction[_P], common: _P) -> None:
    """The ``explain`` subcommand's parser."""
    what = (
        "why the loss spiked at a step: each mechanism (bad data, update too large, "
        "attention logit growth, Adam's second moment, numerics) checked and ranked"
    )
    sp = _command(sub, common, "explain", cmd_explain, what)
    sp.add_argument(
        "--step",
        type=int,
        metavar="K",
        help="the spike's first step (default: the largest spike, else the first NaN loss)",
    )
    sp.add_argument("--metric", default="loss", help="the metric that spiked (default: loss)")
    sp.add_argument(
        "--heads", type=int, help="attention heads per layer (default: as the run recorded them)"
    )
    sp.add_argument("--timeline", help="timeline to read (default: the current one)")


def cmd_explain(args: argparse.Namespace) -> int:
    run = _resolve_run(args)
    ex = run.explain(args.step, metric=args.metric, heads=args.heads, timeline=args.timeline)
    doc = {
        **_fields(ex, "step cause parent timeline seconds"),
        "findings": [
            _fields(f, "mechanism verdict score points_at hint evidence read") for f in ex.findings
        ],
    }
    return _emit(args, doc, lambda: str(ex).splitlines())
