"""The public surface is explicit, sorted and torch-free at import."""

from __future__ import annotations

import subprocess
import sys

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
