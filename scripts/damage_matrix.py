#!/usr/bin/env python3
"""The damage matrix of docs/reliability.md: damage each kind of file of a small run three ways
and record what dstt makes of it.

    python scripts/damage_matrix.py            # markdown table on stdout
    python scripts/damage_matrix.py --check    # exit 1 if a row with its step files intact
                                               # loses a committed step

A 5-step run (two arrays, an RNG-like object per step, small chunks) is written with the store's
writer; for every kind of file (step zip, commit header of the head and of a middle step, ref,
HEAD, lock, index segment, side file, root zarr.json) and every damage (a bit flip, a
truncation to half, deletion) a copy is damaged, then: does ``verify`` report it; how many of
the 5 steps read back exactly (arrays and object); does the head load (what resume reads);
does ``verify --repair`` leave a clean run; and after repair and a ``gc`` how many committed
steps are lost (no longer read back exactly). Rejected alternative: a test per cell — the
matrix is a report of behaviour, the asserting tests are tests/store/maintenance/
test_metadata_damage.py and tests/reliability/test_corruption.py; ``--check`` keeps the one
rule of issue 36 (nothing committed lost while its step files are intact) enforced here.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dstt.errors import DsttError  # noqa: E402
from dstt.store import Repository, load  # noqa: E402
from dstt.store.format.layout import (  # noqa: E402
    HEAD_KEY,
    LOCK_KEY,
    commit_key,
    ref_key,
    side_file_key,
    step_file_key,
)

STEPS = (1, 2, 3, 4, 5)


def _value(step: int, n: int) -> np.ndarray:
    return (np.arange(64, dtype=np.float32).reshape(16, 4) + 100 * step + n).astype(np.float32)


def build(path: Path, index_every: int) -> dict[int, int]:
    """The run; step -> slot."""
    repo = Repository.create(path)
    slots = {}
    for s in STEPS:
        with repo.writer(chunk_bytes=64, index_every=index_every) as w:
            t = w.begin(s)
            for n, name in enumerate(("params/w", "params/b")):
                a = _value(s, n)
                plan = t.declare(name, "float32", a.shape)
                raw = a.reshape(-1).view(np.uint8)
                for i in range(plan.n_chunks):
                    lo, hi = plan.byte_range(i)
                    t.put_chunk(name, i, raw[lo:hi])
            t.put_object("rng", {"s": s})
            slots[s] = t.commit({"loss": 1.0 / s}).slot
    return slots


def readable(path: Path) -> set[int]:
    """The steps that read back exactly (both arrays and the object)."""
    ok = set()
    try:
        r = Repository(Repository.open(path).storage).reader()
    except (DsttError, OSError):
        return ok
    for s in STEPS:
        try:
            h = r.find(s)
            if all(
                np.array_equal(r.read_array(h, name), _value(s, n))
                for n, name in enumerate(("params/w", "params/b"))
            ) and r.read_object(h, "rng") == {"s": s}:
                ok.add(s)
        except (DsttError, OSError):
            continue
    return ok


def damage(path: Path, key: str, how: str, rng: random.Random) -> bool:
    """Damage ``key`` of the run at ``path``; False when there is no such file."""
    f = path / key
    if not f.is_file():
        return False
    data = f.read_bytes()
    if how == "delete":
        f.unlink()
    elif how == "truncate":
        f.write_bytes(data[: len(data) // 2])
    else:
        b = bytearray(data)
        if b:
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        f.write_bytes(bytes(b))
    return True


def kinds(path: Path, slots: dict[int, int]) -> dict[str, tuple[str, bool]]:
    """Kind of file -> (its key in the run, whether damaging it leaves every step file intact)."""
    index = sorted((path / "_dstt" / "index").glob("*"))
    return {
        "step zip (step 3)": (step_file_key(slots[3]), False),
        "side file: objects, arrays table (step 3)": (side_file_key(slots[3]), False),
        "commit header (step 3)": (commit_key(slots[3]), True),
        "commit header (head, step 5)": (commit_key(slots[5]), True),
        "ref (`refs/main.json`)": (ref_key("main"), True),
        "`HEAD.json`": (HEAD_KEY, True),
        "lock": (LOCK_KEY, True),
        "index segment": (str(index[0].relative_to(path)) if index else "", True),
        "root `zarr.json`": ("zarr.json", True),
    }


def cell(path: Path) -> dict[str, object]:
    row: dict[str, object] = {}
    try:
        rep = Repository(_storage(path)).verify()
        row["verify"] = "caught" if not rep.ok else "ok"
    except (DsttError, OSError) as e:
        row["verify"] = f"error ({type(e).__name__})"
    row["reads"] = len(readable(path))
    try:
        snap = load(path)
        row["resume"] = "yes" if snap.header.step == 5 else f"step {snap.header.step}"
    except (DsttError, OSError) as e:
        row["resume"] = f"no ({type(e).__name__})"
    try:
        fixed = Repository(_storage(path)).verify(repair=True)
        row["repair"] = "clean" if fixed.ok else f"{len(fixed.problems)} problem(s) left"
    except (DsttError, OSError) as e:
        row["repair"] = f"error ({type(e).__name__})"
    try:
        Repository.open(path).gc()
        row["gc"] = "ran"
    except (DsttError, OSError) as e:
        row["gc"] = f"refused ({type(e).__name__})"
    row["lost"] = len(STEPS) - len(readable(path))
    return row


def _storage(path: Path) -> object:
    from dstt.store import storage_for

    return storage_for(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if an intact row loses a step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--index-every",
        type=int,
        default=1,
        help="the writer's index interval (steps); a larger one leaves the last steps "
        "unindexed, their headers with no second copy",
    )
    args = ap.parse_args()
    rng = random.Random(args.seed)
    bad = 0
    with tempfile.TemporaryDirectory(prefix="dstt-damage-") as tmp:
        base = Path(tmp) / "base"
        slots = build(base, args.index_every)
        print(
            "| file | damage | verify | steps read exactly | head loads (resume) |"
            " `verify --repair` | then `gc` | committed steps lost |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for kind, (key, intact) in kinds(base, slots).items():
            for how in ("flip", "truncate", "delete"):
                run = Path(tmp) / "case"
                shutil.rmtree(run, ignore_errors=True)
                shutil.copytree(base, run)
                if not key or not damage(run, key, how, rng):
                    print(f"| {kind} | {how} | (no such file) | | | | | |")
                    continue
                row = cell(run)
                lost = row["lost"]
                flag = " **(step files intact)**" if intact and lost else ""
                bad += bool(intact and lost)
                print(
                    f"| {kind} | {how} | {row['verify']} | {row['reads']}/5 | {row['resume']} | "
                    f"{row['repair']} | {row['gc']} | {lost}{flag} |",
                    flush=True,
                )
    return 1 if args.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
