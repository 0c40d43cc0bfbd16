"""Everything about bytes on disk: step files (Zarr v3 in a stored ZIP), commit manifests,
refs. Knows no torch. The only way in from the rest of dstt: every name the engine, the
session, inspection, the CLI and the integrations use is imported from here, never from a
module of the store (``tests/test_public_api.py`` checks it), and nothing else is exported.
The store's rooms and the data path through them: docs/design.md, "The store's tree".

Engine-facing — what captures, commits and restores steps:

* a run and its writer: ``Repository``, ``Writer``, ``Storage``, ``LocalStorage``,
  ``storage_for``, ``fsync_dir``, ``DEFAULT_CHUNK_BYTES``, ``Retention``, ``GcReport``;
  ``save`` (whole arrays, for scripts and other frameworks)
* the step-writer contract (``protocols.py``): ``StepWriter``, ``StepTransaction`` and the
  capabilities ``FlatStepWriter``, ``EncodingWriter``, ``StoredWriter``, ``OffloadingWriter``
* several ranks, one commit: ``RankWriter``, ``RankTransaction``, ``TransactionProxy``,
  ``RankInfo``, ``DEFAULT_RANK_TIMEOUT``, ``remove_parts``
* the flat lane and the flusher process: ``FlatLayout``, ``FlatImage``, ``Flusher``,
  ``flusher_supported``, ``DigestPlan``, ``digest``
* chunks, objects, fewer bytes: ``ChunkPlan``, ``check_array_path``, ``Encoded``, ``decode_object``,
  ``DeltaPolicy``, ``Prediction``, ``CUR``, ``adam_predictions``, ``sgd_predictions``
* sharded state: ``LogicalArray``, ``Piece``, ``Box``, ``shard_map``, ``shard_source``,
  ``DTENSOR_PREFIX``, ``logical_of``, ``logical_arrays``, ``read_logical``, ``read_region``
* data attribution: ``BATCHES_OBJECT``, ``Batch``, ``SkipSet``, ``read_skips``,
  ``write_skips``

Read-facing — what inspection, ``dstt.Run``, the CLI and the test harness read with:

* ``Repository``, ``Reader``, ``Index``, ``CommitHeader``, ``ArrayRecord``, ``is_url``,
  ``storage_for``, ``LocalStorage``; ``load`` and its ``Snapshot``
* the index's rows: ``RowSet``, ``SUMMARY_SCALARS``, ``as_float``, ``fold_rows``,
  ``find_spikes``
* dtypes and chunking: ``numpy_dtype``, ``dtype_itemsize``, ``plan_chunks``,
  ``DEFAULT_CHUNK_BYTES``
* keys and headers: ``key_slot``, ``COMMITS_PREFIX``, ``REFS_PREFIX``, ``parse_header``
* data attribution: ``Batch``, ``SkipSet``, ``read_batches``, ``read_skips``

Everything else (a ``Transaction``'s class, records, parts, verify's report, ...) is the
store's own: tests that need it import it from its room.
"""

from .api import Snapshot, load, save
from .codec.predict import CUR, Prediction, adam_predictions, sgd_predictions
from .codec.xor import DeltaPolicy
from .commit.ranks import (
    DEFAULT_RANK_TIMEOUT,
    RankInfo,
    RankTransaction,
    RankWriter,
    TransactionProxy,
)
from .commit.writer import Writer
from .flusher.flatstats import DigestPlan, digest
from .flusher.parent import Flusher, flusher_supported
from .format.batches import BATCHES_OBJECT, Batch, SkipSet, read_batches, read_skips, write_skips
from .format.flat import FlatImage, FlatLayout
from .format.layout import (
    COMMITS_PREFIX,
    DEFAULT_CHUNK_BYTES,
    REFS_PREFIX,
    ChunkPlan,
    check_array_path,
    key_slot,
    plan_chunks,
)
from .format.manifest import parse_header
from .format.objects import Encoded, decode_object
from .format.parts import remove_parts
from .format.records import ArrayRecord, CommitHeader
from .format.segment import SCALARS as SUMMARY_SCALARS
from .format.segment import RowSet
from .format.zarr_meta import dtype_itemsize, numpy_dtype
from .index.rows import as_float
from .index.shard_summaries import DTENSOR_PREFIX, fold_rows, logical_of, shard_source
from .index.view import Index
from .maintenance.gc import GcReport
from .maintenance.retention import Retention, find_spikes
from .protocols import (
    EncodingWriter,
    FlatStepWriter,
    OffloadingWriter,
    StepTransaction,
    StepWriter,
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
from .storage.posix import fsync_dir
from .storage.urls import is_url, storage_for

__all__ = [
    "BATCHES_OBJECT",
    "COMMITS_PREFIX",
    "CUR",
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_RANK_TIMEOUT",
    "DTENSOR_PREFIX",
    "REFS_PREFIX",
    "SUMMARY_SCALARS",
    "ArrayRecord",
    "Batch",
    "Box",
    "ChunkPlan",
    "CommitHeader",
    "DeltaPolicy",
    "DigestPlan",
    "Encoded",
    "EncodingWriter",
    "FlatImage",
    "FlatLayout",
    "FlatStepWriter",
    "Flusher",
    "GcReport",
    "Index",
    "LocalStorage",
    "LogicalArray",
    "OffloadingWriter",
    "Piece",
    "Prediction",
    "RankInfo",
    "RankTransaction",
    "RankWriter",
    "Reader",
    "Repository",
    "Retention",
    "RowSet",
    "SkipSet",
    "Snapshot",
    "StepTransaction",
    "StepWriter",
    "Storage",
    "StoredWriter",
    "TransactionProxy",
    "Writer",
    "adam_predictions",
    "as_float",
    "check_array_path",
    "decode_object",
    "digest",
    "dtype_itemsize",
    "find_spikes",
    "flusher_supported",
    "fold_rows",
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
