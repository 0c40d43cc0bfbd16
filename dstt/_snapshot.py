"""``Snapshot``: one committed step of a run: lazy tensors by torch name, layer trees, objects,
and the way back to torch (export, state dicts, loading into live objects).

``Run.at`` (:mod:`dstt._run`) builds it; that module imports this one, which names ``Run`` only
in type hints. As for every view, the tensors are lazy xarray objects built by
:mod:`dstt.inspect` over the run's readers, so every byte is read through :mod:`dstt.store`.
Rejected alternative: ``Snapshot`` next to ``Run`` in one module — two jobs (a run's timelines
and views over many steps; one step's tensors and its export) in one file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import xarray as xr

from .inspect.naming import (
    array_path,
    select,
    selector_miss,
    tensor_dims,
)
from .inspect.sharded import shard_sources
from .inspect.views import layer_tree, tensor_dataarray
from .schema import optim_state, user_name
from .store import Batch

if TYPE_CHECKING:
    import torch

    from ._run import Run

__all__ = ["Snapshot"]


class Snapshot:
    """One committed step: lazy tensors by torch name, layer trees, objects, export."""

    def __init__(self, run: Run, header: Any, timeline: str | None = None) -> None:
        self.run, self.header = run, header
        self.step, self.slot = int(header.step), int(header.slot)
        #: the timeline it was read from; ``header.timeline`` is the one it was written on,
        #: which a rename or delete may have retired since
        self.timeline = timeline or str(header.timeline)
        self.time = float(header.time)
        self.metrics = dict(header.metrics)
        self.arrays = run.arrays(header)
        hidden = shard_sources(self.arrays)  # ZeRO flat buffers: shown as logical tensors
        self._pool = [p for p in sorted(self.arrays) if p not in hidden]
        self._model_paths = [p for p in self._pool if optim_state(p) is None]
        self._dims_of = tensor_dims(self.arrays)

    def __repr__(self) -> str:
        return (f"<dstt.Snapshot step={self.step} timeline={self.timeline!r} slot={self.slot} "
                f"tensors={len(self.arrays)}>")

    def names(self, optim: bool = False) -> list[str]:
        """User names of the tensors (optimizer states too when ``optim``)."""
        return [user_name(p) for p in (self._pool if optim else self._model_paths)]

    @property
    def objects(self) -> list[str]:
        return sorted(self.header.objects)

    def object(self, name: str, *, trusted: bool = False) -> Any:
        """A stored object (RNG state, scheduler, summaries...); pickled ones need trusted."""
        return self.run._reader.read_object(self.header, name, trusted=trusted)

    def _path(self, name: str, state: str | None) -> str:
        return array_path(name, self.arrays, state, where=f"at step {self.step}",
                          listing=f"run.at({self.step}).names(optim=True)")

    def tensor(self, name: str, *, state: str | None = None, chunks: Any = None) -> xr.DataArray:
        """Lazy DataArray of one tensor (bf16 shown as float32; ``state`` for optimizer
        states; ``chunks`` for a dask array, when dask is installed)."""
        path = self._path(name, state)
        return tensor_dataarray(self.run._readers, self.header, self.arrays, path, chunks=chunks,
                                dims_of=self._dims_of)

    def to_numpy(self, name: str, *, state: str | None = None, native: bool = False) -> np.ndarray:
        """Values of one tensor: float32 for bf16 (as in views) or, with ``native``, the
        stored dtype (``ml_dtypes.bfloat16``)."""
        path = self._path(name, state)
        if native:
            return self.run._reader.read_array(self.header, path)
        return self.tensor(name, state=state).values

    def layer(self, selector: str, optim: bool = False, *, chunks: Any = None) -> xr.DataTree:
        """Lazy DataTree of the tensors ``selector`` picks, laid out by module path.

        Selector rule (:func:`dstt.inspect.naming.select`): a glob (``layers.*.attn``) is
        matched against dotted names and their module prefixes; otherwise the dotted
        components must appear contiguously (``layers.0.attn``, an exact tensor name,
        ``q_proj.weight``), and only if that finds nothing, in any order (``attn.0`` finds
        ``layers.0.attn``). ``optim=True`` adds the optimizer states of the selected tensors
        under ``optim/<state>/<module path>``. bf16 is shown as float32 (exact).
        """
        pool = self._pool if optim else self._model_paths
        paths = select(selector, pool)
        if not paths:
            raise selector_miss(selector, pool, f"at step {self.step}",
                                f"run.at({self.step}).names({'optim=True' if optim else ''})")
        return layer_tree(self.run._readers, self.header, self.arrays, paths, chunks=chunks,
                          dims_of=self._dims_of)

    def tree(self, optim: bool = False) -> xr.DataTree:
        """Every tensor of the step as one lazy DataTree."""
        return self.layer("*", optim)

    # -- back to torch: export, state dicts, loading into live objects ---------------------
    def export(self, out: str | os.PathLike[str], format: str = "safetensors", *,
               include_all: bool = False, overwrite: bool = False,
               progress: Callable[[int], None] | None = None) -> dict[str, Any]:
        """Write this step to the file ``out`` (see :mod:`dstt.inspect.export`): safetensors,
        the model's tensors by dotted name; torch, ``torch.save`` of :meth:`state_dict`.
        Missing folders are created; an existing file is replaced only with ``overwrite``."""
        from .inspect.export import export_commit

        return export_commit(self.run._reader, self.header, out, format,  # type: ignore[arg-type]
                             include_all=include_all, overwrite=overwrite, progress=progress)

    def batch(self) -> list[Batch]:
        """The fingerprints of the batches this step trained on (``run.batches()``)."""
        return self.run.batches([self.step], timeline=self.timeline).get(self.step, [])

    def state_dict(self, *, trusted: bool = False) -> dict[str, Any]:
        """This step in torch's own formats: ``{"model": ..., "optimizer": ...,
        "scheduler": ...}``, as ``model.state_dict()``, ``optimizer.state_dict()`` and
        ``scheduler.state_dict()`` gave them at the end of iteration ``step`` (after its
        ``scheduler.step()``; what ``resume=True`` restores). CPU tensors in their stored
        dtypes, bit-exact; a part the run did not capture is None; a tied parameter appears
        once, under its first name. ``trusted`` allows pickled objects (see :meth:`object`).
        See :mod:`dstt.inspect.restore`."""
        from .inspect.restore import step_state

        return step_state(self.run._reader, self.header, trusted=trusted)

    def load_into(self, model: torch.nn.Module | None = None,
                  optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None, *,
                  strict: bool = True, trusted: bool = False) -> Any:
        """Load this step into live objects (any may be left out), bit-exactly: training on
        from here gives the original run's next step. Everything is read and checked first;
        a step that does not fit (``strict``: missing or unexpected names; always: other
        dtypes, shapes or param groups) raises ``SchemaError`` naming them and changes
        nothing. Returns ``(missing_keys, unexpected_keys)`` like ``load_state_dict``."""
        from .inspect.restore import load_step

        return load_step(self.run._reader, self.header, model, optimizer, scheduler,
                         strict=strict, trusted=trusted)
