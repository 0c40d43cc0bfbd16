"""``dstt`` commands that look at a run: ls, log, show, diff, verify, index, export; each is one
call into ``dstt.Run`` or the store, then printing. A command is read here (one that changes a
run: ``changes.py``), its flags and exit codes in ``parser.py``. Rejected alternative: one
module for the commands, the parser and ``main`` — three jobs in one file."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from .common import (
    UsageError,
    _bar,
    _counter,
    _emit,
    _fields,
    _fmt,
    _metrics_text,
    _resolve_run,
    _timeline_line,
    _when,
)

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator

__all__ = ["cmd_diff", "cmd_export", "cmd_index", "cmd_log", "cmd_ls", "cmd_show", "cmd_verify"]


def cmd_ls(args: argparse.Namespace) -> int:
    from dstt.inspect.html import human_bytes

    run = _resolve_run(args)
    s = run.summary()
    # every="auto": steps taken but not stored (index only; `dstt log` lists them)
    light = run.light_steps()
    s["n_light"] = len(light)
    s["n_rebuilt"] = 0
    if light:  # dstt.run.derived: imported only then (test_cli_startup pins what ls loads)
        from dstt.run.derived import written_bases

        s["n_rebuilt"] = len(written_bases(run, run.timeline))

    def text() -> Iterator[str]:
        yield f"run {s['path']}  (current timeline: {s['timeline']})"
        steps = (
            f"{s['n_steps']} steps ({s['first_step']} … {s['last_step']})"
            if s["n_steps"]
            else "no steps yet"
        )
        metrics = (
            f"metrics at step {s['metrics_step']}: {_metrics_text(s['metric_values'])}"
            if s["metrics"]
            else "metrics: —"
        )
        yield (
            f"{steps} · {s['n_arrays']} arrays · {human_bytes(s['bytes_per_step'])} per step"
            f" · {metrics}"
        )
        if light:
            yield (
                f'{len(light)} light steps (every="auto": taken, not stored; '
                f"{s['n_rebuilt']} rebuilt) · `dstt log` lists them, `dstt rebuild` writes them"
            )
        for t in s["timelines"]:
            yield _timeline_line(t, f" (skip {t['skip_data']})")

    return _emit(args, s, text)


def cmd_log(args: argparse.Namespace) -> int:
    run = _resolve_run(args)
    line = list(reversed(run.commits(args.timeline, pruned=True)))
    light = _light(run, args.timeline)
    if args.n:  # the newest n steps, stored or light
        newest = sorted({h.step for h in line} | set(light), reverse=True)[: args.n]
        line = [h for h in line if h.step in newest][: args.n]
        light = {k: v for k, v in light.items() if k in newest}
    spikes = _spikes(run, args)
    batches = (
        run.batches([*(h.step for h in line), *light], timeline=args.timeline)
        if args.batches
        else {}
    )
    doc = [
        {
            **_fields(h, "step slot timeline time"),
            "metrics": dict(h.metrics),
            "objects": [] if h.pruned else sorted(h.objects),
            "pruned": bool(h.pruned),
            "light": False,
            "rebuilt": None,
            "spike": spikes.get(h.step),
        }
        for h in line
    ]
    if light:  # every="auto": steps taken but not stored, newest first among the commits
        doc = sorted([*doc, *light.values()], key=lambda d: -int(d["step"]))
    if args.batches:
        for d in doc:
            d["batches"] = [b.plain() for b in batches.get(d["step"], [])]

    def text() -> Iterator[str]:
        for d in doc:
            k = d["step"]
            data = "".join(f"  [{b}]" for b in batches.get(k, []))
            if d["light"]:
                how = (
                    f"light (rebuilt from step {d['rebuilt']}; run.at({k}) reads it)"
                    if d["rebuilt"] is not None
                    else f"light (not stored; run.rebuild({k}, ...))"
                )
                yield f"step {k:>8}  {how}  {_metrics_text(d['metrics'])}{data}"
                continue
            sp = d["spike"]
            mark = (
                f"  <- {sp['metric']} spike (z={sp['zscore']:.1f}, baseline "
                f"{sp['baseline']:.4g}; suspect {sp['suspect']})"
                if sp
                else ""
            )
            gone = "  (pruned)" if d["pruned"] else ""  # gc kept its metrics, not its tensors
            yield (
                f"step {k:>8}  {_when(d['time'])}  {d['timeline']}  "
                f"{_metrics_text(d['metrics'])}{data}{mark}{gone}"
            )

    return _emit(args, doc, text)


def _light(run: Any, timeline: str | None) -> dict[int, dict[str, Any]]:
    """The light steps of ``every="auto"`` as ``dstt log`` entries, by step, with the
    metrics they logged (carried by the next commit) and, for one ``dstt rebuild`` wrote,
    the stored step it was rebuilt from (``rebuilt``; else None)."""
    from dstt.run.derived import written_bases

    fingerprints = run.light_steps(timeline)
    if not fingerprints:
        return {}
    bases = written_bases(run, timeline or run.timeline)
    m = run.metrics(timeline)
    where = {int(k): i for i, k in enumerate(m.steps.tolist())}
    out: dict[int, dict[str, Any]] = {}
    for k, bits in fingerprints.items():
        i = where.get(k)
        values = {}
        for name in m.names if i is not None else ():
            v = m.column(name)[i]
            v = v.item() if hasattr(v, "item") else v
            if v == "" or (isinstance(v, float) and math.isnan(v)):
                continue  # not logged at that step
            values[name] = v
        out[k] = {
            "step": k,
            "light": True,
            "rebuilt": bases.get(k),
            "metrics": values,
            "loss_bits": bits,
        }
    return out


def _spikes(run: Any, args: argparse.Namespace) -> dict[int, dict[str, Any]]:
    """Spikes of ``--spikes METRIC`` (default ``loss``, skipped when never logged) by step, by
    the rule of ``run.spikes()`` (``--window``/``--z``; unset: its defaults)."""
    metric = args.spikes or "loss"
    if args.spikes is None and metric not in run.metrics(args.timeline):
        return {}
    return {
        sp.step: {
            "metric": metric,
            "zscore": sp.zscore,
            "baseline": sp.baseline,
            "tensors": [n for n, _ in sp.tensors],
            "cause": sp.cause,
            "suspect": sp.suspect,
            "samples": sp.samples,
        }
        for sp in run.spikes(metric, window=args.window, z=args.z, timeline=args.timeline, top=3)
    }


def _visible(snap: Any, optim: bool) -> list[str]:
    """Paths a user sees at a snapshot: tensors (logical ones of ZeRO runs, not their flat
    sources; tied names too), optimizer states only with ``optim``."""
    return list(snap.catalog.pool if optim else snap.catalog.model_paths)


def _summary_of(run: Any, snap: Any) -> dict[str, tuple[float | None, float | None, bool]]:
    """``{canonical path: (l2, update ratio, exact)}`` from the step's write-time summaries
    (if any)."""
    from dstt.inspect.indexed import summary_columns  # numpy columns: no xarray
    from dstt.inspect.naming import canonical_path

    ds = summary_columns(run.reader.scalar_rows([snap.header]))
    if ds.sizes.get("step", 0) == 0:
        return {}

    def val(x: Any) -> float | None:
        v = float(x)
        return v if math.isfinite(v) else None

    return {
        canonical_path(str(p)): (
            val(ds["l2"].values[0, j]),
            val(ds["update_ratio"].values[0, j]),
            bool(ds["update_exact"].values[0, j]),
        )
        for j, p in enumerate(ds["store_path"].values)
    }


def cmd_show(args: argparse.Namespace) -> int:
    from dstt.inspect.html import human_bytes
    from dstt.inspect.sharded import LogicalRecord, shard_sources
    from dstt.schema import user_name

    run = _resolve_run(args)
    snap = run.at(args.step, args.timeline)
    cat = snap.catalog
    visible = _visible(snap, args.optim)
    # ZeRO runs: the flat buffers the logical tensors are views of are what is on disk
    sources = sorted(shard_sources(snap.arrays))
    paths = visible + [p for p in sources if p not in visible]
    if args.select:
        paths = cat.select(args.select, paths=paths)[0] if paths else []
    sums = _summary_of(run, snap)
    tensors = []
    for p in paths:
        rec = cat.table[p]
        tied = cat.tied_to(p)
        stored = not isinstance(rec, LogicalRecord) and tied is None
        l2, ratio, exact = sums.get(cat.tied.get(p, p), (None, None, False))
        where = (
            _stored(rec, snap.slot)
            if stored
            else {"written_bytes": 0, "stored_as": [f"tied to {tied}" if tied else "view"]}
        )
        tensors.append(
            {
                "name": user_name(p),
                "store_path": rec.path,
                "dtype": rec.dtype,
                "shape": list(rec.shape),
                "bytes": rec.plan.nbytes if stored else 0,
                "stored": stored,
                "tied_to": tied,
                "l2": l2,
                "update_ratio": ratio,
                "update_exact": exact if ratio is not None else None,
                **where,
            }
        )
    doc = {
        **_fields(snap, "step slot timeline time metrics objects"),
        "optim": args.optim,
        "tensors": tensors,
    }

    def text() -> Iterator[str]:
        yield f"step {snap.step} (timeline {snap.timeline}, slot {snap.slot}, {_when(snap.time)})"
        if snap.metrics:
            yield f"metrics: {_metrics_text(snap.metrics)}"
        yield f"objects: {', '.join(snap.objects) or '—'}"
        width = max((len(t["name"]) for t in tensors), default=10)
        yield (
            f"  {'tensor':<{width}}  {'dtype':<8} {'shape':<18} {'norm':>10} "
            f"{'upd ratio':>10} {'size':>10}  {'written':>10}  stored as"
        )
        for t in tensors:
            size = human_bytes(t["bytes"]) if t["stored"] else "—"
            ratio = ("~" if t["update_exact"] is False else "") + _fmt(t["update_ratio"], ".3g")
            yield (
                f"  {t['name']:<{width}}  {t['dtype']:<8} {tuple(t['shape'])!s:<18} "
                f"{_fmt(t['l2']):>10} {ratio:>10} {size:>10}  "
                f"{human_bytes(t['written_bytes']):>10}  {'+'.join(t['stored_as'])}"
            )
        real = [t for t in tensors if t["stored"]]
        size = sum(t["bytes"] for t in real)
        written = sum(t["written_bytes"] for t in real)
        views = sum(1 for t in tensors if not t["stored"] and not t["tied_to"])
        tied = sum(1 for t in tensors if t["tied_to"])
        yield (
            f"{len(real)} stored arrays, {human_bytes(size)}; this step wrote "
            f"{human_bytes(written)} of them"
            + (f" ({size / written:.1f}x fewer bytes)" if 0 < written < size else "")
            + (f"; {views} tensors are views of the stored ZeRO shards" if views else "")
            + (
                f"; {tied} tied names (one tensor, stored under the name it is tied to)"
                if tied
                else ""
            )
        )
        if any(t["update_exact"] is False for t in tensors):
            yield (
                "~ update ratio ||w - w_prev|| / ||w||: an estimate from 16 probed elements "
                "per tensor (typically within ~20%, now and then off 2x); exact: "
                f"dstt diff <previous step> {snap.step}"
            )
        if not args.optim:
            yield "optimizer states not shown (--optim shows them)"

    return _emit(args, doc, text)


_STORED_AS = {"raw": "raw", "xor1": "xor", "pred1": "pred"}


def _stored(rec: Any, slot: int) -> dict[str, Any]:
    """What the step put on disk for a tensor: bytes of the files written in its own slot,
    and how its chunks are stored (raw, xor, pred; ref = unchanged, an older file)."""
    from dstt.store._internal import key_slot

    mine = [c for c in rec.chunks if key_slot(c.key) == slot]
    kinds = {_STORED_AS.get(c.encoding, c.encoding) for c in mine}
    if len(mine) < len(rec.chunks):
        kinds.add("ref")
    return {"written_bytes": sum(c.nbytes for c in mine), "stored_as": sorted(kinds)}


def cmd_diff(args: argparse.Namespace) -> int:
    from dstt.inspect.catalog import Catalog

    run = _resolve_run(args)
    ta = args.timeline or run.timeline
    tb = args.timeline_b or ta
    sa, sb = run.at(args.a, ta), run.at(args.b, tb)
    paths = sorted(set(_visible(sa, args.optim)) | set(_visible(sb, args.optim)))
    if args.select:
        both = Catalog(
            sa.catalog.table | sb.catalog.table,
            where=f"at steps {args.a} or "
            f"{args.b}" + ("" if args.optim else " (optimizer states excluded)"),
            listing=f"dstt show --step {args.b}",
        )
        paths = both.select(args.select, paths=paths)[0]
    tied = sa.catalog.tied | sb.catalog.tied  # a tied name is its target's tensor
    paths = list(dict.fromkeys(tied.get(p, p) for p in paths))
    with _bar(args, None, "B") as bar:
        ds = run.diff(args.a, args.b, timeline=ta, timeline_b=tb, paths=paths, progress=bar.update)
    fields = ("delta_l2", "a_l2", "b_l2", "ratio", "max_abs_delta")
    rows: list[dict[str, Any]] = [
        {"name": str(n), "status": str(st), **{f: float(ds[f].values[i]) for f in fields}}
        for i, (n, st) in enumerate(zip(ds["tensor"].values, ds["status"].values, strict=True))
    ]
    rows.sort(key=lambda r: -r["delta_l2"] if math.isfinite(r["delta_l2"]) else math.inf)
    shown = rows if args.top == 0 else rows[: args.top]
    doc = {
        "a": args.a,
        "b": args.b,
        "timeline_a": ta,
        "timeline_b": tb,
        "optim": args.optim,
        "tensors": shown,
        "total": len(rows),
    }

    def text() -> Iterator[str]:
        if tb != ta:
            yield f"A = step {args.a} of {ta}, B = step {args.b} of {tb}"
        width = max((len(r["name"]) for r in shown), default=10)
        yield f"{'tensor':<{width}}  {'||B-A||':>11} {'||A||':>11} {'ratio':>9} {'max|B-A|':>11}"
        for r in shown:
            if r["status"] != "both":
                yield f"{r['name']:<{width}}  ({r['status'].replace('_', ' ')})"
                continue
            yield (
                f"{r['name']:<{width}}  {r['delta_l2']:>11.4g} {r['a_l2']:>11.4g} "
                f"{r['ratio']:>9.3g} {r['max_abs_delta']:>11.4g}"
            )
        if len(shown) < len(rows):
            yield f"… {len(rows) - len(shown)} more (--top 0 shows all)"
        if not args.optim:
            yield "optimizer states not compared (--optim compares them)"

    return _emit(args, doc, text)


def cmd_verify(args: argparse.Namespace) -> int:
    from dstt.errors import NotARunError
    from dstt.store._internal import Repository

    # the repository, not a Run: a Run reads HEAD and the refs up front, so a damaged one
    # would end here as "unreadable" (exit 3) instead of being reported as a problem
    try:
        run = _resolve_run(args, opener=Repository.open)
    except NotARunError:
        # a damaged root zarr.json must not hide the run from the command that reports and
        # repairs it: a folder with dstt's refs is checked as one
        path = getattr(args, "path", None) or getattr(args, "run", None)
        if not path or not os.path.isdir(os.path.join(path, "_dstt", "refs")):
            raise
        from dstt.store._internal import storage_for

        run = Repository(storage_for(path))
    with _bar(args, None, "commit") as bar:
        rep = run.verify(progress=_counter(bar), repair=args.repair)
    problems = [_fields(p, "key message") for p in rep.problems]
    doc = {
        "ok": not problems,
        "problems": problems,
        **_fields(rep, "commits chunks objects bytes"),
        "repaired": bool(args.repair),
        "rebuilt": list(rep.repaired),
    }

    def text() -> Iterator[str]:
        for line in rep.repaired:
            yield f"REPAIRED {line}"
        for p in problems:
            yield f"PROBLEM {p['key']}: {p['message']}"
        verdict = f"{len(problems)} problem(s)" if problems else "ok"
        yield (
            f"{verdict}: {rep.commits} commits, {rep.chunks} chunks, {rep.objects} objects, "
            f"{rep.bytes} bytes checked"
        )

    return _emit(args, doc, text, ok=not problems)


def cmd_index(args: argparse.Namespace) -> int:
    from dstt.store._internal import Repository

    repo = _resolve_run(args, opener=Repository.open)
    rows = repo.reindex()
    text = [f"index rebuilt from the commit headers: {rows} commits"]
    return _emit(args, {"rows": rows}, lambda: text)


def cmd_export(args: argparse.Namespace) -> int:
    from dstt.inspect.html import human_bytes

    snap = _resolve_run(args).at(args.step, args.timeline)
    if args.config is not None and args.format != "hf":
        raise UsageError("--config is for --format hf (the config.json of the folder)")
    suffix, what = {  # the default output's suffix, what the export holds
        "safetensors": (".safetensors", "model"),
        "torch": (".pt", "model, optimizer, scheduler"),
        "hf": ("-hf", "model.safetensors + config.json: from_pretrained opens it"),
        "dcp": ("", "a torch.distributed.checkpoint folder: dcp.load opens it"),
    }[args.format]
    out = args.out or f"step{snap.step}{suffix}"
    with _bar(args, sum(r.plan.nbytes for r in snap.arrays.values()), "B") as bar:
        info = snap.export(
            out,
            args.format,
            include_all=args.all,
            overwrite=args.force,
            config=args.config,
            progress=bar.update,
        )
    doc = {"step": snap.step, "format": args.format, **info}
    text = (
        f"wrote {info['path']}: step {snap.step}, {info['tensors']} tensors, "
        f"{human_bytes(info['bytes'])} ({args.format}: {what})"
    )
    return _emit(args, doc, lambda: [text])
