"""Small real things for tests, demos and benchmarks (imports torch; not loaded by ``dstt``).

``models`` a tiny GPT and a deterministic batch stream · ``llama`` a Llama-style decoder at
real sizes · ``spike_scenarios`` tiny runs with one spike mechanism planted in each · ``soak``
the crash soak's training process · ``storage`` a conformance suite for ``Storage`` backends
· ``writer_tests`` the step seam's contract test, ``WriterTests``.

``WriterTests`` resolves on first use (PEP 562): importing ``dstt.testing`` does not import
pytest.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .writer_tests import WriterTests

__all__ = ["WriterTests"]


def __getattr__(name: str) -> object:
    if name != "WriterTests":
        raise AttributeError(f"module 'dstt.testing' has no attribute {name!r}")
    value = _importlib.import_module(".writer_tests", __package__).WriterTests
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"WriterTests"})
