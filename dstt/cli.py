"""``dstt``: the command line over a run (``ls log show diff verify index rollback timeline
gc export``).

Thin by design: argparse, one call into :mod:`dstt._run` (or the store behind it), printing.
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

import argparse
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ._cli_changes import (
    cmd_gc,
    cmd_rollback,
    cmd_timeline_delete,
    cmd_timeline_list,
    cmd_timeline_rename,
    cmd_timeline_switch,
)
from ._cli_common import (
    BAD_INPUT,
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_PIPE,
    EXIT_PROBLEMS,
    EXIT_RUN,
    _bar,
    _counter,
    _emit,
    _fmt,
    _metrics_text,
    _Parser,
    _resolve_run,
    _when,
)
from .errors import (
    DsttError,
)

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERNAL", "EXIT_OK", "EXIT_PIPE", "EXIT_PROBLEMS", "EXIT_RUN",
           "main"]

def cmd_ls(args: argparse.Namespace) -> int:
    from .inspect.html import human_bytes

    s = _resolve_run(args).summary()

    def text() -> Iterator[str]:
        yield f"run {s['path']}  (current timeline: {s['timeline']})"
        steps = f"{s['n_steps']} steps ({s['first_step']} … {s['last_step']})" \
            if s["n_steps"] else "no steps yet"
        yield (f"{steps} · {s['n_arrays']} arrays · {human_bytes(s['bytes_per_step'])} per step"
               f" · metrics: {', '.join(s['metrics']) or '—'}")
        for t in s["timelines"]:
            rng = f"steps {t['first_step']} … {t['head_step']}" if t["commits"] else "empty"
            base = (f"  from {t['base_timeline']}@{t['base_step']} (skip {t['skip_data']})"
                    if t["base_timeline"] else "")
            yield f"{'*' if t['current'] else ' '} {t['name']:<24} {t['commits']:>7} commits  " \
                  f"{rng}{base}"
    _emit(args, s, text)
    return EXIT_OK


def cmd_log(args: argparse.Namespace) -> int:
    run = _resolve_run(args)
    line = list(reversed(run.commits(args.timeline, pruned=True)))
    if args.n:
        line = line[:args.n]
    spikes = _spikes(run, args)
    batches = (run.batches([h.step for h in line], timeline=args.timeline)
               if args.batches else {})
    doc = [{"step": h.step, "slot": h.slot, "timeline": h.timeline, "time": h.time,
            "metrics": dict(h.metrics), "objects": [] if h.pruned else sorted(h.objects),
            "pruned": bool(h.pruned), "spike": spikes.get(h.step)} for h in line]
    if args.batches:
        for d in doc:
            d["batches"] = [b.plain() for b in batches.get(d["step"], [])]

    def text() -> Iterator[str]:
        for h in line:
            sp = spikes.get(h.step)
            mark = (f"  <- {sp['metric']} spike (z={sp['zscore']:.1f}, baseline "
                    f"{sp['baseline']:.4g}; suspect {sp['suspect']})" if sp else "")
            data = "".join(f"  [{b}]" for b in batches.get(h.step, []))
            gone = "  (pruned)" if h.pruned else ""  # gc kept its metrics, not its tensors
            yield (f"step {h.step:>8}  {_when(h.time)}  {h.timeline}  "
                   f"{_metrics_text(h.metrics)}{data}{mark}{gone}")
    _emit(args, doc, text)
    return EXIT_OK


def _spikes(run: Any, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Spikes of ``--spikes METRIC`` (default ``loss``, skipped when never logged) by step."""
    metric = args.spikes or "loss"
    if args.spikes is None and metric not in run.metrics(args.timeline):
        return {}
    return {sp.step: {"metric": metric, "zscore": sp.zscore, "baseline": sp.baseline,
                      "tensors": [n for n, _ in sp.tensors], "cause": sp.cause,
                      "suspect": sp.suspect, "samples": sp.samples}
            for sp in run.spikes(metric, timeline=args.timeline, top=3)}


