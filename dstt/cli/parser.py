"""The parser of every ``dstt`` command and ``main``: the flags and help texts, and which
exception becomes which exit code (the codes and how the run is found: the package
docstring). The commands themselves are in ``inspect``, ``changes``, ``replay``, ``rebuild``
and ``imports``: a command is read there, its flags here.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import TYPE_CHECKING, Any

from dstt.errors import DsttError

from .changes import (
    cmd_gc,
    cmd_rollback,
    cmd_timeline_delete,
    cmd_timeline_list,
    cmd_timeline_rename,
    cmd_timeline_switch,
)
from .common import BAD_INPUT, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_PIPE, EXIT_RUN, _command, _Parser
from .explain import add_explain
from .imports import add_import
from .inspect import cmd_diff, cmd_export, cmd_index, cmd_log, cmd_ls, cmd_show, cmd_verify
from .rebuild import cmd_rebuild
from .replay import cmd_replay
from .virtual import add_virtual

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["build_parser", "main"]


def _nonneg(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {v}")
    return v


def _indices(s: str) -> list[int]:
    """``25,285,868`` -> [25, 285, 868] (sample indices: whole numbers >= 0)."""
    return [_nonneg(part.strip()) for part in s.split(",") if part.strip()]


def _force(sp: Any) -> None:
    sp.add_argument(
        "--force",
        action="store_true",
        help="change timelines even while a live writer (training) holds the run's lock",
    )


def _positive(s: str) -> int:
    v = _nonneg(s)
    if v == 0:
        raise argparse.ArgumentTypeError("expected a number >= 1, got 0")
    return v


def _window(s: str) -> int:
    v = _nonneg(s)
    if v < 2:
        raise argparse.ArgumentTypeError(
            f"expected a spike window >= 2 (the steps before a value it is compared with), got {v}"
        )
    return v


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {s}")
    return v


EPILOG = """\
the run: RUN (the optional first argument of ls, log, show, diff, verify, rollback, gc) or
--run PATH, else $DSTT_RUN, else the current directory; any folder inside a run finds it, as
git finds a repository (diff: "dstt diff [RUN] A B", the run before the two steps).

