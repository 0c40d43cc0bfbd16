"""Export one commit as a ``torch.distributed.checkpoint`` folder that ``dcp.load`` reads into a
model and optimizer of any world size.

The folder holds ``{"model", "optimizer", "lr_scheduler", "step"}`` in the layout of DCP's own
state-dict helpers (``get_state_dict`` / ``set_state_dict``: the optimizer keyed by parameter
name), so the usual loading code works unchanged on one process or every rank of an FSDP2/TP
job. Tensors come from :func:`dstt.inspect.restore.step_state`, tied parameters under each
name; ``dcp.save(..., no_dist=True)`` writes into a temporary folder renamed into place, so a
failed export leaves nothing behind.

Rejected alternative: one ``.distcp`` file per source rank — the export runs in one process,
and DCP's loader reshards on read whatever the files' layout.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings
from typing import TYPE_CHECKING, Any

from dstt.errors import OutputExistsError, StorageError
from dstt.schema import OPTIM_GROUPS_OBJECT, TIED_OBJECT

if TYPE_CHECKING:
    from collections.abc import Callable

    from dstt.store._internal import CommitHeader, Reader

__all__ = ["export_dcp"]


def _prepare(out: str, overwrite: bool) -> str:
    path = os.path.abspath(out)
    if os.path.isfile(path):
        raise OutputExistsError(f"{path} is a file; a DCP export is a folder: choose another name")
    if os.path.lexists(path) and not overwrite:
        raise OutputExistsError(
            f"{path} exists; pass --force (overwrite=True) to replace it, "
            "or choose another folder name"
        )
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create the folder for {path}: {e.strerror or e}") from e
    return path


def export_dcp(
    reader: Reader,
    header: CommitHeader,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write commit ``header`` as the DCP folder ``out``; returns ``{"tensors": n,
    "bytes": b, "path": out}``."""
    import torch.distributed.checkpoint as dcp

    from dstt.engine.tensors._convert import from_plain

    from .restore import step_state

    path = _prepare(os.fspath(out), overwrite)
    doc = step_state(reader, header)
    model = dict(doc["model"])
    if TIED_OBJECT in header.objects:
        for name, stored in reader.read_object(header, TIED_OBJECT).items():
            if stored in model:
                model[name] = model[stored]
    state: dict[str, Any] = {"model": model, "step": int(header.step)}
    if doc["optimizer"] is not None:
        groups = from_plain(reader.read_object(header, OPTIM_GROUPS_OBJECT))
        names = [n for g in groups for n in g["params"]]
        osd = doc["optimizer"]
        state["optimizer"] = {
            "state": {names[i]: st for i, st in osd["state"].items()},
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
                for g in groups
            ],
        }
    if doc["scheduler"] is not None:
        state["lr_scheduler"] = doc["scheduler"]
    tensors = [t for t in _tensors(state)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    tmp = os.path.join(
        os.path.dirname(path), f".{os.path.basename(path)}.dstt-export-{os.getpid()}"
    )
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in one process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        if os.path.lexists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            shutil.rmtree(tmp)
        if isinstance(e, OSError):
            raise StorageError(f"cannot write the export to {path}: {e}") from e
        raise
    if progress:
        progress(nbytes)
    return {"tensors": len(tensors), "bytes": nbytes, "path": path}


def _tensors(x: Any) -> list[Any]:  # noqa: ANN401 - a nested state dict
    import torch

    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensors(v)]
    return []