def _visible(snap: Any, optim: bool) -> list[str]:
    """Store paths a user sees at a snapshot: tensors (logical ones of ZeRO runs, not their
    flat sources), optimizer states only with ``optim``."""
    from .inspect.naming import optim_state
    from .inspect.sharded import shard_sources

    hidden = shard_sources(snap.arrays)
    return [p for p in sorted(snap.arrays)
            if p not in hidden and (optim or optim_state(p) is None)]


def _summary_of(run: Any, snap: Any) -> dict[str, tuple[float | None, float | None]]:
    """``{store path: (l2, update ratio)}`` from the step's write-time summaries (if any)."""
    ds = run.summaries(snap.step, timeline=snap.timeline)
    if ds.sizes.get("step", 0) == 0:
        return {}

    def val(x: Any) -> float | None:
        v = float(x)
        return v if math.isfinite(v) else None
    return {str(p): (val(ds["l2"].values[0, j]), val(ds["update_ratio"].values[0, j]))
            for j, p in enumerate(ds["store_path"].values)}


def cmd_show(args: argparse.Namespace) -> int:
    from .inspect.html import human_bytes
    from .inspect.naming import select, selector_miss, user_name
    from .inspect.sharded import LogicalRecord, shard_sources

    run = _resolve_run(args)
    snap = run.at(args.step, args.timeline)
    visible = _visible(snap, args.optim)
    # ZeRO runs: the flat buffers the logical tensors are views of are what is on disk
    sources = sorted(shard_sources(snap.arrays))
    paths = visible + [p for p in sources if p not in visible]
    if args.select:
        paths = select(args.select, paths)
        if not paths:
            raise selector_miss(args.select, visible, f"at step {snap.step}",
                                f"dstt show --step {snap.step}"
                                + (" --optim" if args.optim else ""))
    sums = _summary_of(run, snap)
    tensors = []
    for p in paths:
        rec = snap.arrays[p]
        stored = not isinstance(rec, LogicalRecord)
        l2, ratio = sums.get(p, (None, None))
        tensors.append({"name": user_name(p), "store_path": p, "dtype": rec.dtype,
                        "shape": list(rec.shape), "bytes": rec.plan.nbytes if stored else 0,
                        "stored": stored, "l2": l2, "update_ratio": ratio,
                        **(_stored(rec, snap.slot) if stored
                           else {"written_bytes": 0, "stored_as": ["view"]})})
    doc = {"step": snap.step, "slot": snap.slot, "timeline": snap.timeline, "time": snap.time,
           "metrics": snap.metrics, "objects": snap.objects, "optim": args.optim,
           "tensors": tensors}

    def text() -> Iterator[str]:
        yield f"step {snap.step} (timeline {snap.timeline}, slot {snap.slot}, {_when(snap.time)})"
        if snap.metrics:
            yield f"metrics: {_metrics_text(snap.metrics)}"
        yield f"objects: {', '.join(snap.objects) or '—'}"
        width = max((len(t["name"]) for t in tensors), default=10)
        yield (f"  {'tensor':<{width}}  {'dtype':<8} {'shape':<18} {'norm':>10} "
               f"{'upd ratio':>10} {'size':>10}  {'written':>10}  stored as")
        for t in tensors:
            size = human_bytes(t["bytes"]) if t["stored"] else "—"
            yield (f"  {t['name']:<{width}}  {t['dtype']:<8} {tuple(t['shape'])!s:<18} "
                   f"{_fmt(t['l2']):>10} {_fmt(t['update_ratio'], '.3g'):>10} {size:>10}  "
                   f"{human_bytes(t['written_bytes']):>10}  {'+'.join(t['stored_as'])}")
        real = [t for t in tensors if t["stored"]]
        size = sum(t["bytes"] for t in real)
        written = sum(t["written_bytes"] for t in real)
        views = len(tensors) - len(real)
        yield (f"{len(real)} stored arrays, {human_bytes(size)}; this step wrote "
               f"{human_bytes(written)} of them"
               + (f" ({size / written:.1f}x fewer bytes)" if 0 < written < size else "")
               + (f"; {views} tensors are views of the stored ZeRO shards" if views else ""))
        if not args.optim:
            yield "optimizer states not shown (--optim shows them)"
    _emit(args, doc, text)
    return EXIT_OK


_STORED_AS = {"raw": "raw", "xor1": "xor", "pred1": "pred"}


