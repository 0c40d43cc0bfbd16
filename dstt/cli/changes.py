"""``dstt`` commands that change a run: rollback, the timeline group, gc (``dstt.cli``'s
parser calls them; each is one call into ``dstt.Run``, then printing)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .common import UsageError, _bar, _counter, _emit, _fields, _resolve_run, _timeline_line

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator


def cmd_rollback(args: argparse.Namespace) -> int:
    run = _resolve_run(args)
    old = args.timeline or run.timeline
    name = run.rollback(
        args.to,
        args.skip_data,
        timeline=args.timeline,
        name=args.name,
        skip_samples=args.skip_samples,
        force=args.force,
    )
    samples = sorted(run.skips(name).samples)
    doc = {
        "timeline": name,
        "from_timeline": old,
        "step": args.to,
        "skip_data": args.skip_data,
        "skip_samples": samples,
    }

    def text() -> Iterator[str]:
        skipped = f"; sessions resumed there skip samples {_few(samples)}" if samples else ""
        yield (
            f"timeline {name!r} now starts at step {args.to} of {old!r} and is current "
            f"(skip {args.skip_data} batches on resume{skipped}); {old!r} is kept"
        )

    return _emit(args, doc, text)


def _few(xs: list[int], n: int = 8) -> str:
    """``[1, 2, 3]``, or the first ``n`` and how many there are."""
    shown = ", ".join(map(str, xs[:n]))
    return shown if len(xs) <= n else f"{shown}, ... ({len(xs)})"


def cmd_timeline_list(args: argparse.Namespace) -> int:
    from dstt.inspect.html import timeline_rows

    run = _resolve_run(args)
    rows = timeline_rows(run)
    for t in rows:
        skips = run.skips(t["name"])  # its rollback's and its ancestors': what a resume drops
        t["skip_samples"] = sorted(skips.samples)
        t["skip_batches"] = [b.plain() for b in skips.batches]
        t["base_exists"] = t["base_timeline"] is None or t["base_timeline"] in run.timelines

    def text() -> Iterator[str]:
        for t in rows:
            skip = [f"{t['skip_data']} batches on resume"] if t["skip_data"] else []
            if t["skip_samples"]:
                skip.append(f"samples {_few(t['skip_samples'])}")
            if t["skip_batches"]:
                skip.append(f"{len(t['skip_batches'])} recorded batches")
            line = _timeline_line(t, "" if t["base_exists"] else " (deleted)")
            if skip:
                line += f" (skip {'; '.join(skip)})"
            elif t["base_timeline"]:
                line += " (skip nothing)"
            yield line

    return _emit(args, rows, text)


def cmd_timeline_switch(args: argparse.Namespace) -> int:
    run = _resolve_run(args)
    old = run.timeline
    run.switch(args.name, force=args.force)
    head = run.commits()[-1].step if run.commits() else None
    doc = {"timeline": args.name, "previous": old, "head_step": head}

    def text() -> Iterator[str]:
        at = f"its head is step {head}" if head is not None else "it has no commits yet"
        yield f"timeline {args.name!r} is now current (was {old!r}); {at}"

    return _emit(args, doc, text)


def cmd_timeline_rename(args: argparse.Namespace) -> int:
    run = _resolve_run(args)
    run.rename_timeline(args.old, args.new, force=args.force)
    doc = {"old": args.old, "new": args.new, "current": run.timeline}
    return _emit(args, doc, lambda: [f"timeline {args.old!r} is now {args.new!r}"])


def cmd_timeline_delete(args: argparse.Namespace) -> int:
    from dstt.inspect.html import human_bytes

    run = _resolve_run(args)
    if not (args.yes or args.dry_run):
        raise UsageError(
            f"deleting timeline {args.name!r} frees its own steps for good; "
            "add --yes to do it, or --dry-run to see what it would free"
        )
    rep = run.delete_timeline(args.name, dry_run=args.dry_run, force=args.force)
    gc = rep.gc
    doc = {
        **_fields(rep, "timeline dry_run freed_steps kept_steps"),
        **_fields(gc, "files_removed bytes_freed"),
    }

    def steps(xs: tuple[int, ...]) -> str:
        if not xs:
            return "none"
        return ", ".join(map(str, xs)) if len(xs) <= 8 else f"{len(xs)} ({xs[0]} … {xs[-1]})"

    def text() -> Iterator[str]:
        verb = "would delete" if rep.dry_run else "deleted"
        own = (
            f"its own steps {steps(rep.freed_steps)}"
            if rep.freed_steps
            else "it had no steps of its own"
        )
        yield (
            f"{verb} timeline {rep.timeline!r}: {own} ({gc.files_removed} files, "
            f"{human_bytes(gc.bytes_freed)}); steps shared with other timelines stay: "
            f"{steps(rep.kept_steps)}"
            + ("; nothing was deleted (--dry-run)" if rep.dry_run else "")
        )

    return _emit(args, doc, text)


def cmd_gc(args: argparse.Namespace) -> int:
    from dstt.inspect.html import human_bytes
    from dstt.store._internal import Retention

    if args.keep_last is None and args.keep_every is None and not args.spike_window:
        raise UsageError(
            "gc needs a retention policy: --keep-last N, --keep-every K and/or "
            "--spike-window W (timeline heads are always kept)"
        )
    try:
        pol = Retention(
            keep_last=args.keep_last,
            keep_every=args.keep_every,
            spike_window=args.spike_window or 0,
            spike_metric=args.spike_metric,
            spike_z=args.spike_z,
            spike_baseline=args.spike_baseline,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    run = _resolve_run(args)
    if pol.spike_window and args.spike_metric not in run.metrics():
        raise UsageError(
            f"--spike-metric {args.spike_metric!r} was never logged; pass the "
            "name of a logged metric (see `dstt log`)"
        )
    with _bar(args, None, "slot") as bar:
        rep = run.gc(retention=pol, dry_run=args.dry_run, progress=_counter(bar))
    doc = {
        "dry_run": rep.dry_run,
        "pruned": [{"timeline": t, "step": s} for t, s in rep.pruned_steps],
        "orphan_slots": list(rep.orphan_slots),
        "files_removed": rep.files_removed,
        "bytes_freed": rep.bytes_freed,
        "spike_windows": [{"timeline": t, "first": a, "last": b} for t, a, b in rep.spike_windows],
    }

    def text() -> Iterator[str]:
        verb = "would prune" if rep.dry_run else "pruned"
        for t, s in sorted(rep.pruned_steps, key=lambda ts: (ts[0], ts[1])):
            yield f"{verb} step {s} of timeline {t}"
        for t, a, b in rep.spike_windows:
            yield f"kept steps {a}-{b} of timeline {t} (around a {pol.spike_metric} spike)"
        yield (
            f"{verb} {len(rep.pruned_steps)} steps and {len(rep.orphan_slots)} orphaned slots:"
            f" {rep.files_removed} files, {human_bytes(rep.bytes_freed)}"
            + ("; nothing was deleted (--dry-run)" if rep.dry_run else "")
        )

    return _emit(args, doc, text)
