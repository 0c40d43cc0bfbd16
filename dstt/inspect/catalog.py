"""The names one commit answers to: its tensors by canonical path, plus its tied names.

A :class:`Catalog` is built once per commit from its arrays table (already keyed by canonical
paths, :mod:`dstt.inspect.readers`) and its ``names/tied`` object (every further name of a
tied parameter -> the name it is stored under). Each tied name becomes an **alias path** whose
record is its target's, for the parameter and each optimizer state, so a tied name resolves,
is selected and is shown like any tensor; :meth:`Catalog.tied_to` says what it is tied to.

Rejected alternatives: storing tied tensors once per name (the bytes twice on every step, and
a load would untie them); resolving tied names only in ``tensor()`` (``layer``,
``trajectory``, ``show`` and the scrubber would each fail differently).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dstt.errors import TensorNotFoundError
from dstt.schema import (
    MODEL_KINDS,
    TIED_OBJECT,
    canonical_name,
    optim_state,
    tensor_path,
    user_name,
)

from .naming import array_path, tensor_dims
from .selection import Pick, select_layer, selector_miss
from .sharded import shard_sources

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from dstt.store._internal import CommitHeader, Reader

__all__ = ["Catalog"]


class Catalog:
    """One commit's names. ``table``: canonical path -> record, tied aliases included (their
    record is the target's, whose ``path`` is where the bytes are); ``tied``: alias path ->
    target path; ``pool``: the paths a user sees (ZeRO flat sources hidden), sorted;
    ``model_paths``: those of ``pool`` that are no optimizer state."""

    def __init__(
        self,
        table: Mapping[str, Any],
        tied: Mapping[str, str] | None = None,
        *,
        where: str = "in this commit",
        listing: str = "",
    ) -> None:
        self.stored = table
        self.where, self.listing = where, listing
        self.tied = _aliases(table, tied or {})
        self.table = {**table, **{a: table[t] for a, t in self.tied.items()}}
        hidden = shard_sources(table)
        self.pool = sorted(p for p in self.table if p not in hidden)
        self.model_paths = [p for p in self.pool if optim_state(p) is None]
        self._dims: Callable[[str, int], tuple[str, ...]] | None = None

    @classmethod
    def of(
        cls, reader: Reader, header: CommitHeader, *, where: str = "", listing: str = ""
    ) -> Catalog:
        """The catalog of commit ``header`` read through ``reader`` (a pool's reader)."""
        tied = reader.read_object(header, TIED_OBJECT) if TIED_OBJECT in header.objects else {}
        return cls(
            reader.arrays(header), tied, where=where or f"at step {header.step}", listing=listing
        )

    def dims_of(self, path: str, ndim: int) -> tuple[str, ...]:
        """Dimension names of ``path`` (:func:`dstt.inspect.naming.tensor_dims` over the
        whole commit, aliases included)."""
        if self._dims is None:
            self._dims = tensor_dims(self.table)
        return self._dims(path, ndim)

    def names(self, optim: bool = False) -> list[str]:
        """User names (tied ones included; optimizer states too with ``optim``)."""
        return [user_name(p) for p in (self.pool if optim else self.model_paths)]

    def resolve(self, name: str, state: str | None = None, *, where: str | None = None) -> str:
        """The path ``name`` means (exact, short, tied or store path; see
        :func:`dstt.inspect.naming.array_path`); ``where`` overrides where it was looked."""
        return array_path(name, self.table, state, where=where or self.where, listing=self.listing)

    def tied_to(self, path: str) -> str | None:
        """The user name of the tensor a tied ``path`` is stored as (None: not tied)."""
        target = self.tied.get(path)
        return None if target is None else user_name(target)

    def select(
        self,
        selector: str,
        *,
        optim: bool = False,
        paths: list[str] | None = None,
        listing: str | None = None,
    ) -> tuple[list[str], Pick]:
        """Paths ``selector`` picks among ``paths`` (default: the pool, optimizer states only
        with ``optim``) by :mod:`dstt.inspect.selection`'s rule, with the experts picked of
        fused tensors; ``TensorNotFoundError`` when it picks nothing (``listing``: how its
        message says to list every name, if not the catalog's)."""
        pool = paths if paths is not None else (self.pool if optim else self.model_paths)
        got, picks = select_layer(selector, pool, self._expert_dim)
        if not got:
            raise selector_miss(
                selector, pool, self.where, self.listing if listing is None else listing
            )
        for p, (_, index) in picks.items():
            n = self.table[p].shape[0]
            if index >= n:
                raise TensorNotFoundError(
                    f"selector {selector!r}: {user_name(p)} holds "
                    f"{n} experts (0 … {n - 1}), not expert {index}"
                )
        return got, picks

    def _expert_dim(self, path: str) -> str | None:
        rec = self.table.get(path)
        if rec is None or len(rec.shape) < 2:
            return None
        first = self.dims_of(path, len(rec.shape))[0]
        return first if first == "expert" or first.startswith("expert_") else None


def _aliases(table: Mapping[str, Any], tied: Mapping[str, str]) -> dict[str, str]:
    """Alias path -> target path of every tied name whose target the commit holds: the
    parameter (or buffer) and each of its optimizer states."""
    out: dict[str, str] = {}
    if not tied:
        return out
    states = sorted({s for p in table if (s := optim_state(p)) is not None})
    for alias, target in tied.items():
        a, t = canonical_name(str(alias)), canonical_name(str(target))
        for kind in (*MODEL_KINDS, *(f"optim/{s}" for s in states)):
            pt, pa = tensor_path(kind, t), tensor_path(kind, a)
            if pt in table and pa not in table:
                out[pa] = pt
    return out
