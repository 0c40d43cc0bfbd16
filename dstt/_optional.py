"""Optional dependencies, imported only when a feature that needs them is used.

``import dstt`` (and ``import dstt.widgets`` / ``dstt.plots``) must work on a training box that
has neither matplotlib nor ipywidgets; the first call that needs one raises an ``ImportError``
naming the extra that installs it. Rejected alternative: importing them at module import
behind ``try``/``except`` — every ``import dstt.plots`` would pay matplotlib's import time.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["require"]


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` or raise an ``ImportError`` telling how to install it for ``feature``."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]  # every optional module comes with the notebook extra
        raise ImportError(
            f"{feature} needs {top}, which is not installed: pip install 'dstt[notebook]'"
        ) from e
