"""A package's lazy names (PEP 562), for ``dstt.engine``, ``dstt.training``, ``dstt.store``
(and its ``_internal``) and ``dstt.testing``: a name
resolves from its home module on first use and then stays in the package's namespace, so
importing the package costs nothing of what the name needs (torch, the multi-rank sessions).

Rejected alternative: each package writing its own ``__getattr__``/``__dir__`` pair, the same
dozen lines twice, differing only in the table.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping

__all__ = ["lazy_names"]


def lazy_names(
    package: str,
    homes: Mapping[str, str],
    public: Iterable[str],
    *,
    root: str | None = None,
    hint: str = "",
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``'s ``__init__`` (or a module's): ``homes``
    maps each lazy name to its module, relative to ``root`` (default ``package``:
    ``"capture.pipeline"``); ``dir()`` lists the namespace and ``public`` (its ``__all__``);
    ``hint`` ends the message of a name that is not there."""
    listed = frozenset(public)

    def getattr_(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}{hint}")
        value = getattr(importlib.import_module(f"{root or package}.{home}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | listed)

    return getattr_, dir_
