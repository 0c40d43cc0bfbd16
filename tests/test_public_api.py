"""The public surface is explicit, sorted and torch-free at import."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import dstt
from dstt import errors


def test_all_is_sorted_and_resolvable() -> None:
    assert dstt.__all__ == sorted(dstt.__all__)
    for name in dstt.__all__:
        assert getattr(dstt, name) is not None


def test_all_is_exactly_the_public_names() -> None:
    """Every public name of ``dstt`` is in ``__all__`` and nothing else is (as httpx's
    exported-members test): the module namespace (eager names) plus the lazy ones, without
    submodules and private names."""
    import __future__

    import types

    public = {
        n
        for n, v in vars(dstt).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType | __future__._Feature)
    }
    public |= set(dstt._LAZY) | {"__version__"}
    assert sorted(public) == dstt.__all__
    assert set(errors.__all__) <= set(dstt.__all__)  # every error of the tree is public


def test_version_comes_from_the_package_metadata() -> None:
    from importlib import metadata

    assert dstt.__version__ == metadata.version("dstt")


def test_error_tree_subclasses_builtins() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.DsttError)
        if cls is not errors.DsttError:
            # every concrete error is also catchable as the builtin it means
            assert any(
                b.__module__ == "builtins" and b is not Exception for b in cls.__mro__[1:]
            ), name
    assert issubclass(errors.NotARunError, FileNotFoundError)
    assert issubclass(errors.StepNotFoundError, KeyError)
    assert issubclass(errors.RunLockedError, BlockingIOError)
    assert issubclass(errors.StorageError, OSError)


def test_import_is_lazy() -> None:
    code = "import sys, dstt, dstt.store; print('torch' in sys.modules, 'xarray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_the_engine_imports_no_torch_until_a_name_is_used() -> None:
    """``dstt.engine`` and its rooms' ``__init__`` import nothing: ``capture.light`` (which
    ``dstt log`` reads) loads no torch; ``dstt.engine.Pipeline`` does."""
    code = (
        "import sys, dstt.engine, dstt.engine.capture.light; a = 'torch' in sys.modules; "
        "dstt.engine.Pipeline; print(a, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("package", ["dstt.engine", "dstt.training"])
def test_lazy_names_resolve_from_their_home(package: str) -> None:
    """Every name of a lazy package (``dstt._lazy``) is the object its home module defines
    and is in ``dir``; an unknown name is an ``AttributeError`` naming the package."""
    import importlib

    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        home = pkg._HOME.get(name)
        if home is not None:
            assert getattr(pkg, name) is getattr(importlib.import_module(f"{package}.{home}"), name)
        assert name in dir(pkg)
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'nope'"):
        pkg.nope  # noqa: B018


def _module_imports(
    path: Path, package: str, *, nested: bool = False, type_checking: bool = False
) -> set[str]:
    """Modules a source file imports at module level (TYPE_CHECKING blocks excluded unless
    ``type_checking``); ``nested``: inside functions and classes too."""
    import ast

    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if (
            isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
            and not type_checking
        ):
            continue
        top = not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for sub in ast.walk(node) if nested or top else ():
            if isinstance(sub, ast.ImportFrom):
                if sub.level:
                    base = package.split(".")
                    base = base[: len(base) - sub.level + 1]
                    name = ".".join([*base, sub.module] if sub.module else base)
                else:
                    name = sub.module or ""
                out.add(name)
                out.update(f"{name}.{a.name}" for a in sub.names)  # ``from . import x``
            elif isinstance(sub, ast.Import):
                out.update(a.name for a in sub.names)
    return out


def _dstt_modules() -> dict[str, Path]:
    root = Path(dstt.__file__).parent
    mods = {}
    for p in root.rglob("*.py"):
        rel = p.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def test_the_store_has_two_doors_only() -> None:
    """Outside ``dstt.store`` nothing in dstt imports a module of the store but its public
    line ``dstt.store`` and its private seam ``dstt.store._internal``."""
    doors = {"dstt.store", "dstt.store._internal"}
    bad = []
    mods = _dstt_modules()
    for name, path in mods.items():
        if name == "dstt.store" or name.startswith("dstt.store."):
            continue
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for imp in _module_imports(path, pkg, nested=True):
            if imp.startswith("dstt.store.") and imp in mods and imp not in doors:
                bad.append(f"{name} imports {imp}")
    assert not bad, bad


#: the store's public line (docs/api.md, docs/store-api.md): a run and its bytes, what a read
#: returns, whole steps, fewer bytes, retention — and nothing of the hot path
STORE_PUBLIC = {
    "ArrayRecord",
    "CommitHeader",
    "DeltaPolicy",
    "GcReport",
    "LocalStorage",
    "Reader",
    "Repository",
    "Retention",
    "Storage",
    "StoredStep",
    "adam_predictions",
    "load",
    "save",
    "sgd_predictions",
    "storage_for",
}


def test_the_store_exports_its_public_line_and_nothing_else() -> None:
    """``dstt.store.__all__`` is the literal public line; each name resolves to the object
    the private seam gives dstt, and an internal name is not reachable from the public door."""
    import dstt.store
    from dstt.store import _internal

    assert set(dstt.store.__all__) == STORE_PUBLIC
    assert dstt.store.__all__ == sorted(dstt.store.__all__)
    for name in dstt.store.__all__:
        assert getattr(dstt.store, name) is getattr(_internal, name), name
    with pytest.raises(AttributeError, match="_internal"):
        dstt.store.FlatImage  # noqa: B018


def internal_names_from_the_public_door(root: Path) -> list[str]:
    """Every import, in dstt's modules and the repository's tests, benches, scripts and
    examples under ``root``, of a name from ``dstt.store`` that is not on its public line
    (each fails only when it runs; this finds them all, e.g. after a merge)."""
    import ast

    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] not in ("dstt", "tests", "bench", "scripts", "examples"):
            continue
        if rel.parts[:2] == ("dstt", "store"):
            continue
        parts = list(rel.with_suffix("").parts)
        pkg = parts[:-1]  # a module's package; an ``__init__``'s is its folder
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            if mod == "dstt.store":
                bad += [
                    f"{rel}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name not in STORE_PUBLIC | {"_internal"}  # the seam as a module
                ]
    return bad


def test_internal_names_come_from_the_private_seam() -> None:
    """A name off the public line is imported from ``dstt.store._internal`` (in dstt, tests
    and benches), never from ``dstt.store``: the line that fails says which."""
    bad = internal_names_from_the_public_door(Path(dstt.__file__).parents[1])
    assert not bad, f"import these from dstt.store._internal: {bad}"


def test_the_public_door_check_catches_an_internal_name(tmp_path: Path) -> None:
    """The check itself: an engine module importing ``FlatImage`` relatively from the public
    door is found, ``Repository`` and the seam's import are not."""
    eng = tmp_path / "dstt" / "engine"
    eng.mkdir(parents=True)
    (eng / "m.py").write_text(
        "from ..store import FlatImage, Repository\nfrom ..store._internal import Flusher\n"
    )
    assert internal_names_from_the_public_door(tmp_path) == ["dstt/engine/m.py:1 FlatImage"]


