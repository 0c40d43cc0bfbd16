"""docs/api.md and docs/cli.md are generated from the code and must stay current; every Python
block of README.md and docs/*.md runs here (or in the test named for it) or is marked
`# fragment: ...` (issue 37); the examples the docs run do what they say."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_generated_docs_are_current() -> None:
    gen = runpy.run_path(str(ROOT / "scripts" / "gen_docs.py"))
    assert (ROOT / "docs" / "api.md").read_text() == gen["api"](), (
        "docs/api.md is stale: run python scripts/gen_docs.py"
    )
    assert (ROOT / "docs" / "cli.md").read_text() == gen["cli_doc"](), (
        "docs/cli.md is stale: run python scripts/gen_docs.py"
    )


def test_the_plain_zarr_reader_in_the_format_doc_reads_a_step(tmp_path: Path) -> None:
    """docs/format.md §7's reader, run as written (no dstt import) on a step dstt wrote."""
    import json
    import re
    import subprocess
    import sys

    import ml_dtypes
    import numpy as np

    from dstt.store import save

    text = (ROOT / "docs" / "format.md").read_text()
    code = re.search(r"## 7\..*?```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
    run = tmp_path / "run"
    rng = np.random.default_rng(0)
    want = {
        "params/layers/0/attn/weight": rng.standard_normal((6, 5), dtype=np.float32),
        "params/layers/0/attn/bias": rng.standard_normal(5).astype(ml_dtypes.bfloat16),
        "optim/step/layers/0/attn/weight": np.array(3.0, dtype=np.float32),
    }
    for step in range(8):  # the doc reads slot 7
        save(run, step, want)
    script = code.replace('"run/steps/', f'"{run}/steps/') + (
        "\nimport json, sys\n"
        # only the bfloat16 entry point may load dstt code (its store, never torch)
        "assert 'torch' not in sys.modules\n"
        "print(json.dumps({k: [str(v.dtype), list(v.shape), v.tobytes().hex()]"
        " for k, v in tensors.items()}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == [str(v.dtype), list(v.shape), v.tobytes().hex()], k


@pytest.mark.parametrize(
    ("page", "section"),
    [("integrations.md", "## `lightning.Trainer`"), ("replay.md", "### Lightning")],
    ids=["integrations", "replay"],
)
def test_the_lightning_examples_run_and_print_what_they_promise(
    page: str,
    section: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The first code block of the page's Lightning section, run as written: each
    ``print(...)  # out`` prints ``out``."""
    import re
    import warnings

    text = (ROOT / "docs" / page).read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index(section) :], re.S).group(1)  # type: ignore[union-attr]
    promised = re.findall(r"^print\(.*\)\s+# (.*)$", code, re.M)
    assert promised
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():  # Lightning's advice for a CPU run of a few batches
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*GPU available but not used.*")
        exec(compile(code, f"docs/{page}", "exec"), {"__name__": "__doc_example__"})
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == promised


# -- every Python block runs, or says it is a fragment ----------------------------------------

#: a block whose first line starts so is not run, and says why (what the reader must supply)
FRAGMENT = "# fragment:"
#: the documents whose other blocks run, top to bottom as one script, in a fresh folder
RUN_WHOLE = ("docs/quickstart.md", "docs/diagnosis.md")
#: documents whose complete blocks tests run (one test per block, in the document's order)
RUN_BY_TEST: dict[str, tuple[str, ...]] = {
    "docs/format.md": ("test_the_plain_zarr_reader_in_the_format_doc_reads_a_step",),
    "docs/integrations.md": (
        "tests/integrations/test_hf_timetravel.py::"
        "test_the_trainer_time_travel_block_in_the_docs_runs",
        "test_the_lightning_examples_run_and_print_what_they_promise[integrations]",
    ),
    "docs/replay.md": ("test_the_lightning_examples_run_and_print_what_they_promise[replay]",),
    "docs/performance.md": (
        "tests/engine/test_auto.py::test_the_auto_block_in_the_performance_doc_runs",
    ),
}


def _python_blocks(doc: str) -> list[str]:
    import re

    text = (ROOT / doc).read_text()
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", text, re.M | re.S)]


def _documents() -> list[str]:
    return ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]


def _is_fragment(block: str) -> bool:
    first = block.splitlines()[0] if block.strip() else ""
    return first.startswith(FRAGMENT) and len(first[len(FRAGMENT) :].strip()) >= 10


def test_every_python_block_runs_or_is_marked_a_fragment() -> None:
    """A reader sees which blocks run as written: each either runs in a test here or starts
    with ``# fragment: <what you supply>``."""
    unmarked = []
    for doc in _documents():
        complete = [b for b in _python_blocks(doc) if not _is_fragment(b)]
        if doc in RUN_WHOLE:
            continue
        if doc in RUN_BY_TEST:
            assert len(complete) == len(RUN_BY_TEST[doc]), (doc, "blocks run by", RUN_BY_TEST[doc])
            continue
        unmarked += [f"{doc}: {b.splitlines()[0]!r}" for b in complete]
    assert not unmarked, (
        "Python blocks neither run by tests/test_docs.py nor marked "
        f"'{FRAGMENT} <what the reader supplies>': {unmarked}"
    )


@pytest.mark.parametrize("doc", RUN_WHOLE)
def test_document_runs_as_written(doc: str, tmp_path: Path) -> None:
    """The document's complete blocks, in order, as one script in an empty folder."""
    import os
    import subprocess
    import sys

    blocks = [b for b in _python_blocks(doc) if not _is_fragment(b)]
    assert blocks, doc
    script = "\n".join(blocks)
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"{doc} fails as written:\n{proc.stderr[-4000:]}"


# -- every relative link resolves -------------------------------------------------------------


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces
    to hyphens (headings inside code fences are not headings)."""
    import re

    out: set[str] = set()
    fenced = False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#+\s+(.*)", line)):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def _relative_links(page: Path) -> list[str]:
    import re

    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    return [u for u in links if not re.match(r"[a-z][a-z0-9+.-]*:", u)]


def _broken_links(pages: list[Path]) -> list[str]:
    """Relative links of ``pages`` whose file, or whose Markdown heading, does not exist."""
    broken = []
    for page in pages:
        for link in _relative_links(page):
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.name}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.name}: {link} (no such heading)")
    return broken


def test_every_relative_link_of_the_docs_resolves() -> None:
    """Each relative link of README.md and docs/*.md names a file that exists and, for a
    Markdown target with ``#anchor``, one of its headings (moving or renaming a page breaks
    no reader's path through the docs)."""
    broken = _broken_links([ROOT / doc for doc in _documents()])
    assert not broken, broken


def test_the_link_check_catches_a_broken_link(tmp_path: Path) -> None:
    """The check itself, on a page with one good link, two broken ones and a code span."""
    (tmp_path / "a.md").write_text("# A page\n\n## Some heading, here\n\n```\n# not one\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#some-heading-here) [gone](c.md) [bad](a.md#nope) `[x](y.md)`\n")
    assert _anchors(tmp_path / "a.md") == {"a-page", "some-heading-here"}
    assert _broken_links([page]) == [
        "b.md: c.md (no such file)",
        "b.md: a.md#nope (no such heading)",
    ]
