"""Export one commit as files PyTorch and Hugging Face load: ``safetensors``, ``torch``, ``hf``.

``safetensors``: the model's tensors under their dotted names, every tied name included;
``torch``: ``torch.save`` of ``Snapshot.state_dict()``'s ``{"model", "optimizer",
"scheduler"}``; ``hf``: a ``from_pretrained`` folder (``model.safetensors`` and
``config.json``); ``dcp``: :mod:`dstt.inspect.export_dcp`. Values keep their stored dtype,
bit for bit. Each file is written under a temporary name and renamed into place, so a failed
export leaves no half-written file; torch and safetensors are imported only here, on demand.

Rejected alternative: exporting a DeepSpeed checkpoint directory — its layout depends on the
parallelism at save time; a flat state dict (or DCP, which reshards on load) is what tools
load. Details (``include_all``, ``out`` as a folder, permissions): docs/decisions.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dstt.errors import ConfigError, OutputExistsError, StorageError
from dstt.schema import CONFIG_OBJECT, MODEL_KINDS, user_name

from .catalog import Catalog

if TYPE_CHECKING:
    from dstt.store._internal import CommitHeader, Reader

__all__ = ["FORMATS", "export_commit", "load_config", "prepare_output"]

FORMATS = ("safetensors", "torch", "hf", "dcp")
Format = Literal["safetensors", "torch", "hf", "dcp"]
_EXT = {"safetensors": "safetensors", "torch": "pt"}


def prepare_output(
    out: str | os.PathLike[str], *, overwrite: bool = False, default: str = ""
) -> str:
    """Check ``out`` can be written and create its missing folders; returns the file's path
    (``out`` itself, or ``out/default`` when ``out`` names a folder)."""
    path = os.fspath(out)
    if os.path.isdir(path) or path.endswith(("/", os.sep)):
        if not default:
            raise OutputExistsError(
                f"{path} is a folder; give the export a file name "
                f"(e.g. {os.path.join(path, 'step.safetensors')})"
            )
        path = os.path.join(path, default)
        if os.path.isdir(path):
            raise OutputExistsError(f"{path} is a folder; give the export a file name")
    if os.path.lexists(path) and not overwrite:
        raise OutputExistsError(
            f"{path} exists; pass --force (overwrite=True) to replace it, "
            "or choose another file name"
        )
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise StorageError(
            f"cannot create the folder {parent} for the export: {e.strerror or e}"
        ) from e
    return path


def _write(path: str, save: Callable[[str], object]) -> None:
    """``save(tmp)``, then ``tmp`` renamed onto ``path`` with ordinary permissions."""
    head, tail = os.path.split(os.path.abspath(path))
    tmp = os.path.join(head, f".{tail}.dstt-export-{os.getpid()}")
    try:
        save(tmp)
        mask = os.umask(0o022)  # the only portable way to read it is to set it
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":
            raise StorageError(f"cannot write the export to {path}: {e}") from e
        raise


def load_config(config: Any) -> dict[str, Any]:  # noqa: ANN401 - an object, dict, file or folder
    """A model config as a JSON dict from a ``transformers`` config object (``to_dict``), a
    mapping, a ``config.json`` path or a folder holding one."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(
            f"config must be a transformers config, a dict or a path to a "
            f"config.json (or a folder holding one), not {type(config).__name__}"
        )
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            got = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            f"no model config at {path}; give a config.json or a folder holding one"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read the model config {path}: {e}") from None
    if not isinstance(got, dict):
        raise ConfigError(f"{path} is no model config (a JSON object is expected)")
    return got


def export_commit(
    reader: Reader,
    header: CommitHeader,
    out: str | os.PathLike[str],
    fmt: Format,
    *,
    include_all: bool = False,
    overwrite: bool = False,
    config: Any = None,  # noqa: ANN401 - see load_config
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Write commit ``header`` to ``out``; returns ``{"tensors": n, "bytes": b, "path": p}``
    (``n``: tensors in the file; ``b``: their bytes as stored; ``p``: the file, or the
    folder of an ``hf`` export, which adds ``"files"``)."""
    from dstt.engine.tensors._convert import tensor_from_numpy

    from .restore import step_state

    if fmt not in FORMATS:
        raise ConfigError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")
    if fmt == "dcp":  # a folder dcp.load reads at any world size (dstt.inspect.export_dcp)
        from .export_dcp import export_dcp

        return export_dcp(reader, header, out, overwrite=overwrite, progress=progress)
    if fmt == "hf":
        if include_all:
            raise ConfigError(
                "an hf export holds the model only; leave include_all (--all) "
                "out, or export format torch for optimizer states too"
            )
        cfg = load_config(config) if config is not None else None
        if cfg is None and CONFIG_OBJECT in header.objects:
            cfg = reader.read_object(header, CONFIG_OBJECT)
        if cfg is None:
            raise ConfigError(
                f"step {header.step} has no model config (the session was not over a Hugging "
                "Face model); pass config= (--config PATH: a config.json or a folder with "
                "one) for the hf export"
            )
        config_doc: dict[str, Any] = dict(cfg)
        folder = os.fspath(out)
        files = [
            prepare_output(os.path.join(folder, name), overwrite=overwrite)
            for name in ("model.safetensors", "config.json")
        ]
    else:
        path = prepare_output(out, overwrite=overwrite, default=f"step{header.step}.{_EXT[fmt]}")
    cat = Catalog.of(reader, header)
    table = cat.stored
    model = [p for p in table if p.split("/")[0] in MODEL_KINDS]
    if fmt == "torch":
        doc = step_state(reader, header)
        done = set(model) | (
            {p for p in table if p.startswith("optim/")} if doc["optimizer"] is not None else set()
        )
    else:
        doc, done = {}, set()
    extra = sorted(p for p in table if p not in done and (include_all or p in model))
    tensors = {
        user_name(p): tensor_from_numpy(reader.read_array(header, p), table[p].dtype) for p in extra
    }
    counted = [p for p in table if p in done or p in extra]
    nbytes = sum(table[p].plan.nbytes for p in counted)
    if progress:
        progress(nbytes)
    meta = {
        "format": "pt",
        "dstt_step": str(header.step),
        "dstt_timeline": header.timeline,
        "dstt_slot": str(header.slot),
    }
    if fmt == "hf":
        _write_safetensors(files[0], tensors, meta)
        doc_text = json.dumps(config_doc, indent=2, sort_keys=True) + "\n"
        _write(files[1], lambda tmp: Path(tmp).write_text(doc_text, encoding="utf-8"))
        return {"tensors": len(tensors), "bytes": nbytes, "path": folder, "files": files}
    if fmt == "safetensors":
        for alias, target in cat.tied.items():  # one tensor per name: no shared storage
            if user_name(target) in tensors:
                tensors[user_name(alias)] = tensors[user_name(target)].clone()
        _write_safetensors(path, tensors, meta)
        return {"tensors": len(tensors), "bytes": nbytes, "path": path}
    import torch

    if include_all:
        doc["arrays"] = tensors
    _write(path, lambda tmp: torch.save(doc, tmp))
    return {"tensors": len(counted), "bytes": nbytes, "path": path}


def _write_safetensors(path: str, tensors: dict[str, Any], meta: dict[str, str]) -> None:
    from safetensors.torch import save_file

    _write(path, lambda tmp: save_file(tensors, tmp, metadata=meta))
