"""One :class:`Checkpoint` as one commit, laid out as the capture engine lays out a step.

Arrays ``params/<name>``, ``buffers/<name>`` and ``optim/<state>/<name>`` with the engine's
dimension names; objects encoded as the engine encodes them (``optim/state``,
``optim/param_groups``, ``scheduler``, ``rng``, progress objects, write-time ``summaries``,
``metrics/history``) plus ``import/source`` (path, format, files read, what the source
lacked); the header carries the step's logged metrics. Everything goes into one store
transaction; any failure aborts it, so a bad source never leaves a half-committed step.

Rejected alternative: a reader per foreign format inside dstt's views — every view would
need to know five layouts (docs/decisions.md, "Replay and import").
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from dstt import schema
from dstt.engine.state.dims import ModelDims
from dstt.engine.tensors._convert import flat_bytes, store_dtype, to_plain
from dstt.schema import IMPORT_OBJECT, METRICS_HISTORY_OBJECT, tensor_path
from dstt.training.metrics import metric_value

if TYPE_CHECKING:
    from collections.abc import Mapping

    from dstt.engine.capture.summaries import SummaryBook
    from dstt.store._internal import CommitHeader

    from .checkpoint import Checkpoint

__all__ = ["arrays_of", "write_checkpoint"]


def arrays_of(ck: Checkpoint) -> dict[str, torch.Tensor]:
    """Every array of the step by store path."""
    out = {tensor_path("params", n): t for n, t in ck.params.items()}
    out.update({tensor_path("buffers", n): t for n, t in ck.buffers.items()})
    if ck.optimizer is not None:
        for name, st in ck.optimizer.state.items():
            for key, v in st.items():
                if isinstance(v, torch.Tensor):
                    out[tensor_path(f"optim/{key}", name)] = v
    return out


def _optimizer_objects(ck: Checkpoint) -> dict[str, Any]:
    opt = ck.optimizer
    if opt is None:
        return {}
    params: dict[str, Any] = {}
    for name in opt.names:
        st = opt.state.get(name)
        if not st:
            continue
        params[name] = {
            "arrays": [k for k, v in st.items() if isinstance(v, torch.Tensor)],
            "values": {k: to_plain(v) for k, v in st.items() if not isinstance(v, torch.Tensor)},
        }
    return {
        schema.OPTIM_STATE_OBJECT: {"format": 2, "params": params},
        schema.OPTIM_GROUPS_OBJECT: to_plain(opt.groups),
    }


def _metrics(values: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in values.items():
        try:
            out[str(k)] = metric_value(str(k), v)
        except TypeError:
            continue
    return out


def write_checkpoint(
    writer: Any,
    ck: Checkpoint,
    *,
    history: list[tuple[int, dict[str, Any]]],
    book: SummaryBook | None = None,
) -> CommitHeader:
    """Commit ``ck`` through ``writer`` (a store ``Writer``); ``history``: the logged values
    of the steps since the previous commit; ``book``: write-time summaries (the book keeps
    each parameter's probe, so the update from the previous imported step is estimated)."""
    arrays = arrays_of(ck)
    dims = ModelDims(ck.model)({p: tuple(t.shape) for p, t in arrays.items()})
    txn = writer.begin(ck.step)
    try:
        for path, t in arrays.items():
            t = t.detach()
            dtype = store_dtype(t.dtype, what=f"tensor {path!r} of {ck.source}")
            plan = txn.declare(path, dtype, tuple(t.shape), dims=dims.get(path))
            flat = flat_bytes(t.contiguous()).numpy()
            for i in range(plan.n_chunks):
                start, stop = plan.byte_range(i)
                txn.put_chunk(path, i, flat[start:stop])
        objects: dict[str, Any] = {**_optimizer_objects(ck), **ck.rng}
        if ck.scheduler is not None:
            objects[schema.SCHEDULER_OBJECT] = to_plain(ck.scheduler)
        objects.update({k: to_plain(v) for k, v in ck.objects.items()})
        if book is not None:  # the update estimated from the probes, as the engine does
            objects[schema.SUMMARIES_OBJECT] = {
                path: book.summarize(path, t)
                for path, t in arrays.items()
                if path.startswith("params/")
            }
        if history:
            when = _mtime(ck)
            objects[METRICS_HISTORY_OBJECT] = {
                "steps": [s for s, _ in history],
                "time": [when] * len(history),
                "metrics": [_metrics(v) for _, v in history],
            }
        objects[IMPORT_OBJECT] = {
            "path": ck.source,
            "format": ck.format,
            "step": ck.step,
            "files": {
                os.path.relpath(f, ck.source) if f != ck.source else os.path.basename(f): n
                for f, n in ck.files.items()
            },
            "lacks": list(ck.lacks),
            "imported": time.time(),
        }
        for name, obj in objects.items():
            txn.put_object(name, obj)
        return txn.commit(_metrics(ck.metrics))  # type: ignore[no-any-return]
    except BaseException:
        txn.abort()
        raise


def _mtime(ck: Checkpoint) -> float:
    try:
        return os.path.getmtime(ck.source)
    except OSError:
        return time.time()