#: names of the seam no dstt module imports, each for a reason: the documented whole-array
#: pair for scripts and other frameworks (docs/store-api.md), the S3 opener
#: (docs/object-store.md), the transaction half of the step-writer contract and the value
#: types a ``StepSink`` returns (``dstt.testing.WriterTests`` holds other sinks to them)
STORE_SEAM_EXTRAS = {
    "save",
    "load",
    "StoredStep",
    "storage_for",
    "StepTransaction",
    "SharedBuffers",
    "StepStats",
}


def test_the_store_seam_lists_what_dstt_uses_and_nothing_else() -> None:
    """``dstt.store._internal.__all__`` is what the engine, the session, inspection, the run,
    the CLI, the integrations and the test harness import from the store (plus the extras)."""
    import ast

    from dstt.store import _internal

    used: set[str] = set()
    mods = _dstt_modules()
    for name, path in mods.items():
        if name == "dstt.store" or name.startswith("dstt.store."):
            continue
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = pkg.split(".")
            mod = (
                ".".join(
                    [*base[: len(base) - node.level + 1], *([node.module] if node.module else [])]
                )
                if node.level
                else node.module
            )
            if mod in ("dstt.store", "dstt.store._internal"):
                used.update(a.name for a in node.names)
    used |= {v.split(":")[1] for v in dstt._LAZY.values() if v.startswith("dstt.store:")}
    assert sorted(used | STORE_SEAM_EXTRAS) == sorted(_internal.__all__)


