"""``dstt rebuild``: rebuild light steps (``every="auto"``) by replay and write them to the run.

``dstt rebuild [RUN] --steps 10:40 [--script train.py:make]`` replays the chosen light steps
from the stored step before each (one pass per gap) with the factory of ``--script``, else the
one the run's sessions recorded, and writes each with ``run.rebuilt(..., persist=True)``
(:mod:`dstt.run.derived`): later ``run.at(k)`` reads it without a factory. One gap at a time,
so a broken chain (exit 3) keeps what was rebuilt before it. Rejected alternative: one
``run.rebuilt`` call for every step — it writes nothing until all are rebuilt, so one broken
gap would throw away the good ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dstt.errors import ConfigError, ReplayError, StepNotFoundError, TimelineError

from .common import UsageError, _bar, _emit, _resolve_run

if TYPE_CHECKING:
    import argparse
    from collections.abc import Iterator

__all__ = ["cmd_rebuild", "parse_steps"]


def parse_steps(spec: str) -> tuple[int, int] | None:
    """``12`` -> (12, 12), ``10:40`` -> (10, 40) (inclusive), ``light`` -> None (every light
    step not yet rebuilt); anything else exits 2."""
    s = spec.strip()
    if s == "light":
        return None
    lo, sep, hi = s.partition(":")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise UsageError(
            f"--steps {spec!r}: expected a step (12), an inclusive range (10:40) or 'light'"
        ) from None
    if a < 0 or b < a:
        raise UsageError(f"--steps {spec!r}: expected 0 <= first <= last, as in 10:40")
    return a, b


def _wanted(run: Any, args: argparse.Namespace, timeline: str) -> tuple[list[int], list[int]]:
    """(the light steps ``--steps`` names, the stored steps it names)."""
    from dstt.run.derived import written_bases

    light = set(run.light_steps(timeline))
    stored = {h.step for h in run.commits(timeline, pruned=True)}
    bounds = parse_steps(args.steps)
    if bounds is None:
        return sorted(light - set(written_bases(run, timeline))), []
    a, b = bounds
    if a == b:
        if a in stored:
            raise UsageError(
                f"step {a} is stored on timeline {timeline!r}: nothing to rebuild, "
                f"run.at({a}) reads it as it is; dstt rebuild rebuilds light steps "
                "(dstt log marks them)"
            )
        if a not in light:
            near = sorted(stored | light)
            raise StepNotFoundError(
                f"no step {a} on timeline {timeline!r} (its steps: "
                f"{near[0] if near else '—'} … {near[-1] if near else '—'}); "
                "dstt log lists them"
            )
    return sorted(k for k in light if a <= k <= b), sorted(k for k in stored if a <= k <= b)


def _open_replay(run: Any, args: argparse.Namespace) -> None:
    """Give ``run`` its replay factory: ``--script``, else the one its sessions recorded."""
    try:
        run.use_replay(args.script or True)
    except ConfigError as e:
        if args.script:
            raise UsageError(f"--script: {e}") from None
        raise UsageError(
            f"no replay factory: the sessions of {run.path} recorded none "
            "(dstt.session(..., replay='train.py:make') records one); pass --script "
            "FILE.py:FUNCTION, a function returning the objects training built "
            "(model, optimizer, dataset, loss_fn, ...)"
        ) from None


def cmd_rebuild(args: argparse.Namespace) -> int:
    from dstt.run.derived import written_bases
    from dstt.run.rebuilt import by_base

    run = _resolve_run(args)
    timeline = args.timeline or run.timeline
    if timeline not in run.timelines:
        raise TimelineError(f"no timeline {timeline!r}; have {sorted(run.timelines)}")
    steps, skipped = _wanted(run, args, timeline)
    before = written_bases(run, timeline)
    if any(k not in before for k in steps):
        _open_replay(run, args)
    got: dict[int, Any] = {}
    stored = [h.step for h in run.commits(timeline, pruned=True)]
    with _bar(args, len(steps), unit="step") as bar:
        for _, gap in sorted(by_base(stored, steps).items()):
            done = 0

            def tick(n: int, _total: int) -> None:
                nonlocal done
                bar.update(n - done)
                done = n

            try:
                got.update(run.rebuilt(gap, timeline=timeline, progress=tick, persist=True))
            except ReplayError:
                if done:  # the steps of this gap before the break: write them too
                    got.update(run.rebuilt(gap[:done], timeline=timeline, persist=True))
                raise
            bar.update(len(gap) - done)  # those written before: read back, not replayed
    doc = {
        "timeline": timeline,
        "rebuilt": [
            {
                "step": k,
                "base": s.rebuilt.base,
                "matched": s.rebuilt.faithful,
                "checked": list(s.rebuilt.checked),
                "unchecked": list(s.rebuilt.unchecked),
                "written_before": k in before,
            }
            for k, s in sorted(got.items())
        ],
        "stored": skipped,
    }

    def text() -> Iterator[str]:
        if not got and not skipped:
            where = "left" if args.steps.strip() == "light" else f"in {args.steps}"
            yield f"nothing to rebuild on timeline {timeline!r}: no light step {where}"
        for d in doc["rebuilt"]:
            how = (
                "every replayed loss matched bit for bit"
                if d["matched"]
                else f"{len(d['unchecked'])} replayed step(s) logged no loss to check"
            )
            again = "  (written before)" if d["written_before"] else ""
            yield f"step {d['step']:>8}  rebuilt from stored step {d['base']}  {how}{again}"
        if skipped:
            yield f"stored, nothing to rebuild: {', '.join(map(str, skipped))}"

    return _emit(args, doc, text)