exit codes: 0 ok, 1 verify found problems, 2 usage or bad input, 3 run unreadable/locked/
damaged, 4 internal error (a bug: please report it), 141 stdout closed early (dstt log | head)
"""


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--run",
        metavar="PATH",
        default=argparse.SUPPRESS,
        help="the run, or a folder inside it (default: $DSTT_RUN, else the current directory)",
    )
    common.add_argument(
        "--json",
        action="store_true",
        default=argparse.SUPPRESS,
        help="print one JSON document for scripts",
    )
    p = _Parser(
        prog="dstt",
        parents=[common],
        description="Inspect and travel through a dstt run.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    add = functools.partial(_command, sub, common)

    def timeline(sp: Any) -> None:
        sp.add_argument("--timeline", help="timeline to read (default: the current one)")

    def optim(sp: Any, verb: str) -> None:
        sp.add_argument(
            "--optim",
            action="store_true",
            help=f"{verb} optimizer states too (default: model tensors only)",
        )

    sp = add("ls", cmd_ls, "overview: timelines, steps, arrays")
    sp = add("log", cmd_log, "committed steps, newest first, with logged metrics and spikes")
    timeline(sp)
    sp.add_argument("-n", type=_nonneg, default=0, help="show at most N steps (0: all)")
    sp.add_argument(
        "--spikes", metavar="METRIC", help="mark spikes of this metric (default: loss, when logged)"
    )
    sp.add_argument(
        "--window",
        type=_window,
        metavar="N",
        help="spike rule: the steps before a value its noise is measured over (default: 100)",
    )
    sp.add_argument(
        "--z",
        type=_positive_float,
        metavar="Z",
        help="spike rule: robust standard deviations above the local level (default: 6)",
    )
    sp.add_argument(
        "--batches",
        action="store_true",
        help="show each step's batch: its sample indices or hash (s.data records them)",
    )
    sp = add("show", cmd_show, "tensors of one step: norms, update ratios, bytes on disk")
    sp.add_argument("--step", type=int, help="the step (default: the head)")
    sp.add_argument(
        "--select",
        help="layer selector, at any depth of the names: "
        "'layers.0.self_attn', 'layers.*.mlp', 'q_proj.weight', 'experts.0'",
    )
    optim(sp, "list")
    timeline(sp)
    sp = add("diff", cmd_diff, "per-tensor change norms from step A to step B")
    sp.add_argument("a", type=int, metavar="A")
    sp.add_argument("b", type=int, metavar="B")
    sp.add_argument("--select", help="restrict to a layer selector")
    optim(sp, "compare")
    sp.add_argument("--top", type=_nonneg, default=20, help="largest N changes (0: all)")
    sp.add_argument("--timeline", help="timeline of A (default: the current one)")
    sp.add_argument(
        "--timeline-b",
        metavar="TIMELINE",
        help="timeline of B, to compare two timelines (default: that of A)",
    )
    sp = add("verify", cmd_verify, "check every committed byte against its checksum")
    sp.add_argument(
        "--repair",
        action="store_true",
        help="first rebuild lost or damaged metadata from what survives (root zarr.json, "
        "headers from the index, refs and HEAD from the headers), then the index",
    )
    sp = add("index", cmd_index, "rebuild the run's index from the commit headers")
    sp = add("rollback", cmd_rollback, "start a new timeline at an old step (old one kept)")
    sp.add_argument("--to", type=int, required=True, metavar="STEP")
    sp.add_argument(
        "--skip-data",
        type=_nonneg,
        default=0,
        metavar="N",
        help="batches to skip when training resumes there",
    )
    sp.add_argument(
        "--name",
        help="name of the new timeline (default: <timeline>-from-STEP;"
        " a second rollback to the same step needs one)",
    )
    sp.add_argument(
        "--skip-samples",
        type=_indices,
        default=None,
        metavar="I,J,...",
        help="dataset indices of samples sessions resumed there skip "
        "(e.g. the worst samples of a replay: 25,285,868)",
    )
    sp.add_argument("--timeline", help="timeline STEP is on (default: the current one)")
    _force(sp)
    sp = add("timeline", None, "list, switch, rename or delete timelines", run=False)
    tsub = sp.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    tsub.required = True

    tadd = functools.partial(_command, tsub, common)
    tadd(
        "list",
        cmd_timeline_list,
        "every timeline: commits, steps, where it forked (* marks the current one)",
    )
    tp = tadd("switch", cmd_timeline_switch, "make a timeline current (what training resumes)")
    tp.add_argument("name", metavar="NAME")
    _force(tp)
    tp = tadd(
        "rename",
        cmd_timeline_rename,
        "rename a timeline (timelines forked from it "
        "follow; commits keep the name they were written under)",
    )
    tp.add_argument("old", metavar="OLD")
    tp.add_argument("new", metavar="NEW")
    _force(tp)
    tp = tadd(
        "delete",
        cmd_timeline_delete,
        "delete a timeline (not the current one) and the "
        "steps only it had; steps shared with other timelines stay",
    )
    tp.add_argument("name", metavar="NAME")
    tp.add_argument("--yes", action="store_true", help="really delete (required)")
    tp.add_argument("--dry-run", action="store_true", help="say what it would free, delete nothing")
    _force(tp)
    sp = add("gc", cmd_gc, "prune old steps (timeline heads are always kept)")
    sp.add_argument("--keep-last", type=_nonneg, metavar="N", help="keep the last N steps")
    sp.add_argument("--keep-every", type=_positive, metavar="K", help="keep steps divisible by K")
    sp.add_argument(
        "--spike-window",
        type=_nonneg,
        metavar="W",
        help="keep every step within W steps of a spike of --spike-metric",
    )
    sp.add_argument(
        "--spike-metric",
        default="loss",
        metavar="NAME",
        help="the metric whose spikes are kept (default: loss)",
    )
    sp.add_argument(
        "--spike-z",
        type=_positive_float,
        metavar="Z",
        help="a spike is a value Z robust standard deviations above its local level "
        "(the rule of dstt log and run.spikes(); default: 6)",
    )
    sp.add_argument(
        "--spike-baseline",
        type=_window,
        metavar="N",
        help="the spike rule's window: the N steps before a value (default: 100)",
    )
    sp.add_argument(
        "--dry-run", action="store_true", help="list the steps it would prune, delete nothing"
    )
    sp = add(
        "replay",
        cmd_replay,
        "re-execute a past step from your script: faithful?, "
        "gradient norms, the samples with the largest loss",
    )
    sp.add_argument("--step", type=int, required=True, help="the step to replay")
    sp.add_argument(
        "--script",
        required=True,
        metavar="FILE.py:FUNCTION",
        help="a function returning {'model', 'optimizer', and any of 'scheduler', "
        "'dataset', 'collate', 'batches', 'loss_fn'}, built as training built them",
    )
    sp.add_argument("--top", type=_positive, default=10, help="tensors and samples to list")
    sp.add_argument(
        "--sample-grads",
        action="store_true",
        help="also each sample's gradient norm (one backward per sample)",
    )
    timeline(sp)
    sp = add(
        "rebuild",
        cmd_rebuild,
        "rebuild light steps (every='auto') by replay and write them to the run, "
        "so later reads need no factory",
    )
    sp.add_argument(
        "--steps",
        default="light",
        metavar="SPEC",
        help="a step (12), an inclusive range (10:40; stored steps in it are skipped) or "
        "'light': every light step not yet rebuilt (default)",
    )
    sp.add_argument(
        "--script",
        metavar="FILE.py:FUNCTION",
        help="a function returning the objects training built ('model', 'optimizer', "
        "'dataset', 'loss_fn', ...; as dstt replay's) (default: the factory the run's "
        "sessions recorded, dstt.session(..., replay='train.py:make'))",
    )
    timeline(sp)
    sp = add(
        "export",
        cmd_export,
        "write one step as files torch or transformers load: the "
        "model, model + optimizer + scheduler, or a from_pretrained folder",
    )
    sp.add_argument("--step", type=int, help="the step (default: the head)")
    sp.add_argument(
        "--format",
        choices=("safetensors", "torch", "hf", "dcp"),
        default="safetensors",
        help="safetensors: the model (tied names included); torch: torch.save of "
        "model, optimizer and scheduler state dicts; hf: a folder with "
        "model.safetensors and config.json that from_pretrained opens; dcp: a "
        "torch.distributed.checkpoint folder, loaded at any world size",
    )
    sp.add_argument(
        "-o",
        "--out",
        help="output file, or a folder (an existing one, or a path "
        "ending in /) to write step<S>.safetensors|.pt into; hf, dcp: the folder "
        "(default: ./step<S>.safetensors|.pt, ./step<S>-hf/, ./step<S>/); missing "
        "folders are created",
    )
    sp.add_argument(
        "--config",
        metavar="PATH",
        help="hf: the model's config.json, or a folder "
        "holding one (default: the config the run stored, from a Hugging Face "
        "model)",
    )
    sp.add_argument("--force", action="store_true", help="replace the output file if it exists")
    sp.add_argument(
        "--all",
        action="store_true",
        help="also every other array under its store path (safetensors: optimizer "
        "states too; torch: under 'arrays')",
    )
    timeline(sp)
    add_import(sub, common)
    add_virtual(sub, common)
    add_explain(sub, common)
    return p


def _drop_stdout() -> None:
    """After a closed pipe: point stdout at /dev/null so the interpreter's final flush cannot
    fail again (the pattern of the Python docs, "Note on SIGPIPE")."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is no file (captured in a test)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the ``dstt`` script exits with it)."""
    try:
        args = build_parser().parse_args(argv)
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
        return code
    except SystemExit as e:  # --help, --version
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_BAD_INPUT
    except BrokenPipeError:  # dstt log | head: the reader has all it wants
        _drop_stdout()
        return EXIT_PIPE
    except BAD_INPUT as e:
        print(f"dstt: {str(e) or type(e).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (DsttError, OSError) as e:  # OSError: reading or writing the run (EIO, EACCES)
        print(f"dstt: {str(e) or type(e).__name__}", file=sys.stderr)
        return EXIT_RUN
    except KeyboardInterrupt:
        print("dstt: interrupted", file=sys.stderr)
        return 130
    except Exception:
        import traceback  # here: its import (linecache, tokenize) is for a bug's report only

        traceback.print_exc()
        print(
            "dstt: internal error (a bug in dstt; please report it with the traceback above)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
