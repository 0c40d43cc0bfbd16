"""The run overview as plain data and as a static HTML table (Jupyter ``_repr_html_``).

One function gathers the facts (:func:`run_summary`: path, timelines, step range, arrays and
bytes of the head), two render them: ``Run.__repr__``/``dstt ls`` as text and :func:`run_html`
as HTML with every value escaped. Static HTML, no JavaScript, so it renders the same in
JupyterLab, VS Code, GitHub and nbconvert. Rejected alternative: an ipywidgets summary — it
renders nothing without a live kernel.
"""

from __future__ import annotations

import html
import time
from typing import TYPE_CHECKING, Any

from .sharded import shard_sources

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["html_rows", "human_bytes", "run_html", "run_summary", "timeline_rows"]


def html_rows(rows: Iterable[Iterable[object]]) -> str:
    """Table rows (``<tr>``) of the cells of ``rows``, each escaped."""
    return "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def run_summary(run: Any) -> dict[str, Any]:  # noqa: ANN401 - a Run (run/ sits above inspect/)
    """Facts about a run, JSON-ready. Reads headers and the head's arrays table only."""
    line = run.commits()
    head = line[-1] if line else None
    table = run.arrays(head) if head is not None else {}
    # the newest step that logged metrics (the head may have none: a commit made at a
    # keyframe or at the session's close before the step's s.log)
    logged = next((h for h in reversed(line) if h.metrics), None)
    # logical tensors of sharded runs are views of the flat buffers: not stored bytes
    stored = [r for r in table.values() if getattr(r, "logical", None) is None]
    return {
        "path": run.path,
        "timeline": run.timeline,
        "timelines": timeline_rows(run),
        "n_steps": len(line),
        "first_step": line[0].step if line else None,
        "last_step": head.step if head is not None else None,
        "head_time": head.time if head is not None else None,
        # tensors as a user names them: on sharded runs the logical tensors, not also the
        # flat buffers they are views of (``n_stored``: the arrays really on disk)
        "n_arrays": len(table) - len(shard_sources(table)),
        "n_stored": len(stored),
        "bytes_per_step": sum(r.plan.nbytes for r in stored),
        "metrics": sorted(logged.metrics) if logged is not None else [],
        "metrics_step": logged.step if logged is not None else None,
        "metric_values": dict(logged.metrics) if logged is not None else {},
    }


def timeline_rows(run: Any) -> list[dict[str, Any]]:  # noqa: ANN401 - a Run
    """Each timeline of ``run`` by name: commits, step range, where it forked."""
    rows = []
    for name, ref in sorted(run.timelines.items()):
        line = run.commits(name)
        rows.append(
            {
                "name": name,
                "current": name == run.timeline,
                "commits": len(line),
                "first_step": line[0].step if line else None,
                "head_step": line[-1].step if line else None,
                "base_timeline": ref.base_timeline,
                "base_step": ref.base_step,
                "skip_data": ref.skip_data,
            }
        )
    return rows


def run_html(s: dict[str, Any]) -> str:
    """Static HTML of :func:`run_summary`'s result."""
    e = html.escape

    def row(k: str, v: Any) -> str:  # noqa: ANN401 - a JSON value
        return f"<tr><th style='text-align:left'>{e(k)}</th><td>{e(str(v))}</td></tr>"

    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["head_time"]))
        if s["head_time"]
        else "—"
    )
    steps = f"{s['n_steps']} ({s['first_step']} … {s['last_step']})" if s["n_steps"] else "none yet"
    head = "".join(
        [
            row("path", s["path"]),
            row("current timeline", s["timeline"]),
            row("steps", steps),
            row("last commit", when),
            row("arrays", s["n_arrays"]),
            row("bytes per step", human_bytes(s["bytes_per_step"])),
            row("metrics", ", ".join(s["metrics"]) or "—"),
        ]
    )
    tl_rows = html_rows(
        (
            ("● " if t["current"] else "") + t["name"],
            t["commits"],
            f"{t['first_step']} … {t['head_step']}" if t["commits"] else "—",
            f"{t['base_timeline']}@{t['base_step']}" if t["base_timeline"] else "—",
            t["skip_data"],
        )
        for t in s["timelines"]
    )
    tl_head = "".join(
        f"<th>{h}</th>" for h in ("timeline", "commits", "steps", "from", "skip data")
    )
    return (
        "<div class='dstt-run'><strong>dstt run</strong>"
        f"<table>{head}</table>"
        f"<table><thead><tr>{tl_head}</tr></thead><tbody>{tl_rows}</tbody></table></div>"
    )
