#!/usr/bin/env python3
"""The mutation audit: plant named one-line bugs one at a time and check that tests catch each.

    python scripts/mutants.py              # every mutation (after a baseline run)
    python scripts/mutants.py --only NAME  # one (repeatable); --list names them
    python scripts/mutants.py --no-baseline --markdown

Each mutation is a line or two a refactor could plausibly change (a range bound, a dropped
barrier, a buffer index): the file, the text it replaces (found exactly once, else the
mutation is *stale*: the code moved and the audit must be updated) and the pytest selection
that must catch it — with at least ``min_failed`` failing tests, so a bug caught by one test
only shows up here. The repository's files (tracked and untracked, not ignored) are copied
into a temporary directory once; each mutation edits its file there, runs its selection with
``PYTHONPATH`` on the copy (child processes included) and puts the file back. The working
tree is never edited. Before the mutants, each distinct selection runs once unmutated and must
pass (else "caught" would mean nothing).

Prints a table (mutation, tests run, failed, caught) and exits 1 if any mutation survives,
is stale, or a baseline fails. docs/reliability.md ("Mutation audit") has the last table.
The text is matched with its whitespace normalised (``locate``): spaces and line breaks
anywhere, and a trailing comma before a closing bracket, do not count, so a formatter that
splits a call over lines (``ruff format``) does not make a mutation stale; the replacement
keeps the indentation of the lines it replaces. Rejected alternatives: exact strings (two
went stale in one format), matching AST nodes (a mutation is a text edit, often of part of
a statement, and would need a node path per row).
Rejected alternative: a mutation-testing tool (mutmut, cosmic-ray) — thousands of blind
mutants per file; these are the bugs that were planted by hand and the tests that must catch
them, kept small enough to re-run after every refactor (minutes, not hours).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in words
    file: str
    old: str  # found exactly once in ``file``
    new: str
    tests: tuple[str, ...]  # pytest arguments (paths, node ids, -k ...)
    min_failed: int = 1


MUTATIONS = [
    # -- the three that survived the first audit (issue 29) ------------------------------
    Mutation(
        "commit-skips-last-rank",
        "rank 0 waits for ranks 1..world-2 only and commits without the last rank's part",
        "dstt/store/commit/ranks.py",
        "ranks=range(1, o.info.world), world=o.info.world,",
        "ranks=range(1, o.info.world - 1), world=o.info.world,",
        ("tests/store/commit/test_ranks.py",),
        2,
    ),
    Mutation(
        "flat-summary-other-buffer",
        "the in-process flat lane (no flusher) digests other bytes than the step it wrote",
        "dstt/store/_seam.py",
        "        txn.put_flat(layout, view, sink.images(view))\n"
        "        return _digest_here(d, view)",
        "        txn.put_flat(layout, view, sink.images(view))\n"
        "        return _digest_here(d, memoryview(bytearray(len(view))))",
        (
            "tests/engine/test_summary_paths.py",
            "tests/engine/test_session.py",
            "tests/inspect/test_inspect_summaries.py",
        ),
        2,
    ),
    Mutation(
        "encoded-summary-other-buffer",
        "an encoded step (written here, digested by the flusher) digests the other shared buffer",
        "dstt/store/flusher/child.py",
        'reply(("ok", rid, digest(objs[pid], maps[buffer], token)))',
        'reply(("ok", rid, digest(objs[pid], maps[(buffer + 1) % len(maps)], token)))',
        ("tests/engine/test_summary_paths.py", "tests/engine/test_session_delta.py"),
        2,
    ),
    Mutation(
        "part-vote-before-durable",
        "a part writer votes without its barrier: its files may not be durable",
        "dstt/store/commit/writer.py",
        "            txn.side.publish()\n            self.storage.barrier()\n",
        "            txn.side.publish()\n",
        (
            "tests/store/commit/test_ranks.py",
            "tests/store/commit/test_crash.py",
            "-k",
            "multi_rank or rank",
        ),
        2,
    ),
    # -- caught by one test only (or by chance) in the first audit -------------------------
    Mutation(
        "gc-prunes-fork-point",
        "gc does not keep the step another timeline forks from",
        "dstt/store/maintenance/gc.py",
        "            keep.add(ref.base_slot)",
        "            pass",
        (
            "tests/store/maintenance/test_timelines.py",
            "tests/engine/test_retention.py::test_same_policy_offline_and_in_the_cli",
        ),
        2,
    ),
    Mutation(
        "s3-ref-unconditional",
        "an S3 ref/HEAD is written without If-Match / If-None-Match",
        "dstt/store/storage/s3.py",
        'mode: Any = {"e_tag": seen} if seen is not None else "create"',
        'mode: Any = "overwrite"',
        ("tests/s3/test_s3_storage.py", "tests/s3/test_s3_run.py"),
        2,
    ),
    Mutation(
        "flusher-summary-other-buffer",
        "the flusher process digests the other shared buffer",
        "dstt/store/flusher/child.py",
        "stats = digest(objs[pid], maps[buffer], token) if pid is not None else None",
        "stats = digest(objs[pid], maps[(buffer + 1) % len(maps)], token)"
        " if pid is not None else None",
        ("tests/engine/test_summary_paths.py", "tests/engine/test_session.py"),
        2,
    ),
    Mutation(
        "flusher-reply-drops-summaries",
        "the parent drops the digest columns of the flusher's reply",
        "dstt/store/flusher/parent.py",
        "        return reply[2], reply[3], reply[4]",
        "        return reply[2], reply[3], None",
        ("tests/engine/test_summary_paths.py", "tests/engine/test_session.py"),
        2,
    ),
    # -- more of the same kind -------------------------------------------------------------
    Mutation(
        "part-vote-before-barrier",
        "a part writer writes its vote first and its barrier after",
        "dstt/store/commit/writer.py",
        "            self.storage.barrier()\n"
        "            part = Part(slot=txn.slot, step=txn.step, rank=rank, world=world, "
        "session=session,\n"
        "                        arrays=records, objects=dict(txn.objects), "
        "metrics=dict(metrics))\n"
        "            self.storage.write_durable(part_key(txn.slot, rank), dump_part(part))\n",
        "            part = Part(slot=txn.slot, step=txn.step, rank=rank, world=world, "
        "session=session,\n"
        "                        arrays=records, objects=dict(txn.objects), "
        "metrics=dict(metrics))\n"
        "            self.storage.write_durable(part_key(txn.slot, rank), dump_part(part))\n"
        "            self.storage.barrier()\n",
        ("tests/store/commit/test_ranks.py",),
        1,
    ),
    Mutation(
        "ref-before-header-durable",
        "a commit moves the ref without the barrier that makes its files and header durable",
        "dstt/store/commit/job.py",
        "    storage.create(commit_key(job.slot), dump_header(header))\n    storage.barrier()\n",
        "    storage.create(commit_key(job.slot), dump_header(header))\n",
        ("tests/store/commit/test_crash.py", "tests/store/commit/test_ranks.py", "-k", "power_cut"),
        2,
    ),
    Mutation(
        "chunk-crc-not-checked",
        "a chunk read back is not checked against its crc32c",
        "dstt/store/read/chunks.py",
        "if checksum(body) != chunk.crc32c or trailer != chunk.crc32c:",
        "if False:",
        ("tests/store/test_errors.py", "tests/reliability/test_corruption.py"),
        2,
    ),
    Mutation(
        "parts-of-any-session",
        "rank 0 accepts a vote another (crashed) session left in the slot",
        "dstt/store/commit/parts.py",
        "            if p.session != session:\n                continue",
        "            if False:\n                continue",
        ("tests/store/commit/test_ranks.py", "tests/store/commit/test_parts.py"),
        1,
    ),
    Mutation(
        "abort-vote-not-sent",
        "a rank that drops its step does not tell rank 0, which waits until its timeout",
        "dstt/store/commit/ranks.py",
        "if o.info.rank != 0 and not o.cancel.is_set():",
        "if False:",
        ("tests/store/commit/test_ranks.py", "tests/store/commit/test_parts.py"),
        1,
    ),
    Mutation(
        "merge-allows-shared-arrays",
        "two ranks writing one array are merged instead of refused",
        "dstt/store/commit/parts.py",
        "            if path in out_a:\n",
        "            if False:\n",
        ("tests/store/commit/test_parts.py", "tests/store/commit/test_ranks.py"),
        1,
    ),
    # -- issue 36: nothing committed lost to one damaged metadata file ----------------------
    Mutation(
        "gc-deletes-unproven-slots",
        "gc deletes unreachable slots it cannot prove abandoned (a timeline without a ref, "
        "newer than every head, an unreadable header)",
        "dstt/store/maintenance/gc.py",
        "    unproven = _unproven(r, reachable, newest, released)",
        "    unproven: set[int] = set()",
        (
            "tests/store/maintenance/test_metadata_damage.py",
            "tests/store/maintenance/test_gc_sweep.py",
            "tests/store/test_errors.py::test_failed_commit_then_gc_then_commit_with_the_same_storage",
        ),
        2,
    ),
    Mutation(
        "gc-ignores-damaged-metadata",
        "gc runs although a ref, HEAD or a reachable header is damaged",
        "dstt/store/maintenance/gc.py",
        "    if damage:\n        raise CorruptRunError(",
        "    if False:\n        raise CorruptRunError(",
        ("tests/store/maintenance/test_metadata_damage.py",),
        2,
    ),
    Mutation(
        "verify-hides-lost-ref",
        "verify does not report a timeline whose commits no ref reaches (its ref lost)",
        "dstt/store/maintenance/verify.py",
        "    for name, ref in sorted(r.recovered.items()):",
        "    for name, ref in []:",
        ("tests/store/maintenance/test_metadata_damage.py",),
        2,
    ),
    Mutation(
        "walk-stops-at-damaged-header",
        "a walk ends at a damaged header instead of stepping over it (the older steps hidden)",
        "dstt/store/read/reader.py",
        "                slot = self._bridge(slot, name, ref)",
        "                slot = None",
        (
            "tests/store/maintenance/test_metadata_damage.py",
            "tests/reliability/test_corruption.py::test_random_damage_to_timeline_documents",
        ),
        2,
    ),
    Mutation(
        "box-column-offset-ignored",
        "a box read takes every box's offset past the first dimension as 0 (TP Shard(1))",
        "dstt/store/read/shards.py",
        "for ll, h, o in zip(lo[1:], hi[1:], b.offsets[1:], strict=True)",
        "for ll, h, o in zip(lo[1:], hi[1:], [0] * len(lo[1:]), strict=True)",
        ("tests/store/read/test_shards.py", "tests/inspect/test_inspect_sharded.py"),
        2,
    ),
]


def _normal(text: str) -> tuple[str, list[int]]:
    """``text`` without whitespace and without a comma right before a closing bracket, and
    for each character left its index in ``text``."""
    chars: list[str] = []
    at: list[int] = []
    for i, c in enumerate(text):
        if c.isspace():
            continue
        if c in ")]}" and chars and chars[-1] == ",":
            chars.pop()
            at.pop()
        chars.append(c)
        at.append(i)
    return "".join(chars), at


def locate(text: str, old: str) -> list[tuple[int, int]]:
    """Where ``old`` is in ``text``, whitespace normalised (``_normal``): ``(start, end)``
    of each match in ``text``, widened to whole lines where ``old`` starts with indentation
    or ends with a line break, so a replacement written that way keeps the lines intact."""
    norm, at = _normal(text)
    want, _ = _normal(old)
    if not want:
        return []
    out = []
    i = norm.find(want)
    while i >= 0:
        start, end = at[i], at[i + len(want) - 1] + 1
        if old[:1].isspace():
            line = text.rfind("\n", 0, start) + 1
            if not text[line:start].strip():
                start = line
        if old.endswith("\n"):
            nl = text.find("\n", end)
            if nl >= 0 and not text[end:nl].strip(" \t,"):
                end = nl + 1
        out.append((start, end))
        i = norm.find(want, i + 1)
    return out


def mutate(text: str, m: Mutation) -> str | None:
    """``text`` with ``m`` planted, or None when its text is not found exactly once."""
    got = locate(text, m.old)
    if len(got) != 1:
        return None
    ((start, end),) = got
    return text[:start] + m.new + text[end:]


_COUNTS = re.compile(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)")


def repo_copy(dest: Path) -> None:
    """Tracked and untracked (not ignored) files of the working tree, as they are now."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    for rel in filter(None, out.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def run_tests(
    copy: Path, tests: tuple[str, ...], timeout: float
) -> tuple[dict[str, int], list[str], str]:
    """pytest's counts, the failing tests (node ids) and the tail of its output."""
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    cmd = [
        "nice",
        "-n",
        "10",
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rfE",
        "-p",
        "no:cacheprovider",
        *tests,
    ]
    try:
        p = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:]
        return {"timeout": 1}, [], tail.decode() if isinstance(tail, bytes) else str(tail)
    counts: dict[str, int] = {}
    for line in p.stdout.splitlines()[-3:]:
        for n, kind in _COUNTS.findall(line):
            counts[kind.rstrip("s") if kind.startswith("error") else kind] = int(n)
    if p.returncode not in (0, 1) and not counts.get("failed"):
        counts["error"] = counts.get("error", 0) + 1  # collection or usage error
    failing = [
        line.split()[1]
        for line in p.stdout.splitlines()
        if line.startswith(("FAILED ", "ERROR ")) and len(line.split()) > 1
    ]
    return counts, failing, p.stdout[-3000:] + p.stderr[-2000:]


