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

from typing import TYPE_CHECKING

from dstt._lazy import lazy_names as _lazy_names

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
        DEFAULT_CHUNK_BYTES,
        check_array_path,
        key_slot,
        plan_chunks,
    )
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
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RANK_TIMEOUT",
    "DTENSOR_PREFIX",
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

_HOME: dict[str, str] = {
    "ArrayRecord": "format.records",
    "ArraySpec": "protocols",
    "Batch": "format.batches",
    "Box": "read.shards",
    "CommitHeader": "format.records",
    "DEFAULT_CHUNK_BYTES": "format.layout",
    "DEFAULT_RANK_TIMEOUT": "commit.ranks",
    "DTENSOR_PREFIX": "index.shard_summaries",
    "DeltaPolicy": "codec.xor",
    "Digest": "_seam",
    "Encoded": "format.objects",
    "EncodingWriter": "protocols",
    "FlatLayout": "format.flat",
    "FlatSegment": "_seam",
    "FlatStepWriter": "protocols",
    "GcReport": "maintenance.gc",
    "Index": "index.view",
    "LocalStorage": "storage.local",
    "LogicalArray": "read.shards",
    "MemoryStorage": "storage.memory",
    "Metric": "format.records",
    "Piece": "read.shards",
    "Prediction": "codec.predict",
    "RankInfo": "commit.ranks",
    "RankTransaction": "commit.ranks",
    "RankWriter": "commit.ranks",
    "Reader": "read.reader",
    "Repository": "repository",
    "Retention": "maintenance.retention",
    "RowSet": "format.segment",
    "SharedBuffers": "_seam",
    "SkipSet": "format.batches",
    "StepHandle": "_seam",
    "StepSink": "_seam",
    "StepStats": "_seam",
    "StepTransaction": "protocols",
    "Storage": "storage.base",
    "StoredStep": "api",
    "StoredWriter": "protocols",
    "TransactionProxy": "commit.ranks",
    "TransactionSink": "_seam",
    "Writer": "commit.writer",
    "adam_predictions": "codec.predict",
    "as_float": "index.rows",
    "check_array_path": "format.layout",
    "decode_object": "format.objects",
    "dtype_itemsize": "format.zarr_meta",
    "find_spikes": "maintenance.retention",
    "flusher_supported": "flusher.parent",
    "fsync_dir": "storage.posix",
    "is_url": "storage.urls",
    "key_slot": "format.layout",
    "load": "api",
    "logical_arrays": "read.shards",
    "logical_of": "index.shard_summaries",
    "numpy_dtype": "format.zarr_meta",
    "plan_chunks": "format.layout",
    "read_batches": "format.batches",
    "read_logical": "read.shards",
    "read_region": "read.shards",
    "read_skips": "format.batches",
    "remove_parts": "format.parts",
    "save": "api",
    "sgd_predictions": "codec.predict",
    "shard_map": "read.shards",
    "shard_source": "index.shard_summaries",
    "storage_for": "storage.urls",
    "write_skips": "format.batches",
}


__getattr__, __dir__ = _lazy_names(__name__, _HOME, __all__, root=__package__)
