"""Small real things for tests, demos and benchmarks (imports torch; not loaded by ``dstt``).

``models`` a tiny GPT and a deterministic batch stream · ``llama`` a Llama-style decoder at
real sizes · ``spike_scenarios`` tiny runs with one spike mechanism planted in each ·
``storage`` a conformance suite for ``Storage`` backends · ``writer_tests`` the step seam's
contract test, ``WriterTests``. (The crash soak's child is test code: tests/reliability.)

``WriterTests`` resolves on first use (PEP 562): importing ``dstt.testing`` does not import
pytest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dstt._lazy import lazy_names as _lazy_names

if TYPE_CHECKING:
    from .writer_tests import WriterTests

__all__ = ["WriterTests"]

__getattr__, __dir__ = _lazy_names(__name__, {"WriterTests": "writer_tests"}, __all__)
