"""Export one commit as a file PyTorch loads: ``safetensors`` (the model) or ``torch.save``.

``safetensors``: the model's tensors (``params/`` and ``buffers/``) under their dotted names,
so ``model.load_state_dict(safetensors.torch.load_file(path))`` works; with ``include_all``
every other array (optimizer states, user arrays) is added under its store path.
``torch``: ``torch.save`` of ``{"model": ..., "optimizer": ..., "scheduler": ...}`` exactly as
``Snapshot.state_dict()`` gives it (:mod:`dstt.inspect.restore`), so each part goes straight
into ``model.load_state_dict`` / ``optimizer.load_state_dict`` (``torch.load(path,
weights_only=True)`` reads it); with ``include_all`` an ``"arrays"`` entry adds every other
array (the optimizer's already in ``"optimizer"`` excepted) under its store path. Values keep
their stored dtype (bfloat16 stays bfloat16, bit for bit). torch and safetensors are imported
only here, on demand.

The file is written next to its destination under a temporary name and renamed into place, so
a failed export leaves no half-written file; missing folders are created; an existing file is
replaced only with ``overwrite``; the result has the permissions of any new file
(``0o666 & ~umask``; safetensors alone would leave its private temporary file's ``0o600``).
``dcp``: a ``torch.distributed.checkpoint`` folder (:mod:`dstt.inspect.export_dcp`).
Rejected alternative: exporting a DeepSpeed checkpoint directory — its layout depends on the
parallelism at save time; a flat state dict (or DCP, which reshards on load) is what tools load.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any, Literal

from ..errors import OutputExistsError, StorageError
from ..schema import MODEL_KINDS, user_name

__all__ = ["FORMATS", "export_commit", "prepare_output"]

FORMATS = ("safetensors", "torch", "dcp")
Format = Literal["safetensors", "torch", "dcp"]


def _umask() -> int:
    mask = os.umask(0o022)  # the only portable way to read it is to set it
    os.umask(mask)
    return mask


def prepare_output(out: str | os.PathLike[str], *, overwrite: bool = False) -> str:
    """Check ``out`` can be written and create its missing folders; returns its path."""
    path = os.fspath(out)
    if os.path.isdir(path):
        raise OutputExistsError(f"{path} is a folder; give the export a file name "
                                f"(e.g. {os.path.join(path, 'step.safetensors')})")
    if os.path.lexists(path) and not overwrite:
        raise OutputExistsError(f"{path} exists; pass --force (overwrite=True) to replace it, "
                                "or choose another file name")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create the folder {parent} for the export: "
                           f"{e.strerror or e}") from e
    return path


def _write(path: str, save: Callable[[str], None]) -> None:
    """``save(tmp)``, then ``tmp`` renamed onto ``path`` with ordinary permissions."""
    head, tail = os.path.split(os.path.abspath(path))
    tmp = os.path.join(head, f".{tail}.dstt-export-{os.getpid()}")
    try:
        save(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":
            raise StorageError(f"cannot write the export to {path}: {e}") from e
        raise


def export_commit(reader: Any, header: Any, out: str | os.PathLike[str], fmt: Format, *,
                  include_all: bool = False, overwrite: bool = False,
                  progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Write commit ``header`` to ``out``; returns ``{"tensors": n, "bytes": b, "path": out}``
    (``n``: tensors in the file; ``b``: their bytes as stored)."""
    from ..engine._convert import tensor_from_numpy
    from .restore import step_state

    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "dcp":  # a folder dcp.load reads at any world size (dstt.inspect.export_dcp)
        from .export_dcp import export_dcp

        return export_dcp(reader, header, out, overwrite=overwrite, progress=progress)
    path = prepare_output(out, overwrite=overwrite)
    table = reader.arrays(header)
    model = [p for p in table if p.split("/")[0] in MODEL_KINDS]
    if fmt == "torch":
        doc = step_state(reader, header)
        done = set(model) | ({p for p in table if p.startswith("optim/")}
                             if doc["optimizer"] is not None else set())
    else:
        doc, done = {}, set()
    extra = sorted(p for p in table if p not in done and (include_all or p in model))
    tensors = {user_name(p): tensor_from_numpy(reader.read_array(header, p), table[p].dtype)
               for p in extra}
    counted = [p for p in table if p in done or p in extra]
    nbytes = sum(table[p].plan.nbytes for p in counted)
    if progress:
        progress(nbytes)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        meta = {"dstt_step": str(header.step), "dstt_timeline": header.timeline,
                "dstt_slot": str(header.slot)}
        _write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
        n = len(tensors)
    else:
        import torch

        if include_all:
            doc["arrays"] = tensors
        _write(path, lambda tmp: torch.save(doc, tmp))
        n = len(counted)
    return {"tensors": n, "bytes": nbytes, "path": path}