#: where, outside ``dstt/``, an import of the store's private modules (``dstt.store._internal``
#: and the rooms ``dstt.store.<room>...``) is allowed: the house's own white-box checks, which
#: ship with the repository, not the package — the tests, the benches and the damage matrix
#: (it damages files by their on-disk keys). Examples, the other scripts, notebooks and the
#: docs' code show the public line only.
PRIVATE_STORE_ALLOWED = ("tests/", "bench/", "scripts/damage_matrix.py")

_PRIVATE_STORE_IMPORT = re.compile(
    r"^\s*(?:from\s+dstt\.store\.(\w+)[\w.]*\s+import|import\s+dstt\.store\.(\w+))", re.M
)


def private_store_imports(root: Path) -> list[str]:
    """Every import of a private store module in the repository at ``root``, outside ``dstt/``
    and the allowed folders: Python files, notebooks' code cells, the docs' code blocks."""
    import json

    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or rel.parts[0] == "dstt":
            continue
        if any(rel.as_posix().startswith(a) for a in PRIVATE_STORE_ALLOWED):
            continue
        if any(p.startswith(".") for p in rel.parts):
            continue
        if path.suffix in (".py", ".md"):
            text = path.read_text()
        elif path.suffix == ".ipynb":
            cells = json.loads(path.read_text())["cells"]
            text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        else:
            continue
        found += [f"{rel}: {m.group(0).strip()}" for m in _PRIVATE_STORE_IMPORT.finditer(text)]
    return found


