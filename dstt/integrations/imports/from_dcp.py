"""A ``torch.distributed.checkpoint`` folder (``.metadata`` + ``__<rank>_<n>.distcp``) as a
:class:`Checkpoint`, read with DCP's own reader in one process, whatever the world size.

Every tensor the metadata names is allocated whole on the CPU and filled by public
``dcp.load(..., no_dist=True)``, which assembles it from every rank's chunks (FSDP2, TP); the
planner's pickled values load with ``weights_only=True`` (``trusted=True`` unpickles fully),
and the nested layout comes back from the metadata's ``planner_data``. Model, optimizer (by
name or index), scheduler and step are found under the usual keys (torchtitan's included).

Rejected alternative: ``dcp_to_torch_save`` into a temporary file — a second full copy on
disk, and its planner unpickles with ``weights_only=False``. Layouts understood:
docs/decisions.md, "Module notes".
"""

from __future__ import annotations

import glob
import os
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from dstt.errors import SourceError, UnsafeObjectError

from .checkpoint import Checkpoint, NamedOptimizer, step_in_name
from .from_torch import OPTIMIZER_KEYS, SCHEDULER_KEYS, model_checkpoint
from .loading import numpy_globals

if TYPE_CHECKING:
    import io

__all__ = ["FORMAT", "is_dcp_folder", "read_dcp", "step_of_dcp"]

FORMAT = "dcp"
_PARTS = (
    "model",
    "optimizer",
    "optim",
    "lr_scheduler",
    "scheduler",
    "dataloader",
    "train_state",
    "step",
)


def is_dcp_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ".metadata")) and bool(
        glob.glob(os.path.join(path, "*.distcp"))
    )


def step_of_dcp(path: str) -> int | None:
    return step_in_name(os.path.basename(os.path.normpath(path)))


def _planner(trusted: bool) -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DCP's default planner, but pickled values load with ``weights_only=True``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            if trusted:
                return super().load_bytes(read_item, value)
            try:
                with torch.serialization.safe_globals(numpy_globals()):
                    obj = torch.load(value, weights_only=True)
            except Exception as e:  # torch's own unpickling errors vary
                raise UnsafeObjectError(
                    f"value {read_item.dest_index.fqn!r} needs full unpickling to load ({e}); "
                    "if you trust the checkpoint, pass --trusted (trusted=True)"
                ) from None
            self.state_dict[read_item.dest_index.fqn] = obj
            return None

    return SafePlanner(flatten_state_dict=False, flatten_sharded_tensors=False)


def _nest(flat: Mapping[str, Any], paths: Mapping[str, Any]) -> dict[Any, Any]:
    """Flat DCP keys back into nested dicts (``paths``: key -> its path tuple); a dict whose
    keys are exactly 0..n-1 and that was a list at save time (``param_groups``) is a list."""
    out: dict[Any, Any] = {}
    for key, value in flat.items():
        path = tuple(paths.get(key, (key,)))
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value

    def lists(x: Any, name: Any) -> Any:
        if isinstance(x, dict):
            x = {k: lists(v, k) for k, v in x.items()}
            if name == "param_groups" and x and set(x) == set(range(len(x))):
                return [x[i] for i in range(len(x))]
        return x

    nested: dict[Any, Any] = lists(out, None)
    return nested


def read_flat(path: str, trusted: bool) -> dict[Any, Any]:
    """Every entry of the DCP folder, nested as it was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = dcp.FileSystemReader(path)
    try:
        meta = reader.read_metadata()
    except Exception as e:  # a damaged .metadata raises pickle/OS errors
        raise SourceError(
            f"{path}/.metadata cannot be read ({e}); is the checkpoint complete?"
        ) from None
    flat: dict[str, Any] = {}
    for key, md in meta.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            flat[key] = None
        else:
            flat[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(flat, storage_reader=reader, planner=_planner(trusted), no_dist=True)
    except UnsafeObjectError:
        raise
    except Exception as e:  # DCP wraps reader failures in CheckpointException
        raise SourceError(
            f"{path}: DCP cannot read the checkpoint ({e}); is every __*.distcp file there?"
        ) from None
    paths = meta.planner_data if isinstance(meta.planner_data, Mapping) else {}
    return _nest(flat, paths)


def read_dcp(
    path: str,
    *,
    step: int | None = None,
    model: torch.nn.Module | None = None,
    trusted: bool = False,
) -> Checkpoint:
    """Read one DCP folder (see the module docstring)."""
    doc = read_flat(path, trusted)
    if isinstance(doc.get("model"), Mapping):
        sd = doc["model"]
    else:  # torchtitan: the model's keys at the top level
        sd = {k: v for k, v in doc.items() if k not in _PARTS and isinstance(v, torch.Tensor)}
    if not sd:
        raise SourceError(f"{path} holds no model tensors (keys: {sorted(map(str, doc))[:8]})")
    osd = next((doc[k] for k in OPTIMIZER_KEYS if isinstance(doc.get(k), Mapping)), None)
    k = step
    if k is None:
        train = doc.get("train_state")
        raw = doc.get("step", train.get("step") if isinstance(train, Mapping) else None)
        if isinstance(raw, torch.Tensor) and raw.numel() == 1:
            raw = int(raw.item())
        k = raw if isinstance(raw, int) else step_of_dcp(path)
    if k is None:
        raise SourceError(f"{path}: no step in its contents or name; pass step=/--step")
    named = osd is not None and all(
        isinstance(n, str) for g in osd.get("param_groups", []) for n in g.get("params", [])
    )
    ck = model_checkpoint(
        sd, None if named else osd, step=k, source=os.path.abspath(path), fmt=FORMAT, model=model
    )
    if named and osd is not None:
        ck.optimizer = NamedOptimizer.of(osd, [list(g["params"]) for g in osd["param_groups"]])
        missing = set(ck.optimizer.names) - set(ck.params)
        if missing:
            raise SourceError(
                f"{path}: the optimizer names parameters the model does not "
                f"have: {sorted(missing)[:5]}"
            )
    ck.scheduler = next((doc[s] for s in SCHEDULER_KEYS if doc.get(s) is not None), None)
    ck.files = {f: os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.distcp"))}
    ck.note_lacks()
    return ck
