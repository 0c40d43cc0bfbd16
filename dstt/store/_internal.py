"""The store's internal seam: every name the engine, the session, inspection, the run, the
CLI, the integrations and the test harness use from the store — the public names of
``dstt.store`` and the rest (the step-writer contract, the flat lane and the flusher, several
ranks, sharded reads, the index's rows, chunk plans, data attribution). Only dstt imports it:
``tests/test_public_api.py`` fails on an import from outside ``dstt/`` (``tests/`` and
``bench/`` excepted, by an explicit allow-list), and docs/api.md declares it private.

One private module, not direct imports of the rooms: an importer changes one word of its
import line, and the rooms stay free to move. Names resolve on first use (PEP 562), so reading
a run loads the reader and the index, not the writer, the encodings or the flusher.
"""

from __future__ import annotations

import importlib as _importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._seam import (
        Digest,
        FlatSegment,
        SharedBuffers,
        StepHandle,
        StepSink,
        StepStats,
        TransactionSink,
    )
    from .api import StoredStep, load, save
    from .codec.predict import Prediction, adam_predictions, sgd_predictions
    from .codec.xor import DeltaPolicy
    from .commit.ranks import (
        DEFAULT_RANK_TIMEOUT,
        RankInfo,
        RankTransaction,
        RankWriter,
        TransactionProxy,
    )
    from .commit.writer import Writer
    from .flusher.parent import flusher_supported
    from .format.batches import (
        Batch,
        SkipSet,
        read_batches,
        read_skips,
        write_skips,
    )
    from .format.flat import FlatLayout
    from .format.layout import (
        COMMITS_PREFIX,
        DEFAULT_CHUNK_BYTES,
        REFS_PREFIX,
        check_array_path,
        key_slot,
        plan_chunks,
    )
    from .format.manifest import parse_header
    from .format.objects import Encoded, decode_object
    from .format.parts import remove_parts
    from .format.records import ArrayRecord, CommitHeader, Metric
    from .format.segment import RowSet
    from .format.zarr_meta import dtype_itemsize, numpy_dtype
    from .index.rows import as_float
    from .index.shard_summaries import DTENSOR_PREFIX, logical_of, shard_source
    from .index.view import Index
    from .maintenance.gc import GcReport
    from .maintenance.retention import Retention, find_spikes
    from .protocols import (
        ArraySpec,
        EncodingWriter,
        FlatStepWriter,
        StepTransaction,
        StoredWriter,
    )
    from .read.reader import Reader
    from .read.shards import (
        Box,
        LogicalArray,
        Piece,
        logical_arrays,
        read_logical,
        read_region,
        shard_map,
    )
    from .repository import Repository
    from .storage.base import Storage
    from .storage.local import LocalStorage
    from .storage.memory import MemoryStorage
    from .storage.posix import fsync_dir
    from .storage.urls import is_url, storage_for


__all__ = [
    "COMMITS_PREFIX",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RANK_TIMEOUT",
    "DTENSOR_PREFIX",
    "REFS_PREFIX",
    "ArrayRecord",
    "ArraySpec",
    "Batch",
    "Box",
    "CommitHeader",
    "DeltaPolicy",
    "Digest",
    "Encoded",
    "EncodingWriter",
    "FlatLayout",
    "FlatSegment",
    "FlatStepWriter",
    "GcReport",
    "Index",
    "LocalStorage",
    "LogicalArray",
    "MemoryStorage",
    "Metric",
    "Piece",
    "Prediction",
    "RankInfo",
    "RankTransaction",
    "RankWriter",
    "Reader",
    "Repository",
    "Retention",
    "RowSet",
    "SharedBuffers",
    "SkipSet",
    "StepHandle",
    "StepSink",
    "StepStats",
    "StepTransaction",
    "Storage",
    "StoredStep",
    "StoredWriter",
    "TransactionProxy",
    "TransactionSink",
    "Writer",
    "adam_predictions",
    "as_float",
    "check_array_path",
    "decode_object",
    "dtype_itemsize",
    "find_spikes",
    "flusher_supported",
    "fsync_dir",
    "is_url",
    "key_slot",
    "load",
    "logical_arrays",
    "logical_of",
    "numpy_dtype",
    "parse_header",
    "plan_chunks",
    "read_batches",
    "read_logical",
    "read_region",
    "read_skips",
    "remove_parts",
    "save",
    "sgd_predictions",
    "shard_map",
    "shard_source",
    "storage_for",
    "write_skips",
]