def test_only_dstt_imports_the_store_internals() -> None:
    """The public line holds: nothing outside ``dstt/`` (and the allow-listed ``tests/``,
    ``bench/``) imports ``dstt.store._internal`` or a room of the store."""
    bad = private_store_imports(Path(dstt.__file__).parents[1])
    assert not bad, bad


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("examples/a.py", "from dstt.store._internal import FlatImage"),
        ("scripts/b.py", "import dstt.store.commit.ranks"),
        ("docs/c.md", "```python\nfrom dstt.store.read.shards import shard_map\n```"),
    ],
    ids=["seam", "room", "docs"],
)
def test_the_private_import_check_catches_one(tmp_path: Path, where: str, line: str) -> None:
    """The check itself: a private import in an example, a script or a doc is found; the same
    in ``tests/`` and an import of the public line are not."""
    (tmp_path / where).parent.mkdir(parents=True)
    (tmp_path / where).write_text(line + "\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text(line + "\n")
    (tmp_path / "examples" / "ok.py").parent.mkdir(exist_ok=True)
    (tmp_path / "examples" / "ok.py").write_text("from dstt.store import Repository\n")
    assert [f.split(":")[0] for f in private_store_imports(tmp_path)] == [where]


def test_module_imports_have_no_cycles() -> None:
    """Imports flow one way: no cycle among dstt's modules, at any level — module-level,
    function-level and ``TYPE_CHECKING`` imports alike (a back-reference for the type checker
    is a cycle too: the two modules cannot be understood, or moved, one without the other)."""
    mods = _dstt_modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for imp in _module_imports(path, pkg, nested=True, type_checking=True):
            while imp and imp not in mods:
                imp = imp.rsplit(".", 1)[0] if "." in imp else ""
            if imp and imp != name and not name.startswith(imp + "."):
                deps.add(imp)  # a package importing its own submodules is not a cycle
        graph[name] = deps
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            if d.startswith(n + "."):
                continue
            if state.get(d) == 1:
                cycles.append([*stack[stack.index(d) :], d] if d in stack else [n, d])
            elif d not in state:
                visit(d, [*stack, d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


#: the house, bottom up (docs/decisions.md, "dstt's tree"): a package may import only packages of
#: a lower layer (function-level and TYPE_CHECKING imports included); the top-level ``dstt``
#: module is the lazy facade
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "schema", "_optional", "_lazy"),
    ("_lru", "analysis"),  # analysis: numpy-only metric rules (spikes); raises dstt.errors
    ("store",),
    ("engine",),
    ("training", "inspect"),
    ("run",),  # dstt/run/: Run, Snapshot, RunDiagnostics; reads through store and inspect
    ("plots",),
    ("widgets",),
    ("integrations", "testing"),
    ("cli",),  # dstt/cli/: above run, inspect and integrations (`dstt import`); nothing imports it
)


def _package(module: str) -> str:
    """The house package of a dstt module (``dstt.store.read.reader`` -> ``store``)."""
    return module.split(".")[1] if "." in module else "dstt"


def package_arrows(mods: dict[str, Path]) -> set[tuple[str, str, str]]:
    """(from package, to package, example import) for every import between two packages."""
    out = set()
    for name, path in mods.items():
        if name == "dstt":
            continue
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for imp in _module_imports(path, pkg, nested=True, type_checking=True):
            if not imp.startswith("dstt.") or imp == "dstt":
                continue
            a, b = _package(name), _package(imp)
            if a != b:
                out.add((a, b, f"{name} imports {imp}"))
    return out


def test_packages_import_down_the_layers_only() -> None:
    """No arrow against the layering (store <- engine <- training; store <- inspect <- run <-
    plots/widgets/cli; integrations <- cli) and so no cycle between packages, nothing imports
    the CLI; every package has a layer."""
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    mods = _dstt_modules()
    unknown = {_package(m) for m in mods if m != "dstt"} - set(rank)
    assert not unknown, f"packages without a layer in LAYERS: {sorted(unknown)}"
    bad = sorted(why for a, b, why in package_arrows(mods) if rank[b] >= rank[a])
    assert not bad, bad


@pytest.mark.parametrize(
    "line",
    ["from dstt.inspect.naming import select", "from ..inspect.naming import select"],
    ids=["absolute", "relative"],
)
def test_the_layer_check_catches_an_upward_import(tmp_path: Path, line: str) -> None:
    """The check itself: an engine module importing dstt.inspect (the cycle round 2 had),
    written by its full name (as dstt writes a parent package's modules) or relatively."""
    fake = tmp_path / "dstt" / "engine"
    fake.mkdir(parents=True)
    (fake / "naming_user.py").write_text(line + "\n")
    arrows = package_arrows({"dstt.engine.naming_user": fake / "naming_user.py"})
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    assert {(a, b) for a, b, _ in arrows if rank[b] >= rank[a]} == {("engine", "inspect")}


def test_the_cli_sits_on_top() -> None:
    """``cli`` is the top layer alone: nothing in dstt imports it (the run, the widgets and the
    integrations are below it)."""
    assert LAYERS[-1] == ("cli",)
    assert not [why for a, b, why in package_arrows(_dstt_modules()) if b == "cli"]


#: the packages whose ``__init__`` docstring names each of their modules (the store's rooms
#: have their own test below)
DOCUMENTED_PACKAGES = (
    "dstt.analysis",
    "dstt.cli",
    "dstt.engine",
    "dstt.inspect",
    "dstt.integrations",
    "dstt.plots",
    "dstt.run",
    "dstt.testing",
    "dstt.training",
    "dstt.widgets",
)


def undocumented_modules(mods: dict[str, Path], packages: tuple[str, ...]) -> list[str]:
    """The direct modules (and subpackages) of ``packages`` their ``__init__`` docstring does
    not name as ````module````."""
    import ast

    missing = []
    for pkg in packages:
        doc = ast.get_docstring(ast.parse(mods[pkg].read_text())) or ""
        missing += [
            name
            for name in mods
            if name.startswith(f"{pkg}.")
            and name.count(".") == pkg.count(".") + 1
            and f"``{name.rsplit('.', 1)[1]}``" not in doc
        ]
    return missing


def test_every_module_is_named_in_its_packages_docstring() -> None:
    """A reader finds every module of a package from its ``__init__`` docstring, as for the
    store's rooms (docs/architecture.md starts there); the engine's rooms (``ENGINE_ROOMS``)
    each name theirs."""
    rooms = tuple(f"dstt.engine.{r}" for r in ENGINE_ROOMS if r)
    missing = undocumented_modules(_dstt_modules(), DOCUMENTED_PACKAGES + rooms)
    assert not missing, missing


def test_the_module_list_check_catches_an_unnamed_module(tmp_path: Path) -> None:
    """The check itself: a package naming one of its two modules."""
    (tmp_path / "__init__.py").write_text('"""Pkg: ``named`` does a thing."""\n')
    mods = {
        "dstt.pkg": tmp_path / "__init__.py",
        "dstt.pkg.named": tmp_path / "named.py",
        "dstt.pkg.unnamed": tmp_path / "unnamed.py",
        "dstt.pkg.sub.deep": tmp_path / "deep.py",
    }
    assert undocumented_modules(mods, ("dstt.pkg",)) == ["dstt.pkg.unnamed"]


#: the store's rooms, bottom up (docs/decisions.md, "The store's tree"): a module imports modules
#: of its own room or a lower one, never a higher one (function-level and TYPE_CHECKING imports
#: included); ``""`` is the store's top level — the front door ``__init__``, ``repository``,
#: ``api``, ``protocols``, ``bfloat16`` — which may import every room and which no room imports
STORE_ROOMS: tuple[str, ...] = (
    "storage",
    "format",
    "codec",
    "index",
    "read",
    "maintenance",
    "commit",
    "flusher",
    "",
)


def _store_room(module: str, mods: dict[str, Path]) -> str:
    """The room of a module of a house package, the store's or the engine's (``""``: the
    package's top level)."""
    parts = module.split(".")
    if len(parts) > 3 or (len(parts) == 3 and mods[module].name == "__init__.py"):
        return parts[2]
    return ""


def room_arrows(
    mods: dict[str, Path], package: str = "dstt.store", rooms: tuple[str, ...] = STORE_ROOMS
) -> list[str]:
    """Every import inside ``package`` from a room to a higher one of ``rooms``."""
    rank = {r: i for i, r in enumerate(rooms)}
    bad = set()
    for name, path in mods.items():
        if not name.startswith(f"{package}."):
            continue
        here = _store_room(name, mods)
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for imp in _module_imports(path, pkg, nested=True, type_checking=True):
            while imp and imp not in mods:
                imp = imp.rsplit(".", 1)[0] if "." in imp else ""
            if not (imp == package or imp.startswith(f"{package}.")) or imp == name:
                continue
            there = "" if imp == package else _store_room(imp, mods)
            if rank[there] > rank[here]:
                bad.add(f"{name} ({here or 'top'}) imports {imp} ({there or 'top'})")
    return sorted(bad)


def store_room_arrows(mods: dict[str, Path]) -> list[str]:
    """Every import inside the store from a room to a higher one."""
    return room_arrows(mods, "dstt.store", STORE_ROOMS)


def test_store_rooms_import_downward_only() -> None:
    """Inside the store: ``storage`` knows no format, ``format`` no codec, the index no
    reader, the reader no maintenance, maintenance no writer, the writer no flusher, and no
    room imports the store's top level (repository, api, protocols, the front door)."""
    mods = _dstt_modules()
    rooms = {_store_room(m, mods) for m in mods if m.startswith("dstt.store.")}
    assert rooms == set(STORE_ROOMS), f"rooms without a place in STORE_ROOMS: {rooms}"
    bad = store_room_arrows(mods)
    assert not bad, bad


@pytest.mark.parametrize(
    "module", ["dstt.store.commit.writer", "..commit.writer"], ids=["absolute", "relative"]
)
def test_the_room_check_catches_an_upward_import(tmp_path: Path, module: str) -> None:
    """The check itself: gc typed against the writer (the cycle round 2 had), imported by
    its full name or relatively."""
    fake = tmp_path / "dstt" / "store" / "maintenance"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "gc.py").write_text(
        f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {module} import Writer\n"
    )
    commit = tmp_path / "dstt" / "store" / "commit"
    commit.mkdir()
    (commit / "__init__.py").write_text("")
    (commit / "writer.py").write_text("")
    mods = {
        "dstt.store.maintenance": fake / "__init__.py",
        "dstt.store.maintenance.gc": fake / "gc.py",
        "dstt.store.commit": commit / "__init__.py",
        "dstt.store.commit.writer": commit / "writer.py",
    }
    assert store_room_arrows(mods) == [
        "dstt.store.maintenance.gc (maintenance) imports dstt.store.commit.writer (commit)"
    ]


