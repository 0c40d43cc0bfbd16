"""Reading foreign checkpoint files safely: ``torch.load`` with ``weights_only=True``.

Every pickled file goes through :func:`load_pickle` (``weights_only=True, mmap=True``: no code
from the file runs). Two allowlists widen it to plain data classes the framework's own
loader trusts: numpy's array reconstruction (the Trainer's ``rng_state.pth``) and, for
DeepSpeed's optimizer files only, ``LossScaler``, ``ZeroStageEnum`` and ``fragment_address``.
Anything else is an :class:`~dstt.errors.UnsafeObjectError` naming the file and the class,
unless ``trusted=True`` (``--trusted``) loads it with ``weights_only=False``.

Rejected alternative: ``weights_only=False`` with a warning — a checkpoint downloaded from
anywhere would run its code on ``dstt import``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from typing import TYPE_CHECKING, Any

import torch

from dstt.errors import SourceError, UnsafeObjectError

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["deepspeed_globals", "load_pickle", "numpy_globals", "read_safetensors"]


def numpy_globals() -> list[Any]:
    """numpy's array reconstruction (what ``np.random.get_state()`` pickles as)."""
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct  # noqa: SLF001 - the name numpy's pickles use
    return [reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def deepspeed_globals() -> list[Any]:
    """DeepSpeed's plain records in its ZeRO optimizer files (none if it is not installed)."""
    out: list[Any] = []
    for mod, name in (
        ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ):
        with contextlib.suppress(ImportError, AttributeError):
            out.append(getattr(__import__(mod, fromlist=[name]), name))
    return out


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_pickle(
    path: str | os.PathLike[str], *, trusted: bool = False, allow: Sequence[Any] = ()
) -> Any:
    """``torch.load`` of ``path`` onto the CPU, without running code from it (see the module
    docstring); ``trusted=True`` unpickles fully."""
    path = os.fspath(path)
    try:
        if trusted:
            return torch.load(path, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals([*numpy_globals(), *allow]):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:  # an old (non-zip) torch.save file cannot be mmapped
                if "mmap" not in str(e):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = _GLOBAL.search(str(e))
        what = f" ({found.group(1)})" if found else ""
        raise UnsafeObjectError(
            f"{path} needs full unpickling to load{what}, which could run code from the file; "
            "if you trust where it comes from, pass --trusted (trusted=True)"
        ) from None
    except FileNotFoundError:
        raise SourceError(f"{path} is missing") from None
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise SourceError(f"{path} cannot be read ({e}); is the checkpoint complete?") from None


def read_safetensors(paths: Sequence[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files, by name, in file order (names sorted within a
    file, as safetensors stores them)."""
    from safetensors import SafetensorError, safe_open

    out: dict[str, torch.Tensor] = {}
    for p in paths:
        try:
            with safe_open(p, framework="pt") as f:
                for k in f.keys():  # noqa: SIM118 - safe_open is no mapping
                    out[k] = f.get_tensor(k)
        except FileNotFoundError:
            raise SourceError(f"{p} is missing") from None
        except (SafetensorError, OSError) as e:
            raise SourceError(f"{p} cannot be read ({e}); is the checkpoint complete?") from None
    return out