def _stored(rec: Any, slot: int) -> dict[str, Any]:
    """What the step put on disk for a tensor: bytes of the files written in its own slot,
    and how its chunks are stored (raw, xor, pred; ref = unchanged, an older file)."""
    from .store import key_slot

    mine = [c for c in rec.chunks if key_slot(c.key) == slot]
    kinds = {_STORED_AS.get(c.encoding, c.encoding) for c in mine}
    if len(mine) < len(rec.chunks):
        kinds.add("ref")
    return {"written_bytes": sum(c.nbytes for c in mine), "stored_as": sorted(kinds)}


def cmd_diff(args: argparse.Namespace) -> int:
    from .inspect.naming import select, selector_miss

    run = _resolve_run(args)
    ta = args.timeline or run.timeline
    tb = args.timeline_b or ta
    sa, sb = run.at(args.a, ta), run.at(args.b, tb)
    paths = sorted(set(_visible(sa, args.optim)) | set(_visible(sb, args.optim)))
    if args.select:
        paths = select(args.select, paths)
        if not paths:
            raise selector_miss(args.select, set(_visible(sa, True)) | set(_visible(sb, True)),
                                f"at steps {args.a} or {args.b}" + (
                                    "" if args.optim else " (optimizer states excluded)"),
                                f"dstt show --step {args.b}")
    with _bar(args, None, "B") as bar:
        ds = run.diff(args.a, args.b, timeline=ta, timeline_b=tb, paths=paths,
                      progress=bar.update)
    fields = ("delta_l2", "a_l2", "b_l2", "ratio", "max_abs_delta")
    rows: list[dict[str, Any]] = [
        {"name": str(n), "status": str(st), **{f: float(ds[f].values[i]) for f in fields}}
        for i, (n, st) in enumerate(zip(ds["tensor"].values, ds["status"].values, strict=True))]
    rows.sort(key=lambda r: -r["delta_l2"] if math.isfinite(r["delta_l2"]) else math.inf)
    shown = rows if args.top == 0 else rows[:args.top]
    doc = {"a": args.a, "b": args.b, "timeline_a": ta, "timeline_b": tb, "optim": args.optim,
           "tensors": shown, "total": len(rows)}

    def text() -> Iterator[str]:
        if tb != ta:
            yield f"A = step {args.a} of {ta}, B = step {args.b} of {tb}"
        width = max((len(r["name"]) for r in shown), default=10)
        yield f"{'tensor':<{width}}  {'||B-A||':>11} {'||A||':>11} {'ratio':>9} {'max|B-A|':>11}"
        for r in shown:
            if r["status"] != "both":
                yield f"{r['name']:<{width}}  ({r['status'].replace('_', ' ')})"
                continue
            yield (f"{r['name']:<{width}}  {r['delta_l2']:>11.4g} {r['a_l2']:>11.4g} "
                   f"{r['ratio']:>9.3g} {r['max_abs_delta']:>11.4g}")
        if len(shown) < len(rows):
            yield f"… {len(rows) - len(shown)} more (--top 0 shows all)"
        if not args.optim:
            yield "optimizer states not compared (--optim compares them)"
    _emit(args, doc, text)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from .store import Repository

    # the repository, not a Run: a Run reads HEAD and the refs up front, so a damaged one
    # would end here as "unreadable" (exit 3) instead of being reported as a problem
    run = _resolve_run(args, opener=Repository.open)
    with _bar(args, None, "commit") as bar:
        rep = run.verify(progress=_counter(bar), repair=args.repair)
    problems = [{"key": p.key, "message": p.message} for p in rep.problems]
    doc = {"ok": not problems, "problems": problems, "commits": rep.commits,
           "chunks": rep.chunks, "objects": rep.objects, "bytes": rep.bytes,
           "repaired": bool(args.repair)}

    def text() -> Iterator[str]:
        for p in problems:
            yield f"PROBLEM {p['key']}: {p['message']}"
        verdict = f"{len(problems)} problem(s)" if problems else "ok"
        yield (f"{verdict}: {rep.commits} commits, {rep.chunks} chunks, {rep.objects} objects, "
               f"{rep.bytes} bytes checked")
    _emit(args, doc, text)
    return EXIT_PROBLEMS if problems else EXIT_OK


