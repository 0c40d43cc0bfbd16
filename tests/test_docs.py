"""docs/api.md and docs/cli.md are generated from the code and must stay current."""

from __future__ import annotations

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generated_docs_are_current() -> None:
    gen = runpy.run_path(str(ROOT / "scripts" / "gen_docs.py"))
    assert (ROOT / "docs" / "api.md").read_text() == gen["api"](), \
        "docs/api.md is stale: run python scripts/gen_docs.py"
    assert (ROOT / "docs" / "cli.md").read_text() == gen["cli_doc"](), \
        "docs/cli.md is stale: run python scripts/gen_docs.py"
