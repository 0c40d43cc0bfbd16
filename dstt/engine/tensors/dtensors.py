"""DTensors as the engine meets them: which box of a tensor this rank holds, its local view,
and restoring a stored tensor into any live placement.

A plain tensor is held whole; a DTensor (FSDP2, tensor parallel) holds its local shard at
the global offsets DTensor itself computes (``compute_local_shape_and_global_offset``, what
DCP's planner uses). Capture copies the local view (no gather); restore reads exactly the
live box from the stored boxes (``source.region``), which is a reshard whenever the stored
placements differ. ``torch.distributed.tensor`` is never imported here unless some tensor is
already a DTensor, so single-process sessions pay nothing.
Rejected alternative: ``DTensor.full_tensor()`` / ``redistribute`` on restore — a collective
per tensor, and every rank would read the whole tensor.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Protocol, TypeGuard

import torch

from dstt.errors import SchemaError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "RegionSource",
    "as_dtensor_like",
    "dtensor_class",
    "held_box",
    "is_dtensor",
    "local_view",
    "restore_tensor",
    "stored_value",
]


class RegionSource(Protocol):
    """What restoring a tensor needs of a committed step."""

    def array(self, path: str) -> torch.Tensor: ...

    def shape(self, path: str) -> tuple[int, ...]: ...

    def region(
        self, path: str, offsets: tuple[int, ...], sizes: tuple[int, ...]
    ) -> torch.Tensor: ...


def dtensor_class() -> type | None:
    """``DTensor`` if its module was imported (no tensor can be one otherwise: checking
    costs no import of ``torch.distributed.tensor``)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: object) -> TypeGuard[DTensor]:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def held_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(global offsets, sizes) of the part of ``t`` this rank holds: the whole of a plain
    tensor, a DTensor's local shard; None when this rank holds none of it (an empty shard,
    a rank outside the DTensor's mesh)."""
    if not is_dtensor(t):
        return (0,) * t.dim(), tuple(t.shape)
    mesh = t.device_mesh
    if mesh.get_coordinate() is None:
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
    if math.prod(sizes) == 0:
        return None
    return tuple(int(o) for o in offsets), tuple(int(n) for n in sizes)


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's box: ``t`` itself, or a DTensor's local tensor (a
    view sharing its storage and version counter, so the version guard still sees writes)."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local().detach()
    return t


def stored_value(source: RegionSource, path: str, like: torch.Tensor | None = None) -> torch.Tensor:
    """The stored tensor ``path`` as ``like`` holds it: for a DTensor ``like`` of the same
    global shape, a DTensor of ``like``'s placements whose local tensor is read from the
    stored boxes (a reshard when they differ); else the whole tensor."""
    if like is not None and is_dtensor(like):
        box = held_box(like)
        shape = tuple(like.shape)
        if tuple(source.shape(path)) != shape:
            raise SchemaError(
                f"array {path!r} is stored with shape {source.shape(path)}, the "
                f"live tensor has {shape}"
            )
        # a rank that holds none of it (an empty shard) gets an empty local tensor
        local = (
            source.region(path, *box)
            if box is not None
            else torch.empty_like(local_view(like), device="cpu")
        )
        return as_dtensor_like(local, like)
    return source.array(path)


def as_dtensor_like(local: torch.Tensor, like: DTensor) -> torch.Tensor:
    """``local`` (this rank's box, on any device) as a DTensor of ``like``'s mesh, placements,
    global shape and stride; no collective."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local.to(like.device),
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


def restore_tensor(source: RegionSource, path: str, live: torch.Tensor) -> None:
    """Copy the stored ``path`` into ``live`` in place, bit-exactly: a DTensor's local shard
    from the stored boxes it overlaps, a plain tensor whole (``SchemaError`` on a dtype or
    shape mismatch)."""
    if not is_dtensor(live):
        stored = source.array(path)
        _check(stored.dtype, tuple(stored.shape), live, path)
        with torch.no_grad():
            live.copy_(stored)
        return
    stored_shape = tuple(source.shape(path))
    if stored_shape != tuple(live.shape):
        raise SchemaError(
            f"array {path!r} is stored with shape {stored_shape}, the live tensor "
            f"has {tuple(live.shape)}"
        )
    box = held_box(live)
    if box is None:
        return
    local = source.region(path, *box)
    target = local_view(live)
    _check(local.dtype, tuple(local.shape), target, path)
    with torch.no_grad():
        target.copy_(local)


def _check(dtype: torch.dtype, shape: tuple[int, ...], live: torch.Tensor, path: str) -> None:
    if dtype != live.dtype or shape != tuple(live.shape):
        raise SchemaError(
            f"array {path!r} is stored as {dtype}{shape} but the live tensor is "
            f"{live.dtype}{tuple(live.shape)}"
        )