def cmd_index(args: argparse.Namespace) -> int:
    from .store import Repository

    repo = _resolve_run(args, opener=Repository.open)
    rows = repo.reindex()
    _emit(args, {"rows": rows}, lambda: iter([f"index rebuilt from the commit headers: "
                                              f"{rows} commits"]))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from .inspect.html import human_bytes

    snap = _resolve_run(args).at(args.step, args.timeline)
    ext = "safetensors" if args.format == "safetensors" else "pt"
    out = args.out or f"step{snap.step}.{ext}"
    with _bar(args, sum(r.plan.nbytes for r in snap.arrays.values()), "B") as bar:
        info = snap.export(out, args.format, include_all=args.all, overwrite=args.force,
                           progress=bar.update)
    doc = {"step": snap.step, "format": args.format, **info}
    what = "model" if args.format == "safetensors" else "model, optimizer, scheduler"

    def text() -> Iterator[str]:
        yield (f"wrote {info['path']}: step {snap.step}, {info['tensors']} tensors, "
               f"{human_bytes(info['bytes'])} ({args.format}: {what})")
    _emit(args, doc, text)
    return EXIT_OK


# -- parser ---------------------------------------------------------------------------------

def _nonneg(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {v}")
    return v


def _positive(s: str) -> int:
    v = _nonneg(s)
    if v == 0:
        raise argparse.ArgumentTypeError("expected a number >= 1, got 0")
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
    common.add_argument("--run", metavar="PATH", default=argparse.SUPPRESS,
                        help="the run, or a folder inside it (default: $DSTT_RUN, else the "
                        "current directory)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON document for scripts")
    p = _Parser(prog="dstt", parents=[common], description="Inspect and travel through a dstt "
                "run.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> Any:
        sp = sub.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(func=fn)
        return sp

    def timeline(sp: Any) -> None:
        sp.add_argument("--timeline", help="timeline to read (default: the current one)")

    def run_arg(sp: Any) -> None:
        sp.add_argument("path", nargs="?", metavar="RUN",
                        help="the run, or a folder inside it (same as --run)")

    def optim(sp: Any, verb: str) -> None:
        sp.add_argument("--optim", action="store_true",
                        help=f"{verb} optimizer states too (default: model tensors only)")

    sp = add("ls", cmd_ls, "overview: timelines, steps, arrays")
    run_arg(sp)
    sp = add("log", cmd_log, "committed steps, newest first, with logged metrics and spikes")
    run_arg(sp)
    timeline(sp)
    sp.add_argument("-n", type=_nonneg, default=0, help="show at most N steps (0: all)")
    sp.add_argument("--spikes", metavar="METRIC",
                    help="mark spikes of this metric (default: loss, when logged)")
    sp.add_argument("--batches", action="store_true",
                    help="show each step's batch: its sample indices or hash (s.data records "
                         "them)")
    sp = add("show", cmd_show, "tensors of one step: norms, update ratios, bytes on disk")
    run_arg(sp)
    sp.add_argument("--step", type=int, help="the step (default: the head)")
    sp.add_argument("--select", help="layer selector, e.g. 'layers.0.attn' or 'layers.*.mlp'")
    optim(sp, "list")
    timeline(sp)
    sp = add("diff", cmd_diff, "per-tensor change norms from step A to step B")
    run_arg(sp)
    sp.add_argument("a", type=int, metavar="A")
    sp.add_argument("b", type=int, metavar="B")
    sp.add_argument("--select", help="restrict to a layer selector")
    optim(sp, "compare")
    sp.add_argument("--top", type=_nonneg, default=20, help="largest N changes (0: all)")
    sp.add_argument("--timeline", help="timeline of A (default: the current one)")
    sp.add_argument("--timeline-b", metavar="TIMELINE",
                    help="timeline of B, to compare two timelines (default: that of A)")
    sp = add("verify", cmd_verify, "check every committed byte against its checksum")
    run_arg(sp)
    sp.add_argument("--repair", action="store_true",
                    help="rebuild the run's index from the commit headers first")
    sp = add("index", cmd_index, "rebuild the run's index from the commit headers")
    run_arg(sp)
    sp = add("rollback", cmd_rollback, "start a new timeline at an old step (old one kept)")
    run_arg(sp)
    sp.add_argument("--to", type=int, required=True, metavar="STEP")
    sp.add_argument("--skip-data", type=_nonneg, default=0, metavar="N",
                    help="batches to skip when training resumes there")
    sp.add_argument("--name", help="name of the new timeline (default: <timeline>-from-STEP;"
                    " a second rollback to the same step needs one)")
    sp.add_argument("--timeline", help="timeline STEP is on (default: the current one)")
    sp = sub.add_parser("timeline", parents=[common], help="list, switch, rename or delete "
                        "timelines", description="list, switch, rename or delete timelines")
    tsub = sp.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    tsub.required = True

    def tadd(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> Any:
        tp = tsub.add_parser(name, parents=[common], help=help, description=help)
        tp.set_defaults(func=fn)
        run_arg(tp)
        return tp

    tadd("list", cmd_timeline_list, "every timeline: commits, steps, where it forked "
         "(* marks the current one)")
    tp = tadd("switch", cmd_timeline_switch, "make a timeline current (what training resumes)")
    tp.add_argument("name", metavar="NAME")
    tp = tadd("rename", cmd_timeline_rename, "rename a timeline (timelines forked from it "
              "follow; commits keep the name they were written under)")
    tp.add_argument("old", metavar="OLD")
    tp.add_argument("new", metavar="NEW")
    tp = tadd("delete", cmd_timeline_delete, "delete a timeline (not the current one) and the "
              "steps only it had; steps shared with other timelines stay")
    tp.add_argument("name", metavar="NAME")
    tp.add_argument("--yes", action="store_true", help="really delete (required)")
    tp.add_argument("--dry-run", action="store_true",
                    help="say what it would free, delete nothing")
    sp = add("gc", cmd_gc, "prune old steps (timeline heads are always kept)")
    run_arg(sp)
    sp.add_argument("--keep-last", type=_nonneg, metavar="N", help="keep the last N steps")
    sp.add_argument("--keep-every", type=_positive, metavar="K",
                    help="keep steps divisible by K")
    sp.add_argument("--spike-window", type=_nonneg, metavar="W",
                    help="keep every step within W steps of a spike of --spike-metric")
    sp.add_argument("--spike-metric", default="loss", metavar="NAME",
                    help="the metric whose spikes are kept (default: loss)")
    sp.add_argument("--spike-z", type=float, default=4.0, metavar="Z",
                    help="a spike is a value Z standard deviations above its baseline "
                    "(default: 4)")
    sp.add_argument("--spike-baseline", type=_positive, default=50, metavar="N",
                    help="the baseline: the N values before each step (default: 50)")
    sp.add_argument("--dry-run", action="store_true",
                    help="list the steps it would prune, delete nothing")
    sp = add("export", cmd_export, "write one step as a file torch loads: the model, or "
             "model + optimizer + scheduler")
    run_arg(sp)
    sp.add_argument("--step", type=int, help="the step (default: the head)")
    sp.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    sp.add_argument("-o", "--out", help="output file (default: ./step<S>.safetensors|.pt); "
                    "missing folders are created")
    sp.add_argument("--force", action="store_true", help="replace the output file if it exists")
    sp.add_argument("--all", action="store_true",
                    help="also every other array under its store path (safetensors: optimizer "
                    "states too; torch: under 'arrays')")
    timeline(sp)
    return p


def _message(e: BaseException) -> str:
    return str(e) or type(e).__name__


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
        print(f"dstt: {_message(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DsttError as e:
        print(f"dstt: {_message(e)}", file=sys.stderr)
        return EXIT_RUN
    except OSError as e:  # the operating system's, reading or writing the run (EIO, EACCES)
        print(f"dstt: {e}", file=sys.stderr)
        return EXIT_RUN
    except KeyboardInterrupt:
        print("dstt: interrupted", file=sys.stderr)
        return 130
    except Exception:
        traceback.print_exc()
        print("dstt: internal error (a bug in dstt; please report it with the traceback above)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
