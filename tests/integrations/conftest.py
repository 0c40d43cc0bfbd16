"""The integration tests run offline and import their helpers (``hf_setup``) from here.

One guard: pytest's default import mode puts ``tests/`` on ``sys.path`` (for its conftest),
so ``import deepspeed`` finds ``tests/deepspeed/`` (and a full run collects that folder as the
top-level package ``deepspeed``). accelerate, inside the Trainer, imports DeepSpeed when it is
installed and then fails on that empty package; so before these tests run (after collection:
the DeepSpeed tests must still be collected under that name, and keep their module objects)
a session fixture imports the real one with ``tests/`` off the path.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _unshadow_deepspeed() -> None:
    mod = sys.modules.get("deepspeed")
    where = getattr(mod, "__file__", None) if mod is not None else None
    if mod is not None and (
        where is None or Path(where).resolve().parent != HERE.parent / "deepspeed"
    ):
        return  # the real one
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE.parent]
    try:
        importlib.import_module("deepspeed")
    except ImportError:
        pass  # not installed: accelerate will not look for it either
    finally:
        sys.path[:] = saved


@pytest.fixture(scope="session", autouse=True)
def _real_deepspeed() -> None:
    _unshadow_deepspeed()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for the test: bit-exact CPU math needs a fixed reduction order."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