_LAZY: dict[str, tuple[str, str]] = {
    "ArrayRecord": ("format.records", "ArrayRecord"),
    "ArraySpec": ("protocols", "ArraySpec"),
    "Batch": ("format.batches", "Batch"),
    "Box": ("read.shards", "Box"),
    "COMMITS_PREFIX": ("format.layout", "COMMITS_PREFIX"),
    "CommitHeader": ("format.records", "CommitHeader"),
    "DEFAULT_CHUNK_BYTES": ("format.layout", "DEFAULT_CHUNK_BYTES"),
    "DEFAULT_RANK_TIMEOUT": ("commit.ranks", "DEFAULT_RANK_TIMEOUT"),
    "DTENSOR_PREFIX": ("index.shard_summaries", "DTENSOR_PREFIX"),
    "DeltaPolicy": ("codec.xor", "DeltaPolicy"),
    "Digest": ("_seam", "Digest"),
    "Encoded": ("format.objects", "Encoded"),
    "EncodingWriter": ("protocols", "EncodingWriter"),
    "FlatLayout": ("format.flat", "FlatLayout"),
    "FlatSegment": ("_seam", "FlatSegment"),
    "FlatStepWriter": ("protocols", "FlatStepWriter"),
    "GcReport": ("maintenance.gc", "GcReport"),
    "Index": ("index.view", "Index"),
    "LocalStorage": ("storage.local", "LocalStorage"),
    "LogicalArray": ("read.shards", "LogicalArray"),
    "MemoryStorage": ("storage.memory", "MemoryStorage"),
    "Metric": ("format.records", "Metric"),
    "Piece": ("read.shards", "Piece"),
    "Prediction": ("codec.predict", "Prediction"),
    "REFS_PREFIX": ("format.layout", "REFS_PREFIX"),
    "RankInfo": ("commit.ranks", "RankInfo"),
    "RankTransaction": ("commit.ranks", "RankTransaction"),
    "RankWriter": ("commit.ranks", "RankWriter"),
    "Reader": ("read.reader", "Reader"),
    "Repository": ("repository", "Repository"),
    "Retention": ("maintenance.retention", "Retention"),
    "RowSet": ("format.segment", "RowSet"),
    "SharedBuffers": ("_seam", "SharedBuffers"),
    "SkipSet": ("format.batches", "SkipSet"),
    "StepHandle": ("_seam", "StepHandle"),
    "StepSink": ("_seam", "StepSink"),
    "StepStats": ("_seam", "StepStats"),
    "StepTransaction": ("protocols", "StepTransaction"),
    "Storage": ("storage.base", "Storage"),
    "StoredStep": ("api", "StoredStep"),
    "StoredWriter": ("protocols", "StoredWriter"),
    "TransactionProxy": ("commit.ranks", "TransactionProxy"),
    "TransactionSink": ("_seam", "TransactionSink"),
    "Writer": ("commit.writer", "Writer"),
    "adam_predictions": ("codec.predict", "adam_predictions"),
    "as_float": ("index.rows", "as_float"),
    "check_array_path": ("format.layout", "check_array_path"),
    "decode_object": ("format.objects", "decode_object"),
    "dtype_itemsize": ("format.zarr_meta", "dtype_itemsize"),
    "find_spikes": ("maintenance.retention", "find_spikes"),
    "flusher_supported": ("flusher.parent", "flusher_supported"),
    "fsync_dir": ("storage.posix", "fsync_dir"),
    "is_url": ("storage.urls", "is_url"),
    "key_slot": ("format.layout", "key_slot"),
    "load": ("api", "load"),
    "logical_arrays": ("read.shards", "logical_arrays"),
    "logical_of": ("index.shard_summaries", "logical_of"),
    "numpy_dtype": ("format.zarr_meta", "numpy_dtype"),
    "parse_header": ("format.manifest", "parse_header"),
    "plan_chunks": ("format.layout", "plan_chunks"),
    "read_batches": ("format.batches", "read_batches"),
    "read_logical": ("read.shards", "read_logical"),
    "read_region": ("read.shards", "read_region"),
    "read_skips": ("format.batches", "read_skips"),
    "remove_parts": ("format.parts", "remove_parts"),
    "save": ("api", "save"),
    "sgd_predictions": ("codec.predict", "sgd_predictions"),
    "shard_map": ("read.shards", "shard_map"),
    "shard_source": ("index.shard_summaries", "shard_source"),
    "storage_for": ("storage.urls", "storage_for"),
    "write_skips": ("format.batches", "write_skips"),
}


def __getattr__(name: str) -> object:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'dstt.store._internal' has no attribute {name!r}") from None
    value = getattr(_importlib.import_module(f".{module}", __package__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
