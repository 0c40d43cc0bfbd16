"""``dstt``: the command line over a run (``ls log show diff verify rollback gc export``).

Thin by design: argparse, one call into :mod:`dstt._run` (or the store behind it), printing.
The run is ``--run PATH`` (``dstt ls PATH`` too), else ``$DSTT_RUN``, else the current directory
when it is a run, so ``dstt rollback --to 1180`` works from inside the run. ``--json`` prints one
JSON document on stdout for scripts; progress bars (tqdm) go to stderr on a terminal only.

Exit codes: 0 ok · 1 ``verify`` found problems · 2 usage or bad input (no run there, unknown
step, timeline or tensor, bad flag) · 3 the run could not be read or written (locked by a
writer, damaged, I/O error) · 4 internal error (a bug; the traceback is printed). Errors are one
line on stderr, ``dstt: <what is wrong and what to do>``, without a traceback.

Rejected alternative: click/typer — a dependency for eight subcommands that argparse covers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .errors import DsttError, NotARunError, StepNotFoundError, TimelineError

__all__ = ["EXIT_BAD_INPUT", "EXIT_INTERNAL", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_RUN", "main"]

EXIT_OK, EXIT_PROBLEMS, EXIT_BAD_INPUT, EXIT_RUN, EXIT_INTERNAL = 0, 1, 2, 3, 4


class UsageError(Exception):
    """Bad input found after parsing (exit 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, not the usage block
        raise UsageError(f"{message} (see: {self.prog} --help)")


# -- helpers --------------------------------------------------------------------------------

def _resolve_run(args: argparse.Namespace, *, opener: Any = None) -> Any:
    """The run named by the arguments, opened with ``opener`` (default ``dstt.open``)."""
    if opener is None:
        from ._run import open_run as opener

    path = getattr(args, "path", None) or getattr(args, "run", None) or os.environ.get("DSTT_RUN")
    if not path:
        try:
            return opener(os.getcwd())
        except NotARunError:
            raise UsageError("no run given and the current directory is not a dstt run; "
                             "pass --run PATH or set DSTT_RUN") from None
    if not os.path.isdir(path):
        raise UsageError(f"no run at {path}: no such directory")
    return opener(path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return _jsonable(x.item())
    return x


def _emit(args: argparse.Namespace, doc: Any, text: Callable[[], Iterator[str]]) -> None:
    if getattr(args, "json", False):
        print(json.dumps(_jsonable(doc), indent=2, default=str))
    else:
        for line in text():
            print(line)


@contextmanager
def _bar(args: argparse.Namespace, total: int | None, unit: str = "it") -> Iterator[Any]:
    from tqdm import tqdm

    disable = True if getattr(args, "json", False) else None  # None: only on a terminal
    with tqdm(total=total, unit=unit, unit_scale=unit == "B", file=sys.stderr, leave=False,
              disable=disable) as bar:
        yield bar


def _counter(bar: Any) -> Callable[[int, int], None]:
    def update(n: int, total: int) -> None:
        bar.total = total
        bar.n = n
        bar.refresh()
    return update


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _metrics_text(m: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in sorted(m.items()))


# -- commands -------------------------------------------------------------------------------

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
    line = list(reversed(run.commits(args.timeline)))
    if args.n:
        line = line[:args.n]
    doc = [{"step": h.step, "slot": h.slot, "timeline": h.timeline, "time": h.time,
            "metrics": dict(h.metrics), "objects": sorted(h.objects)} for h in line]

    def text() -> Iterator[str]:
        for h in line:
            yield f"step {h.step:>8}  {_when(h.time)}  {h.timeline}  {_metrics_text(h.metrics)}"
    _emit(args, doc, text)
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    from .inspect.html import human_bytes
    from .inspect.naming import optim_state, select, user_name

    snap = _resolve_run(args).at(args.step, args.timeline)
    paths = [p for p in sorted(snap.arrays) if args.optim or optim_state(p) is None]
    if args.select:
        paths = select(args.select, paths)
        if not paths:
            raise UsageError(f"selector {args.select!r} matches no tensor at step {snap.step}")
    tensors = [{"name": user_name(p), "store_path": p, "dtype": snap.arrays[p].dtype,
                "shape": list(snap.arrays[p].shape), "bytes": snap.arrays[p].plan.nbytes,
                **_stored(snap.arrays[p], snap.slot)} for p in paths]
    doc = {"step": snap.step, "slot": snap.slot, "timeline": snap.timeline, "time": snap.time,
           "metrics": snap.metrics, "objects": snap.objects, "tensors": tensors}

    def text() -> Iterator[str]:
        yield f"step {snap.step} (timeline {snap.timeline}, slot {snap.slot}, {_when(snap.time)})"
        if snap.metrics:
            yield f"metrics: {_metrics_text(snap.metrics)}"
        yield f"objects: {', '.join(snap.objects) or '—'}"
        width = max((len(t["name"]) for t in tensors), default=10)
        yield f"  {'':<{width}}  {'':<8} {'':<18} {'size':>10}  {'written':>10}  stored as"
        for t in tensors:
            yield (f"  {t['name']:<{width}}  {t['dtype']:<8} {tuple(t['shape'])!s:<18} "
                   f"{human_bytes(t['bytes']):>10}  {human_bytes(t['written_bytes']):>10}  "
                   f"{'+'.join(t['stored_as'])}")
        size = sum(t["bytes"] for t in tensors)
        written = sum(t["written_bytes"] for t in tensors)
        yield (f"{len(tensors)} tensors, {human_bytes(size)}; this step wrote "
               f"{human_bytes(written)} of them"
               + (f" ({size / written:.1f}x fewer bytes)" if 0 < written < size else ""))
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
    run = _resolve_run(args)
    with _bar(args, None, "B") as bar:
        ds = run.diff(args.a, args.b, timeline=args.timeline, selector=args.select,
                      progress=bar.update)
    fields = ("delta_l2", "a_l2", "b_l2", "ratio", "max_abs_delta")
    rows: list[dict[str, Any]] = [
        {"name": str(n), "status": str(st), **{f: float(ds[f].values[i]) for f in fields}}
        for i, (n, st) in enumerate(zip(ds["tensor"].values, ds["status"].values, strict=True))]
    rows.sort(key=lambda r: -r["delta_l2"] if math.isfinite(r["delta_l2"]) else math.inf)
    shown = rows if args.top == 0 else rows[:args.top]
    doc = {"a": args.a, "b": args.b, "tensors": shown, "total": len(rows)}

    def text() -> Iterator[str]:
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
    _emit(args, doc, text)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from .store import Repository

    # the repository, not a Run: a Run reads HEAD and the refs up front, so a damaged one
    # would end here as "unreadable" (exit 3) instead of being reported as a problem
    run = _resolve_run(args, opener=Repository.open)
    with _bar(args, None, "commit") as bar:
        rep = run.verify(progress=_counter(bar))
    problems = [{"key": p.key, "message": p.message} for p in rep.problems]
    doc = {"ok": not problems, "problems": problems, "commits": rep.commits,
           "chunks": rep.chunks, "objects": rep.objects, "bytes": rep.bytes}

    def text() -> Iterator[str]:
        for p in problems:
            yield f"PROBLEM {p['key']}: {p['message']}"
        verdict = f"{len(problems)} problem(s)" if problems else "ok"
        yield (f"{verdict}: {rep.commits} commits, {rep.chunks} chunks, {rep.objects} objects, "
               f"{rep.bytes} bytes checked")
    _emit(args, doc, text)
    return EXIT_PROBLEMS if problems else EXIT_OK


def cmd_rollback(args: argparse.Namespace) -> int:
    run = _resolve_run(args)
    old = args.timeline or run.timeline
    name = run.rollback(args.to, args.skip_data, timeline=args.timeline)
    doc = {"timeline": name, "from_timeline": old, "step": args.to, "skip_data": args.skip_data}

    def text() -> Iterator[str]:
        yield (f"timeline {name!r} now starts at step {args.to} of {old!r} and is current "
               f"(skip {args.skip_data} batches on resume); {old!r} is kept")
    _emit(args, doc, text)
    return EXIT_OK


def cmd_gc(args: argparse.Namespace) -> int:
    from .inspect.html import human_bytes

    if args.keep_last is None and args.keep_every is None:
        raise UsageError("gc needs a retention policy: --keep-last N and/or --keep-every K "
                         "(timeline heads are always kept)")
    run = _resolve_run(args)
    with _bar(args, None, "slot") as bar:
        rep = run.gc(keep_last=args.keep_last, keep_every=args.keep_every, dry_run=args.dry_run,
                     progress=_counter(bar))
    doc = {"dry_run": rep.dry_run, "pruned": [{"timeline": t, "step": s}
                                              for t, s in rep.pruned_steps],
           "orphan_slots": list(rep.orphan_slots), "files_removed": rep.files_removed,
           "bytes_freed": rep.bytes_freed}

    def text() -> Iterator[str]:
        verb = "would prune" if rep.dry_run else "pruned"
        yield (f"{verb} {len(rep.pruned_steps)} steps and {len(rep.orphan_slots)} orphaned slots:"
               f" {rep.files_removed} files, {human_bytes(rep.bytes_freed)}")
    _emit(args, doc, text)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from .inspect.html import human_bytes

    snap = _resolve_run(args).at(args.step, args.timeline)
    ext = "safetensors" if args.format == "safetensors" else "pt"
    out = args.out or f"step{snap.step}.{ext}"
    with _bar(args, sum(r.plan.nbytes for r in snap.arrays.values()), "B") as bar:
        info = snap.export(out, args.format, include_all=args.all, progress=bar.update)
    doc = {"step": snap.step, "format": args.format, **info}

    def text() -> Iterator[str]:
        yield (f"wrote {info['path']}: step {snap.step}, {info['tensors']} tensors, "
               f"{human_bytes(info['bytes'])} ({args.format})")
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


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--run", metavar="PATH", default=argparse.SUPPRESS,
                        help="the run directory (default: $DSTT_RUN, else the current directory)")
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print one JSON document for scripts")
    p = _Parser(prog="dstt", parents=[common], description="Inspect and travel through a dstt "
                "run.", epilog="exit codes: 0 ok, 1 verify found problems, 2 usage or bad "
                "input, 3 run unreadable/locked/damaged, 4 internal error")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def add(name: str, fn: Callable[[argparse.Namespace], int], help: str) -> Any:
        sp = sub.add_parser(name, parents=[common], help=help, description=help)
        sp.set_defaults(func=fn)
        return sp

    def timeline(sp: Any) -> None:
        sp.add_argument("--timeline", help="timeline to read (default: the current one)")

    sp = add("ls", cmd_ls, "overview: timelines, steps, arrays")
    sp.add_argument("path", nargs="?", help="the run (same as --run)")
    sp = add("log", cmd_log, "committed steps, newest first, with logged metrics")
    timeline(sp)
    sp.add_argument("-n", type=_nonneg, default=0, help="show at most N steps (0: all)")
    sp = add("show", cmd_show, "tensors, metrics and objects of one step")
    sp.add_argument("--step", type=int, help="the step (default: the head)")
    sp.add_argument("--select", help="layer selector, e.g. 'layers.0.attn' or 'layers.*.mlp'")
    sp.add_argument("--optim", action="store_true", help="include optimizer states")
    timeline(sp)
    sp = add("diff", cmd_diff, "per-tensor change norms from step A to step B")
    sp.add_argument("a", type=int, metavar="A")
    sp.add_argument("b", type=int, metavar="B")
    sp.add_argument("--select", help="restrict to a layer selector")
    sp.add_argument("--top", type=_nonneg, default=20, help="largest N changes (0: all)")
    timeline(sp)
    add("verify", cmd_verify, "check every committed byte against its checksum")
    sp = add("rollback", cmd_rollback, "start a new timeline at an old step (old one kept)")
    sp.add_argument("--to", type=int, required=True, metavar="STEP")
    sp.add_argument("--skip-data", type=_nonneg, default=0, metavar="N",
                    help="batches to skip when training resumes there")
    timeline(sp)
    sp = add("gc", cmd_gc, "prune old steps (timeline heads are always kept)")
    sp.add_argument("--keep-last", type=_nonneg, metavar="N", help="keep the last N steps")
    sp.add_argument("--keep-every", type=_nonneg, metavar="K", help="keep steps divisible by K")
    sp.add_argument("--dry-run", action="store_true", help="report, delete nothing")
    sp = add("export", cmd_export, "write one step as a torch state dict")
    sp.add_argument("--step", type=int, help="the step (default: the head)")
    sp.add_argument("--format", choices=("safetensors", "torch"), default="safetensors")
    sp.add_argument("-o", "--out", help="output file (default: ./step<S>.safetensors|.pt)")
    sp.add_argument("--all", action="store_true",
                    help="also optimizer states and other arrays, under their store paths")
    timeline(sp)
    return p


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    return str(e) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the ``dstt`` script exits with it)."""
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except SystemExit as e:  # --help, --version
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_BAD_INPUT
    except (UsageError, NotARunError, StepNotFoundError, TimelineError) as e:
        print(f"dstt: {_message(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DsttError as e:
        print(f"dstt: {_message(e)}", file=sys.stderr)
        return EXIT_RUN
    except (KeyError, ValueError) as e:
        print(f"dstt: {_message(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
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
