"""The crash soak of ``bench/crash_soak.py`` in small: a few SIGKILLs of a real training process.

Each kill: ``dstt verify`` (CLI) passes, the head is the last announced commit or the next one,
no committed step is lost, and the next process resumes bit-exactly (every printed loss equals
the uninterrupted reference). See ``soak.py`` beside it for the child and the checks; the long
run (50+ kills) and its figures are in docs/reliability.md.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dstt.store import Repository

from .soak import KillOutcome, Reference, kill_once, reference, run_child_to_end

STEPS = 30
SEED = 5
KILLS = 6


@pytest.fixture(scope="module")
def ref() -> Reference:
    return reference(STEPS, SEED)


def test_sigkill_at_random_moments_then_resume(tmp_path: Path, ref: Reference) -> None:
    rng = random.Random(SEED)
    runs = [tmp_path / "run0"]
    # one kill of each kind first, then random ones; every other child writes deltas
    modes = iter(["commit", "step", "start", "time"])
    outcomes: list[KillOutcome] = []
    while sum(not o.completed for o in outcomes) < KILLS and len(outcomes) < 2 * KILLS:
        o = kill_once(
            runs[-1], ref, STEPS, SEED, rng, delta=len(outcomes) % 2 == 1, mode=next(modes, None)
        )
        assert o.problems == [], (len(outcomes), o)
        outcomes.append(o)
        if o.completed:  # reached the end before the kill landed (checked): a new run
            runs.append(tmp_path / f"run{len(runs)}")
    killed = [o for o in outcomes if not o.completed]
    assert len(killed) == KILLS
    # not vacuous: kills landed after commits, and losses after a resume were compared
    assert any(o.head > o.start for o in killed)
    assert any(o.start > 0 and o.restored == o.start and o.checked_losses for o in outcomes)
    # the run survives them all: resuming to the end equals the uninterrupted run
    run = runs[-1]
    assert run_child_to_end(run, STEPS, SEED) == ref.final
    repo = Repository.open(run)
    assert [h.step for h in repo.reader().lineage()] == list(range(1, STEPS + 1))
    repo.gc()  # removes what the kills left behind (orphaned slots, temporary files)
    assert repo.verify().ok
    assert not [p for p in run.rglob("*") if ".tmp." in p.name]
