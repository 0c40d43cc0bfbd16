"""``storage_for``: the one place a run path or URL becomes a ``Storage``.

``s3://bucket/prefix`` (and ``s3a://``) is an ``S3Storage`` (the ``s3`` extra); anything else
is a local path. Entry points (``Repository.open/create``, ``dstt.open``, ``dstt.session``,
the CLI) call this, so every one of them accepts the same URLs. Rejected alternative: each
entry point parsing URLs itself — four copies of the rules, and a fifth for the next scheme.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .local import LocalStorage

if TYPE_CHECKING:
    import os

    from .base import Storage

__all__ = ["is_url", "storage_for"]

_SCHEMES = ("s3://", "s3a://")


def is_url(path: object) -> bool:
    """Whether ``path`` names an object-store run (``s3://...``) rather than a local folder."""
    return isinstance(path, str) and path.lower().startswith(_SCHEMES)


def storage_for(
    path: str | os.PathLike[str], *, create: bool = False, **storage_options: Any
) -> Storage:
    """The storage of the run at ``path``: an ``S3Storage`` for ``s3://bucket/prefix``
    (``storage_options`` as documented there, the ``AWS_*`` environment filling the rest),
    else a ``LocalStorage`` (``storage_options``: ``durability``)."""
    if is_url(path):
        try:
            from .s3 import S3Storage  # optional dependency (obstore): the s3 extra
        except ImportError as e:
            raise ImportError(
                f"{path} is an object-store run, which needs obstore: pip install 'dstt[s3]'"
            ) from e
        return S3Storage(str(path), create=create, **storage_options)
    return LocalStorage(path, create=create, **storage_options)