#: the engine's rooms, bottom up (docs/decisions.md, "The engine's rooms"): as in the store, a
#: module imports modules of its own room or a lower one, never a higher one (function-level
#: and TYPE_CHECKING imports included); ``""`` is ``dstt.engine`` itself, the lazy facade,
#: which no room imports
ENGINE_ROOMS: tuple[str, ...] = ("tensors", "state", "capture", "distributed", "ds", "")


def test_engine_rooms_import_downward_only() -> None:
    """Inside the engine: ``tensors`` knows no provider, ``state`` no pipeline, ``capture``
    no rank, ``distributed`` no DeepSpeed, and no room imports ``dstt.engine`` (every module
    of the engine lives in a room)."""
    mods = _dstt_modules()
    rooms = {_store_room(m, mods) for m in mods if m.startswith("dstt.engine.")}
    assert rooms == set(ENGINE_ROOMS) - {""}, f"rooms without a place in ENGINE_ROOMS: {rooms}"
    bad = room_arrows(mods, "dstt.engine", ENGINE_ROOMS)
    assert not bad, bad


@pytest.mark.parametrize(
    ("module", "there"),
    [
        ("dstt.engine.capture.pipeline", "dstt.engine.capture.pipeline (capture)"),
        ("..capture.pipeline", "dstt.engine.capture.pipeline (capture)"),
        ("dstt.engine", "dstt.engine (top)"),
    ],
    ids=["absolute", "relative", "top"],
)
def test_the_engine_room_check_catches_an_upward_import(
    tmp_path: Path, module: str, there: str
) -> None:
    """The check itself: a provider typed against the pipeline, imported by its full name or
    relatively, or through the engine's lazy facade; the pipeline's import of a provider
    (downward) is not reported."""
    eng = tmp_path / "dstt" / "engine"
    files = {
        "dstt.engine": "__init__.py",
        "dstt.engine.state": "state/__init__.py",
        "dstt.engine.state.providers": "state/providers.py",
        "dstt.engine.capture": "capture/__init__.py",
        "dstt.engine.capture.pipeline": "capture/pipeline.py",
    }
    for rel in files.values():
        (eng / rel).parent.mkdir(parents=True, exist_ok=True)
        (eng / rel).write_text("")
    (eng / "state" / "providers.py").write_text(
        f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from {module} import Pipeline\n"
    )
    (eng / "capture" / "pipeline.py").write_text(
        "from dstt.engine.state.providers import StateProvider\n"
    )
    mods = {name: eng / rel for name, rel in files.items()}
    assert room_arrows(mods, "dstt.engine", ENGINE_ROOMS) == [
        f"dstt.engine.state.providers (state) imports {there}"
    ]