def _short(nodes: list[str], most: int = 6) -> list[str]:
    """Failing node ids, parametrisations of one test folded (``test[a,b]``), at most
    ``most`` of them (then ``+N more``)."""
    by: dict[str, list[str]] = {}
    for n in nodes:
        base, _, param = n.partition("[")
        by.setdefault(base, []).append(param.rstrip("]"))
    out = [f"{b}[{','.join(p)}]" if any(p) else b for b, p in by.items()]
    return out[:most] + ([f"+{len(out) - most} more"] if len(out) > most else [])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", action="append", default=[], metavar="NAME")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument(
        "--no-baseline", action="store_true", help="skip the unmutated run of each selection"
    )
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    ap.add_argument("-v", "--verbose", action="store_true", help="show pytest's tail")
    args = ap.parse_args()
    if args.list:  # and check that none is stale (its text found exactly once in its file)
        stale = 0
        for m in MUTATIONS:
            path = ROOT / m.file
            n = len(locate(path.read_text(), m.old)) if path.is_file() else -1
            mark = (
                ""
                if n == 1
                else (" [STALE: no such file]" if n < 0 else f" [STALE: its text found {n} times]")
            )
            stale += bool(mark)
            print(f"{m.name:30} {m.file}: {m.what}{mark}")
        return 1 if stale else 0
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        ap.error(f"unknown mutation(s) {sorted(unknown)}; --list names them")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    bad = 0
    with tempfile.TemporaryDirectory(prefix="dstt-mutants-") as tmp:
        copy = Path(tmp)
        repo_copy(copy)
        if not args.no_baseline:
            for tests in dict.fromkeys(m.tests for m in chosen):
                t0 = time.monotonic()
                counts, _, tail = run_tests(copy, tests, args.timeout)
                ok = (
                    not counts.get("failed")
                    and not counts.get("error")
                    and not counts.get("timeout")
                    and counts.get("passed", 0) > 0
                )
                print(
                    f"baseline {' '.join(tests)}: {counts} ({time.monotonic() - t0:.0f} s)"
                    f"{'' if ok else '  FAILS UNMUTATED'}",
                    flush=True,
                )
                if not ok:
                    bad += 1
                    print(tail)
        rows = []
        for m in chosen:
            path = copy / m.file
            original = path.read_text()
            mutated = mutate(original, m)
            if mutated is None:
                n = len(locate(original, m.old))
                rows.append((m, "-", "-", f"STALE ({n} matches)", []))
                bad += 1
                continue
            path.write_text(mutated)
            t0 = time.monotonic()
            try:
                counts, failing, tail = run_tests(copy, m.tests, args.timeout)
            finally:
                path.write_text(original)
            failed = counts.get("failed", 0) + counts.get("error", 0)
            ran = failed + counts.get("passed", 0)
            caught = failed >= m.min_failed or bool(counts.get("timeout"))
            verdict = ("yes" if caught else "NO") + (" (timeout)" if counts.get("timeout") else "")
            if failed and failed < m.min_failed:
                verdict += f" (needs {m.min_failed})"
            rows.append((m, str(ran), str(failed), verdict, failing))
            bad += not caught
            print(
                f"{m.name}: {ran} run, {failed} failed, caught {verdict} "
                f"({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
            for node in failing:
                print(f"    {node}")
            if args.verbose or not caught:
                print(tail)
    print()
    if args.markdown:
        print("| mutation | bug | selection | run | failed | caught by |")
        print("|---|---|---|---|---|---|")
        for m, ran, failed, verdict, failing in rows:
            tests = " ".join(f"`{t.removeprefix('tests/')}`" for t in m.tests)
            by = "<br>".join(f"`{n.removeprefix('tests/')}`" for n in _short(failing))
            print(
                f"| `{m.name}` (`{m.file}`) | {m.what} | {tests} | {ran} | {failed} | "
                f"{verdict}: {by} |"
            )
    else:
        print(f"{'mutation':32} {'run':>5} {'failed':>6}  caught")
        for m, ran, failed, verdict, _ in rows:
            print(f"{m.name:32} {ran:>5} {failed:>6}  {verdict}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
