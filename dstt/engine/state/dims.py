"""Dimension names of captured arrays, from what the engine knows: each tensor's module type.

``Linear``, ``Embedding``, the norms, convolutions, and transformers' ``Conv1D``, ``*RMSNorm``
and fused ``*Experts`` (known by class name, never imported) name their tensors' dims
(``out_features``, ``in_features``, ``expert``, ...); optimizer states take their parameter's
dims when their shape is the parameter's; anything else is ``dim0, dim1, ...``. The names go
into each array's ``zarr.json`` ``dimension_names``, so plain zarr/xarray readers see them,
made consistent within a step by :func:`dstt.schema.resolve_dims`. Rejected alternative:
naming by shape at read time (a bias-free Linear and an Embedding look the same). The table
per module type: docs/decisions.md, "Module notes".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from dstt.schema import canonical_name, resolve_dims
from dstt.store._internal import logical_of

from .model_names import module_wrappers

__all__ = ["DimsOf", "ModelDims", "array_dims", "fallback_dims", "model_dims", "module_tensor_dims"]

#: store path -> shape of a step's arrays, to store path -> dimension names
DimsOf = Callable[[Mapping[str, tuple[int, ...]]], Mapping[str, tuple[str, ...]]]

_KERNEL = {1: ("kernel_w",), 2: ("kernel_h", "kernel_w"), 3: ("kernel_d", "kernel_h", "kernel_w")}


def fallback_dims(ndim: int) -> tuple[str, ...]:
    """``dim0, dim1, ...`` for a tensor of unknown meaning."""
    return tuple(f"dim{i}" for i in range(ndim))


def _norm_dims(n: int) -> tuple[str, ...]:
    return ("normalized_shape",) if n == 1 else tuple(f"normalized_shape_{i}" for i in range(n))


def module_tensor_dims(
    module: torch.nn.Module, name: str, ndim: int, shape: tuple[int, ...] | None = None
) -> tuple[str, ...] | None:
    """The dims of ``module``'s own tensor ``name`` (of ``ndim`` dims; ``shape``, when
    given, lets fused experts be told apart) by the module's type (None: unknown)."""
    nn = torch.nn
    dims: tuple[str, ...] | None = None
    if isinstance(module, nn.Linear):
        dims = {"weight": ("out_features", "in_features"), "bias": ("out_features",)}.get(name)
    elif isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        dims = ("num_embeddings", "embedding_dim") if name == "weight" else None
    elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        dims = _norm_dims(ndim) if name in ("weight", "bias") else None
    elif isinstance(module, nn.modules.conv._ConvNd):  # noqa: SLF001 - torch: no public base
        k = _KERNEL.get(ndim - 2, ())
        if name == "weight" and k:
            chans = (
                ("in_channels", "out_channels")
                if module.transposed
                else ("out_channels", "in_channels")
            )
            dims = (*chans, *k)
        elif name == "bias":
            dims = ("out_channels",)
    # BatchNorm, InstanceNorm (torch names no public base class of both)
    elif isinstance(module, nn.modules.batchnorm._NormBase):  # noqa: SLF001
        if name in ("weight", "bias", "running_mean", "running_var"):
            dims = ("num_features",)
    elif isinstance(module, nn.GroupNorm):
        dims = ("num_channels",) if name in ("weight", "bias") else None
    else:
        dims = _by_class_name(module, name, ndim, shape)
    return dims if dims is not None and len(dims) == ndim else None