def test_every_store_module_is_named_in_its_rooms_docstring() -> None:
    """A reader finds every module of the store from its room's ``__init__`` docstring (the
    top level's in docs/decisions.md, "The store's tree")."""
    import ast

    mods = _dstt_modules()
    tree = (Path(dstt.__file__).parents[1] / "docs" / "decisions.md").read_text()
    missing = []
    for name, path in mods.items():
        if not name.startswith("dstt.store.") or path.name == "__init__.py":
            continue
        room = _store_room(name, mods)
        stem = name.rsplit(".", 1)[1]
        if room:
            doc = ast.get_docstring(ast.parse(mods[f"dstt.store.{room}"].read_text())) or ""
            if f"``{stem}``" not in doc:
                missing.append(name)
        elif f"{stem}.py" not in tree:
            missing.append(name)
    assert not missing, missing


#: the most lines a module docstring may have: what the module is for, the design choice and
#: the rejected alternative (issue 38, item 7); longer stories go to docs/decisions.md
DOCSTRING_LINES = 12

#: the modules whose docstring may be longer than ``DOCSTRING_LINES``: none since every one
#: was shortened (their longer stories are in docs/decisions.md, "Module notes"); never add.
LONG_DOCSTRINGS: frozenset[str] = frozenset()


def docstring_lengths(root: Path) -> dict[str, int]:
    """The line count of each module docstring under ``root``'s ``dstt/``, by path relative
    to ``root`` (modules without a docstring are left out)."""
    import ast

    lengths: dict[str, int] = {}
    for p in sorted((root / "dstt").rglob("*.py")):
        doc = ast.get_docstring(ast.parse(p.read_text()), clean=False)
        if doc:
            lengths[p.relative_to(root).as_posix()] = len(doc.strip().splitlines())
    return lengths


