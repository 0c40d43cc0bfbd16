"""The public surface is explicit, sorted and torch-free at import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import dstt
from dstt import errors


def test_all_is_sorted_and_resolvable() -> None:
    assert dstt.__all__ == sorted(dstt.__all__)
    for name in dstt.__all__:
        assert getattr(dstt, name) is not None


def test_error_tree_subclasses_builtins() -> None:
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.DsttError)
        if cls is not errors.DsttError:
            # every concrete error is also catchable as the builtin it means
            assert any(b.__module__ == "builtins" and b is not Exception
                       for b in cls.__mro__[1:]), name
    assert issubclass(errors.NotARunError, FileNotFoundError)
    assert issubclass(errors.StepNotFoundError, KeyError)
    assert issubclass(errors.RunLockedError, BlockingIOError)
    assert issubclass(errors.StorageError, OSError)


def test_import_is_lazy() -> None:
    code = "import sys, dstt, dstt.store; print('torch' in sys.modules, 'xarray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def _module_imports(path: Path, package: str, *, nested: bool = False) -> set[str]:
    """Modules a source file imports at module level (TYPE_CHECKING blocks excluded);
    ``nested``: inside functions and classes too."""
    import ast

    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        top = not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        for sub in ast.walk(node) if nested or top else ():
            if isinstance(sub, ast.ImportFrom):
                if sub.level:
                    base = package.split(".")
                    base = base[:len(base) - sub.level + 1]
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


def test_the_store_has_one_front_door() -> None:
    """Outside ``dstt.store`` nothing imports a module of the store: only ``dstt.store``."""
    bad = []
    mods = _dstt_modules()
    for name, path in mods.items():
        if name == "dstt.store" or name.startswith("dstt.store."):
            continue
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for imp in _module_imports(path, pkg, nested=True):
            if imp.startswith("dstt.store.") and imp in mods:
                bad.append(f"{name} imports {imp}")
    assert not bad, bad


def test_module_imports_have_no_cycles() -> None:
    """Imports flow one way: no cycle among dstt's modules (module-level imports)."""
    mods = _dstt_modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for imp in _module_imports(path, pkg):
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
                cycles.append([*stack[stack.index(d):], d] if d in stack else [n, d])
            elif d not in state:
                visit(d, [*stack, d])
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [n])
    assert not cycles, cycles


def test_store_rooms_import_downward_only() -> None:
    """Inside the store: ``storage`` knows no format or codec, ``format`` no codec, and no room
    imports the store's top level (repository, writer, reader, ...)."""
    rooms = ("storage", "format", "codec")
    allowed = {"storage": {"storage"}, "format": {"storage", "format"},
               "codec": {"storage", "format", "codec"}}
    bad = []
    mods = _dstt_modules()
    for name, path in mods.items():
        parts = name.split(".")
        if parts[:2] != ["dstt", "store"] or len(parts) < 3 or parts[2] not in rooms:
            continue
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for imp in _module_imports(path, pkg, nested=True):
            ip = imp.split(".")
            if ip[:2] != ["dstt", "store"] or imp not in mods:
                continue
            if len(ip) < 3 or ip[2] not in allowed[parts[2]]:
                bad.append(f"{name} imports {imp}")
    assert not bad, bad
