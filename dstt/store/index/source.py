"""What the index reads a run through: refs, headers, objects and arrays tables.

The index is derived from the commit headers and what their step files hold (metrics history,
summaries, raw chunk locations), so building rows needs a reader of the run; the run's reader
(``read/reader.py``) in turn opens the index for fast header lookups. ``HeaderSource`` names
the part of the reader the index uses, so the index room imports nothing of ``read/``.
Rejected alternative: typing against ``Reader`` under ``TYPE_CHECKING`` — an import cycle the
type checker sees and the layering test forbids.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Iterator

    from dstt.store.format.records import CommitHeader, RefInfo
    from dstt.store.storage.base import Storage

__all__ = ["HeaderSource"]


class HeaderSource(Protocol):
    """A run's refs and committed headers (the store's ``Reader``)."""

    @property
    def storage(self) -> Storage: ...

    @property
    def timelines(self) -> dict[str, RefInfo]: ...

    def ref(self, timeline: str | None = None) -> RefInfo: ...

    def walk(self, timeline: str | None = None) -> Iterator[CommitHeader]: ...

    def header(self, slot: int) -> CommitHeader: ...

    def read_object(self, header: CommitHeader, name: str, *, trusted: bool = False) -> Any: ...  # noqa: ANN401 - a stored object

    def table_columns(self, header: CommitHeader) -> dict[str, Any]: ...