def docstring_ratchet(lengths: dict[str, int], allowed: frozenset[str]) -> list[str]:
    """What breaks the ratchet: a docstring over ``DOCSTRING_LINES`` not in ``allowed``, and an
    ``allowed`` path whose docstring is short now (or that is gone)."""
    too_long = {path for path, n in lengths.items() if n > DOCSTRING_LINES}
    return [
        f"{path}: {lengths[path]} docstring lines; at most {DOCSTRING_LINES}: purpose, design "
        "choice, rejected alternative (longer stories to docs/decisions.md)"
        for path in sorted(too_long - allowed)
    ] + [
        f"{path}: docstring is short now (or the file is gone); delete it from LONG_DOCSTRINGS"
        for path in sorted(allowed - too_long)
    ]


def test_module_docstrings_are_short() -> None:
    """Every module docstring in dstt/ is at most ``DOCSTRING_LINES`` lines, but the listed
    ones; and the list shrinks as they are shortened."""
    problems = docstring_ratchet(docstring_lengths(Path(dstt.__file__).parents[1]), LONG_DOCSTRINGS)
    assert not problems, "\n".join(problems)


def test_the_docstring_ratchet_catches_a_long_one_and_a_stale_entry(tmp_path: Path) -> None:
    """The check itself: a new long docstring fails, a listed one still long passes, and a
    listed one made short fails until it is delisted."""
    pkg = tmp_path / "dstt"
    pkg.mkdir()
    long = "\n".join(f"line {i}" for i in range(DOCSTRING_LINES + 1))
    (pkg / "new.py").write_text(f'"""{long}\n"""\n')
    (pkg / "listed.py").write_text(f'"""{long}\n"""\n')
    (pkg / "fixed.py").write_text('"""Short.\n\nTwo lines of story.\n"""\n')
    (pkg / "bare.py").write_text("x = 1\n")
    lengths = docstring_lengths(tmp_path)
    assert lengths == {
        "dstt/fixed.py": 3,
        "dstt/listed.py": DOCSTRING_LINES + 1,
        "dstt/new.py": DOCSTRING_LINES + 1,
    }
    problems = docstring_ratchet(lengths, frozenset({"dstt/listed.py", "dstt/fixed.py"}))
    assert [p.split(":")[0] for p in problems] == ["dstt/new.py", "dstt/fixed.py"]
    assert "delete it from LONG_DOCSTRINGS" in problems[1]
    assert not docstring_ratchet(lengths, frozenset({"dstt/listed.py", "dstt/new.py"}))
