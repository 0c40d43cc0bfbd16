"""``Snapshot``: one committed step of a run: lazy tensors by torch name, layer trees, objects,
and the way back to torch (export, state dicts, loading into live objects).

``Run.at`` (:mod:`dstt.run.run`) builds it; that module imports this one, which sees the run
through ``RunView``, the protocol below (rejected: naming ``Run`` under ``TYPE_CHECKING``, a
cycle between the two modules). As for every view, the tensors are lazy xarray objects built by
:mod:`dstt.inspect` over the run's readers, so every byte is read through :mod:`dstt.store`.
Rejected alternative: ``Snapshot`` next to ``Run`` in one module — two jobs (a run's timelines
and views over many steps; one step's tensors and its export) in one file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from dstt.schema import optim_state, user_name

if TYPE_CHECKING:
    import os
    from collections.abc import Callable, Iterable, Mapping, Sequence

    import numpy as np
    import torch
    import xarray as xr

    from dstt.inspect.catalog import Catalog
    from dstt.inspect.readers import ReaderPool
    from dstt.store._internal import Batch, CommitHeader, Reader

__all__ = ["RunView", "Snapshot"]


class RunView(Protocol):
    """What a snapshot reads its run through (``dstt.Run``): the run's readers, the names
    of a commit and the recorded batches."""

    _readers: ReaderPool

    @property
    def reader(self) -> Reader: ...

    def catalog(self, header: CommitHeader) -> Catalog: ...

    def batches(
        self, steps: slice | Iterable[int] | None = None, *, timeline: str | None = None
    ) -> dict[int, list[Batch]]: ...


class Snapshot:
    """One committed step: lazy tensors by torch name, layer trees, objects, export."""

    def __init__(self, run: RunView, header: CommitHeader, timeline: str | None = None) -> None:
        self.run, self.header = run, header
        self.step, self.slot = int(header.step), int(header.slot)
        #: the timeline it was read from; ``header.timeline`` is the one it was written on,
        #: which a rename or delete may have retired since
        self.timeline = timeline or str(header.timeline)
        self.time = float(header.time)
        self.metrics = dict(header.metrics)
        #: the commit's names (:mod:`dstt.inspect.catalog`): canonical paths, tied aliases
        self.catalog = run.catalog(header)
        #: canonical store path -> record of every array (tied names not included)
        self.arrays = self.catalog.stored
        #: a light step (``every="auto"``) rebuilt by replay: from which stored step, which
        #: losses matched (``dstt.inspect.rebuild.Rebuilt``); None for a stored step
        self.rebuilt: Any = None

    # the run's readers, looked up at each use (``run.refresh()`` replaces them); the one
    # place outside ``Run`` that reads these members, which RunView names for it
    @property
    def _reader(self) -> Reader:
        return self.run.reader

    @property
    def _readers(self) -> ReaderPool:
        return self.run._readers  # noqa: SLF001 - Snapshot is the run's own view (RunView)

    def __repr__(self) -> str:
        where = f"slot={self.slot}" if self.rebuilt is None else f"rebuilt from={self.rebuilt.base}"
        return (
            f"<dstt.Snapshot step={self.step} timeline={self.timeline!r} {where} "
            f"tensors={len(self.arrays)}>"
        )

    def names(self, optim: bool = False) -> list[str]:
        """User names of the tensors (optimizer states too when ``optim``). A tied
        parameter's every name is listed, as ``model.state_dict()`` lists them (its tensor is
        stored once: ``tensor(name).attrs["tied_to"]`` names it)."""
        return self.catalog.names(optim)

    @property
    def tied(self) -> dict[str, str]:
        """Tied names -> the name each is stored under (``{"lm_head.weight":
        "transformer.wte.weight"}``); empty when nothing is tied."""
        return {
            user_name(a): user_name(t)
            for a, t in self.catalog.tied.items()
            if optim_state(a) is None
        }

    @property
    def objects(self) -> list[str]:
        return sorted(self.header.objects)

    def object(self, name: str, *, trusted: bool = False) -> Any:
        """A stored object (RNG state, scheduler, summaries...); pickled ones need trusted."""
        return self._reader.read_object(self.header, name, trusted=trusted)

    def path(self, name: str, state: str | None = None) -> str:
        """The store path (canonical) ``name`` means at this step: an exact dotted name, a
        short one (a unique suffix of whole components: ``layers.0.mlp.up_proj.weight``
        finds ``model.layers.0.mlp.up_proj.weight``), a tied name or a store path;
        ``TensorNotFoundError`` with the candidates or the closest names otherwise."""
        return self.catalog.resolve(name, state)

    def tensor(self, name: str, *, state: str | None = None, chunks: Any = None) -> xr.DataArray:
        """Lazy DataArray of one tensor (bf16 shown as float32; ``state`` for optimizer
        states; ``chunks`` for a dask array, when dask is installed). ``name`` as in
        :meth:`path`; a tied name's DataArray has ``attrs["tied_to"]``."""
        from dstt.inspect.views import tensor_dataarray

        return tensor_dataarray(
            self._readers, self.header, self.catalog, self.path(name, state), chunks=chunks
        )

    def to_numpy(self, name: str, *, state: str | None = None, native: bool = False) -> np.ndarray:
        """Values of one tensor: float32 for bf16 (as in views) or, with ``native``, the
        stored dtype (``ml_dtypes.bfloat16``)."""
        path = self.path(name, state)
        if native:
            return self._reader.read_array(self.header, self.catalog.tied.get(path, path))
        return self.tensor(name, state=state).values

    def layer(self, selector: str, optim: bool = False, *, chunks: Any = None) -> xr.DataTree:
        """Lazy DataTree of the tensors ``selector`` picks, laid out by module path.

        Selector rule (:mod:`dstt.inspect.selection`), at any depth of the name: a glob
        (``layers.*.mlp``) matches any run of components; otherwise the dotted components
        must appear as a run (``layers.0.attn``, an exact tensor name, ``q_proj.weight``);
        then ``<experts module>.<i>`` picks expert ``i`` of fused experts (an ``isel``
        view); and only if nothing matched, the components in any order (``attn.0`` finds
        ``layers.0.attn``). ``optim=True`` adds the optimizer states of the selected tensors
        under ``optim/<state>/<module path>``. bf16 is shown as float32 (exact). A selector
        that picks nothing raises ``TensorNotFoundError`` with the closest selectors.
        """
        from dstt.inspect.views import layer_tree

        listing = f"run.at({self.step}).names({'optim=True' if optim else ''})"
        paths, picks = self.catalog.select(selector, optim=optim, listing=listing)
        return layer_tree(
            self._readers, self.header, self.catalog, paths, picks=picks, chunks=chunks
        )

    def tree(self, optim: bool = False) -> xr.DataTree:
        """Every tensor of the step as one lazy DataTree."""
        return self.layer("*", optim)

    # -- back to torch: export, state dicts, loading into live objects ---------------------
    def export(
        self,
        out: str | os.PathLike[str],
        format: str = "safetensors",
        *,
        include_all: bool = False,
        overwrite: bool = False,
        config: Any = None,
        progress: Callable[[int], None] | None = None,
    ) -> dict[str, Any]:
        """Write this step (see :mod:`dstt.inspect.export`): ``safetensors``, the model's
        tensors by dotted name, every tied name included, so ``model.load_state_dict(
        load_file(out))`` works; ``torch``, ``torch.save`` of :meth:`state_dict`; ``hf``, a
        folder ``from_pretrained`` opens (``model.safetensors`` + ``config.json``, the
        config from the run's ``model/config`` or ``config``: a config object, a dict, a
        ``config.json`` or a folder holding one). ``out`` may be a folder (an existing one,
        or a path ending in ``/``): the file is then ``step<S>.<ext>`` in it. Missing
        folders are created; an existing file is replaced only with ``overwrite``."""
        from dstt.inspect.export import export_commit

        return export_commit(
            self._reader,
            self.header,
            out,
            format,  # type: ignore[arg-type]
            include_all=include_all,
            overwrite=overwrite,
            config=config,
            progress=progress,
        )

    def batch(self) -> list[Batch]:
        """The fingerprints of the batches this step trained on (``run.batches()``)."""
        return self.run.batches([self.step], timeline=self.timeline).get(self.step, [])

    def state_dict(self, *, trusted: bool = False) -> dict[str, Any]:
        """This step in torch's own formats: ``{"model": ..., "optimizer": ...,
        "scheduler": ...}``, as ``model.state_dict()``, ``optimizer.state_dict()`` and
        ``scheduler.state_dict()`` gave them at the end of iteration ``step`` (after its
        ``scheduler.step()``; what ``resume=True`` restores). CPU tensors in their stored
        dtypes, bit-exact; a part the run did not capture is None; a tied parameter is one
        tensor under each of its names, as torch lists it. A session given several
        optimizers (a list or a dict) gives ``"optimizer"`` as a dict by their keys
        (``"0"``, ``"1"``... for a list). ``trusted`` allows pickled objects (see
        :meth:`object`). See :mod:`dstt.inspect.restore`."""
        from dstt.inspect.restore import step_state

        return step_state(self._reader, self.header, trusted=trusted)

    def load_into(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer
        | Sequence[torch.optim.Optimizer]
        | Mapping[str, torch.optim.Optimizer]
        | None = None,
        scheduler: Any = None,
        *,
        strict: bool = True,
        trusted: bool = False,
    ) -> Any:
        """Load this step into live objects (any may be left out), bit-exactly: training on
        from here gives the original run's next step. The model may be wrapped
        (``torch.compile``, DDP) or not: names are matched without wrapper components.
        ``optimizer`` is what the session was given — one, a list or a dict of them (same
        number, same keys). Everything is read and checked first; a step that does not fit
        (``strict``: missing or unexpected names; always: other dtypes, shapes, param
        groups or optimizers) raises ``SchemaError`` naming them and changes nothing.
        Returns a ``LoadResult``: ``(missing_keys, unexpected_keys)`` like
        ``load_state_dict``, and ``loaded_keys``; with ``strict=False`` a load that matched
        no name of the model warns (``DsttWarning``)."""
        from dstt.inspect.restore import load_step

        return load_step(
            self._reader, self.header, model, optimizer, scheduler, strict=strict, trusted=trusted
        )