def _by_class_name(
    module: torch.nn.Module, name: str, ndim: int, shape: tuple[int, ...] | None
) -> tuple[str, ...] | None:
    """Modules of libraries known by their class name (transformers', without importing it):
    ``*RMSNorm`` (``LlamaRMSNorm``, ``Qwen2RMSNorm``...) with a 1-d ``weight``; GPT-2's
    ``Conv1D``, whose weight is a Linear's transposed; fused MoE experts (``*Experts``: a
    parameter whose first dim is the number of experts, per expert a matrix as ``F.linear``
    takes it, or transposed where the module says ``is_transposed``)."""
    cls = type(module).__name__
    if cls.endswith("RMSNorm") and name == "weight" and ndim == 1:
        return ("normalized_shape",)
    if cls == "Conv1D":
        return {"weight": ("in_features", "out_features"), "bias": ("out_features",)}.get(name)
    if cls.endswith("Experts") and shape is not None and ndim >= 2:
        if shape[0] != _num_experts(module):
            return None
        if ndim == 2:
            return ("expert", "out_features" if name.endswith("bias") else "dim1")
        if ndim == 3:
            transposed = getattr(module, "is_transposed", None)
            if transposed is None:
                return ("expert", "dim1", "dim2")
            return (
                "expert",
                *(
                    ("in_features", "out_features")
                    if transposed
                    else ("out_features", "in_features")
                ),
            )
        return ("expert", *(f"dim{i}" for i in range(1, ndim)))
    return None


def _num_experts(module: torch.nn.Module) -> int | None:
    """A fused-experts module's number of experts: its ``num_experts``, else the first dim
    its matrices share."""
    n = getattr(module, "num_experts", None)
    if isinstance(n, int):
        return n
    firsts = {p.shape[0] for p in module.parameters(recurse=False) if p.dim() >= 2}
    return firsts.pop() if len(firsts) == 1 else None


def model_dims(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Dotted name -> dims of every parameter and buffer of ``model`` whose module type says
    what its dims are (0-d ones: ``()``)."""
    out: dict[str, tuple[str, ...]] = {}
    wrappers = module_wrappers(model)
    for mod_name, module in model.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, t in own:
            dotted = canonical_name(f"{mod_name}.{name}" if mod_name else name, wrappers)
            dims = module_tensor_dims(module, name, t.dim(), tuple(t.shape)) if t.dim() else ()
            if dims is not None:
                out.setdefault(dotted, dims)  # a tied tensor: its first module names it
    return out


def _dotted(path: str) -> str:
    """The parameter a store path belongs to: ``params/a/b`` and ``optim/exp_avg/a/b`` ->
    ``a.b`` (a rank's shard of one, ``dtensor/w2/r0/params/a/b``, too: same dims)."""
    path = logical_of(path) or path
    parts = path.split("/")
    if parts[0] in ("params", "buffers"):
        return ".".join(parts[1:])
    if parts[0] == "optim" and len(parts) > 2:
        return ".".join(parts[2:])
    return path


def array_dims(
    shapes: Mapping[str, tuple[int, ...]], known: Mapping[str, tuple[str, ...]]
) -> dict[str, tuple[str, ...]]:
    """Dims of every array of a step (store path -> shape): by ``known`` (``model_dims``) for
    parameters, buffers and optimizer states of a parameter's shape, else
    :func:`fallback_dims`; then made consistent across the step by ``resolve_dims``."""
    named: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}
    param_shapes = {
        _dotted(p): s for p, s in shapes.items() if p.split("/")[0] in ("params", "buffers")
    }
    for path, shape in shapes.items():
        dotted = _dotted(path)
        dims = known.get(dotted) if len(shape) else ()
        if (
            dims is not None
            and path.startswith("optim/")
            and param_shapes.get(dotted, shape) != shape
        ):
            dims = None  # a factored or flattened state: not the parameter's dims
        if dims is None or len(dims) != len(shape):
            dims = fallback_dims(len(shape))
        named[path] = (dims, tuple(shape))
    return resolve_dims(named)


class ModelDims:
    """The ``DimsOf`` of a model's captures: :func:`array_dims` with the model's module
    types, cached per set of arrays (a step's arrays change rarely; naming them costs
    ~1 µs per tensor)."""

    def __init__(self, model: torch.nn.Module | None) -> None:
        self.model = model
        self._cache: dict[tuple[tuple[str, tuple[int, ...]], ...], dict[str, tuple[str, ...]]] = {}

    def __call__(self, shapes: Mapping[str, tuple[int, ...]]) -> Mapping[str, tuple[str, ...]]:
        key = tuple((p, tuple(s)) for p, s in shapes.items())
        got = self._cache.get(key)
        if got is None:
            known = model_dims(self.model) if self.model is not None else {}
            if len(self._cache) >= 4:
                self._cache.clear()
            got = self._cache[key] = array_dims(shapes, known)
        return got
