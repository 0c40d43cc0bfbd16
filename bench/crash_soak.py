"""Crash soak: SIGKILL a training process that checkpoints every step, ``--kills`` times.

Each kill starts ``python tests/reliability/soak.py child`` on the current run directory (TinyGPT,
``dstt.session(..., resume=True)``, a checkpoint every step, every other kill with
``DeltaPolicy``), kills it at a random moment — a random time after spawn (import, restore,
session start or training), shortly after a random step, or right after a commit was
announced — and checks (``tests/reliability/soak.py``'s ``kill_once``):

* ``dstt verify --run RUN`` (the CLI, its own process) passes;
* the head is the last commit the child announced, or the one after it (killed between the
  ref write and the print); the timeline holds every step 1..head (nothing lost);
* the next child restores exactly that head, and every loss printed by every child, before and
  after its resume, equals the uninterrupted reference (same seed, no dstt) bit for bit.

A run that reaches ``--steps`` ends its episode: its final parameters must equal the
reference's, then ``dstt gc`` removes the debris of the kills, ``dstt verify`` runs again and a
new run starts. Results: ``--json`` (default bench/results/crash_soak.json); exit status 1 if
any check failed.

    python bench/crash_soak.py [--kills 50] [--steps 60] [--seed 0] [--dir DIR]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.soak import KillOutcome, child_env, kill_once, reference


def debris(run: Path) -> dict[str, int]:
    """Leftovers of killed writers: temporary files and slots no timeline reaches."""
    from dstt.store import Repository

    tmp = sum(1 for _, _, files in os.walk(run) for f in files if ".tmp." in f)
    r = Repository.open(run).reader()
    reachable = {h.slot for tl in r.timelines for h in r.lineage(tl)}
    return {"tmp_files": tmp, "orphan_slots": len(set(r.all_slots()) - reachable)}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dstt.cli", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=600,
    )


def end_episode(run: Path) -> dict[str, Any]:
    """gc the finished run and verify it again; report what gc removed."""
    before = debris(run)
    gc = cli("gc", "--run", str(run), "--keep-last", "5", "--json")
    ver = cli("verify", "--run", str(run), "--json")
    ok = gc.returncode == 0 and ver.returncode == 0 and json.loads(ver.stdout)["ok"]
    doc = json.loads(gc.stdout) if gc.returncode == 0 else {"error": gc.stderr[-500:]}
    after = debris(run)
    return {
        "debris_before_gc": before,
        "debris_after_gc": after,
        "gc_files_removed": doc.get("files_removed"),
        "gc_then_verify_ok": ok and after == {"tmp_files": 0, "orphan_slots": 0},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=50)
    ap.add_argument("--steps", type=int, default=60, help="steps of one training run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", help="where the runs go (default: a temporary directory)")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "crash_soak.json"))
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = Path(a.dir or tempfile.mkdtemp(prefix="dstt-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ref = reference(a.steps, a.seed)
    outcomes: list[KillOutcome] = []
    episodes: list[dict[str, Any]] = []
    episode, kills = 0, 0
    run = work / f"run{episode}"
    while kills < a.kills:
        o = kill_once(run, ref, a.steps, a.seed, rng, delta=len(outcomes) % 2 == 1)
        outcomes.append(o)
        kills += not o.completed
        print(
            f"[{kills:>3}/{a.kills}] run{episode} {o.phase:<9} {o.mode:<6} "
            f"start={o.start:<3} trained={o.trained_to:<3} announced={o.announced:<3} "
            f"head={o.head:<3} {'delta' if o.delta else 'raw  '} {o.seconds:5.1f}s "
            f"{'OK' if not o.problems else 'FAIL ' + '; '.join(o.problems)}",
            flush=True,
        )
        if o.completed:
            episodes.append({"run": episode, **end_episode(run)})
            shutil.rmtree(run)
            episode += 1
            run = work / f"run{episode}"
    if run.exists() and (run / "zarr.json").exists():
        episodes.append({"run": episode, "unfinished": True, **end_episode(run)})
    failed = [o for o in outcomes if o.problems]
    bad_eps = [e for e in episodes if not e["gc_then_verify_ok"]]
    killed = [o for o in outcomes if not o.completed]
    doc = {
        "benchmark": "crash_soak",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "steps_per_run": a.steps,
        "seed": a.seed,
        "kills": len(killed),
        "children": len(outcomes),
        "runs_completed": sum(o.completed for o in outcomes),
        "failed_checks": len(failed) + len(bad_eps),
        "by_phase": dict(collections.Counter(o.phase for o in killed)),
        "by_mode": dict(collections.Counter(o.mode for o in killed)),
        "with_delta": sum(o.delta for o in killed),
        "head_after_last_announced": sum(o.head == o.announced + 1 for o in killed),
        "steps_lost_to_a_kill": sum(
            o.trained_to - o.head for o in killed if o.trained_to >= o.head
        ),
        "losses_checked_bit_exact": sum(o.checked_losses for o in outcomes),
        "verify_runs_ok": sum(o.verify_ok for o in outcomes),
        "episodes": episodes,
        "seconds": round(time.monotonic() - t0, 1),
        "outcomes": [o.as_json() for o in outcomes],
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(doc, indent=2) + "\n")
    if not a.dir:
        shutil.rmtree(work, ignore_errors=True)
    summary = {k: v for k, v in doc.items() if k not in ("outcomes", "episodes")}
    print(json.dumps(summary, indent=2))
    return 1 if failed or bad_eps else 0


if __name__ == "__main__":
    sys.exit(main())
