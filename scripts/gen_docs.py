"""Regenerate docs/api.md and docs/cli.md from the code (tests/test_docs.py checks they are
current): ``python scripts/gen_docs.py``."""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import sys
from pathlib import Path

os.environ["COLUMNS"] = "100"  # argparse wraps --help to the terminal: keep the docs stable

import dstt
from dstt import cli

ROOT = Path(__file__).resolve().parents[1]

SECTIONS = [
    ("Capture", ["session", "Session", "StepMetrics", "DeltaPolicy", "Retention"]),
    ("Inspect", ["open", "Run", "Snapshot"]),
    ("Import", ["import_checkpoints"]),
    ("Notebook", ["widgets.scrubber", "widgets.compare"]),
    ("Errors", sorted(n for n in dstt.__all__ if n.endswith("Error"))),
]


#: the public line, package by package (tests/test_public_api.py pins ``dstt`` and
#: ``dstt.store``): what a user may import, and from where
PUBLIC_PACKAGES = [
    ("dstt", "the user's API, the rest of this page"),
    ("dstt.errors", "the error tree (also in `dstt`)"),
    ("dstt.store", "the storage-level API, [store-api.md](store-api.md)"),
    ("dstt.widgets", "the notebook widgets"),
    ("dstt.analysis", "the spike rule `run.spikes()` applies"),
    (
        "dstt.testing",
        "test helpers the docs use, from their modules: `dstt.testing.models` (`TinyGPT`,"
        " `SyntheticBatches`), `dstt.testing.llama`, `dstt.testing.spike_scenarios`, and the"
        " conformance suites for your own backends",
    ),
]

#: dstt's own packages (internal) and the store's private seam
INTERNAL_PACKAGES = [
    ("dstt.store._internal", "the store's private seam: every store name dstt itself uses"),
    ("dstt.engine", "capture: the pipeline, torch state, parallelism"),
    ("dstt.training", "the sessions behind `dstt.session`"),
    ("dstt.inspect", "reading a run behind `dstt.open`"),
    ("dstt.run", "`Run`, `Snapshot` (public through `dstt`)"),
    ("dstt.schema", "the step format's vocabulary"),
    ("dstt.plots", "the plots behind `Run`'s methods"),
    ("dstt.integrations", "the HF Trainer and Lightning callbacks (public through `dstt`)"),
    ("dstt.cli", "the `dstt` command: [cli.md](cli.md)"),
]


def _store_rooms() -> list[str]:
    """The store's rooms (its subpackages): private, named in docs/decisions.md."""
    root = Path(dstt.__file__).parent / "store"
    return sorted(f"dstt.store.{p.name}" for p in root.iterdir() if (p / "__init__.py").exists())


def _underscored() -> list[str]:
    """Every underscored module of dstt (``__main__`` and ``__init__`` aside)."""
    root = Path(dstt.__file__).parent
    out = []
    for p in root.rglob("_*.py"):
        if p.name in ("__init__.py", "__main__.py"):
            continue
        out.append(".".join(p.relative_to(root.parent).with_suffix("").parts))
    return sorted(out)


def surface() -> list[str]:
    """The "Public surface" section: the public packages with their names, then the private
    ones."""
    import importlib

    out = [
        "## Public surface",
        "",
        "What a user imports, package by package; every other module is dstt's own.",
        "",
    ]
    for pkg, what in PUBLIC_PACKAGES:
        names = [] if pkg == "dstt" else getattr(importlib.import_module(pkg), "__all__", [])
        listed = ": " + ", ".join(f"`{n}`" for n in names) if names else ""
        out.append(f"- `{pkg}` — {what}{listed}")
    out += [
        "",
        "Internal — dstt's own packages: their names serve the public ones above and may move",
        "(a type the docs name, such as `dstt.inspect.rebuild.Rebuilt`, is returned, not",
        "imported). Private — the store's seam, its rooms and every underscored module: only",
        "dstt imports them (`tests/test_public_api.py` checks the store's, letting `tests/`,",
        "`bench/` and `scripts/damage_matrix.py` reach them as white-box checks).",
        "",
    ]
    out += [f"- `{pkg}` — {what}" for pkg, what in INTERNAL_PACKAGES]
    out += [
        "- the store's rooms: " + ", ".join(f"`{r}`" for r in _store_rooms()),
        "- every underscored module: " + ", ".join(f"`{m}`" for m in _underscored()),
        "",
    ]
    return out


def _resolve(name: str) -> object:
    obj: object = dstt
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _doc(obj: object) -> str:
    return inspect.cleandoc(obj.__doc__ or "").strip()


def _sig(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""


def _members(cls: type) -> dict[str, object]:
    """A class's own attributes and those it inherits from dstt's base classes, the nearest
    definition first."""
    out: dict[str, object] = {}
    for klass in cls.__mro__:
        if klass is cls or klass.__module__.startswith("dstt"):
            for k, v in vars(klass).items():
                out.setdefault(k, v)
    return out


def api() -> str:
    out = [
        "# API reference",
        "",
        "Generated from the docstrings by `scripts/gen_docs.py`; the public surface is",
        "`dstt.__all__`. Storage-level API: [store-api.md](store-api.md).",
        "",
        *surface(),
    ]
    for title, names in SECTIONS:
        out += [f"## {title}", ""]
        for name in names:
            obj = _resolve(name)
            kind = "class" if inspect.isclass(obj) else "function"
            sig = "" if kind == "class" and title == "Errors" else _sig(obj)
            out += [f"### `dstt.{name}{sig}`", "", _doc(obj), ""]
            if inspect.isclass(obj) and title != "Errors":
                for attr, member in sorted(_members(obj).items()):
                    if attr.startswith("_") or not (
                        inspect.isfunction(member) or isinstance(member, property)
                    ):
                        continue
                    fn = member.fget if isinstance(member, property) else member
                    first = (_doc(fn).split("\n\n")[0] or "").replace("\n", " ")
                    sig = "" if isinstance(member, property) else _sig(fn).replace("(self, ", "(")
                    sig = sig.replace("(self)", "()")
                    out.append(f"- `{attr}{sig}` — {first}" if first else f"- `{attr}{sig}`")
                out.append("")
    return "\n".join(out).rstrip() + "\n"


def _help(args: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        cli.main([*args, "--help"])
    return buf.getvalue().rstrip()


def cli_doc() -> str:
    parser_help = _help([])
    commands = [
        "ls",
        "log",
        "show",
        "diff",
        "verify",
        "rollback",
        "timeline",
        "timeline list",
        "timeline switch",
        "timeline rename",
        "timeline delete",
        "gc",
        "rebuild",
        "export",
        "import",
    ]
    out = [
        "# CLI reference",
        "",
        "Generated by `scripts/gen_docs.py` from `dstt --help`.",
        "",
        "```",
        parser_help,
        "```",
        "",
    ]
    for c in commands:
        out += [f"## `dstt {c}`", "", "```", _help(c.split()), "```", ""]
    return "\n".join(out).rstrip() + "\n"


def main() -> int:
    (ROOT / "docs" / "api.md").write_text(api())
    (ROOT / "docs" / "cli.md").write_text(cli_doc())
    return 0


if __name__ == "__main__":
    sys.exit(main())
