"""Shared by the bench scripts: what produced a set of numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
        out["git_head"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                                         capture_output=True, check=True).stdout.strip()
        out["dstt_dirty"] = bool(subprocess.run(
            ["git", "status", "--porcelain", "--", "dstt"], cwd=root, text=True,
            capture_output=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        pass
    return out
