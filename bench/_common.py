"""Shared by the bench scripts: what produced a set of numbers."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dstt.store.storage.posix import fsync_dir

MiB = 1024 * 1024


def source_state() -> dict[str, Any]:
    """Which library code produced the numbers: git HEAD, dirty flag, hash of dstt/**/*.py."""
    import hashlib
    import subprocess

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for p in sorted((root / "dstt").rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(p.read_bytes())
    out: dict[str, Any] = {"dstt_sources_sha256": h.hexdigest()[:16]}
    try:
        out["git_head"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, text=True, capture_output=True, check=True
        ).stdout.strip()
        out["dstt_dirty"] = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--", "dstt"],
                cwd=root,
                text=True,
                capture_output=True,
                check=True,
            ).stdout.strip()
        )
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def disk_bandwidth(root: Path, total: int) -> float:
    """Bytes/s writing ``total`` bytes as 64 MiB writes into one new file, then fsync."""
    piece = min(64 * MiB, total)
    buf = memoryview(os.urandom(piece))
    path = root / "disk-probe.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        done = 0
        while done < total:
            part = buf[: min(piece, total - done)]
            while part:
                n = os.write(fd, part)
                part = part[n:]
                done += n
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(root)
    dt = time.perf_counter() - t0
    path.unlink()
    return total / dt


def finish(
    res: dict[str, Any], out_json: Path, t_start: float, report: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Close a bench run: load and wall time into ``res``, print it, write it as JSON."""
    res["machine"]["loadavg_after"] = os.getloadavg()
    res["wall_s"] = time.perf_counter() - t_start
    report(res)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {out_json} ({res['wall_s']:.0f} s)")
    return res
