"""Everything about bytes on disk: step files (Zarr v3 in a stored ZIP), commit manifests,
refs. Knows no torch. The only way in from the rest of dstt: every name the engine,
inspection and CLI use is imported from here, never from a module of the store."""

from .api import Snapshot, dtype_name, load, save
from .codec.delta import EncodeStats
from .codec.predict import CUR, Prediction, adam_predictions, sgd_predictions
from .codec.xor import DeltaPolicy
from .commit.parts import abort_vote, collect_parts
from .commit.ranks import (
    DEFAULT_RANK_TIMEOUT,
    RankInfo,
    RankTransaction,
    RankWriter,
    TransactionProxy,
)
from .commit.writer import Transaction, Writer
from .flusher.flatstats import DigestPlan, digest
from .flusher.parent import Flusher, flusher_supported
from .format.batches import (
    BATCHES_OBJECT,
    Batch,
    SkipSet,
    batches_of,
    read_batches,
    read_skips,
    write_skips,
)
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
from .format.objects import Encoded
from .format.parts import Part, remove_parts
from .format.records import ArrayRecord, ChunkRecord, CommitHeader, ObjectRecord, RefInfo
from .format.segment import SCALARS as SUMMARY_SCALARS
from .format.segment import RowSet
from .format.zarr_meta import dtype_itemsize, numpy_dtype
from .index.rows import as_float
from .index.shard_summaries import DTENSOR_PREFIX, fold_rows, logical_of, shard_source
from .index.view import Index, IndexedHeader
from .maintenance.gc import GcReport
from .maintenance.retention import Retention, find_spikes
from .maintenance.verify import Problem, VerifyReport
from .protocols import FlatStepWriter, StepTransaction, StepWriter
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
from .storage.base import Durability, Storage
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
    "ChunkRecord",
    "CommitHeader",
    "DeltaPolicy",
    "DigestPlan",
    "Durability",
    "EncodeStats",
    "Encoded",
    "FlatImage",
    "FlatLayout",
    "FlatStepWriter",
    "Flusher",
    "GcReport",
    "Index",
    "IndexedHeader",
    "LocalStorage",
    "LogicalArray",
    "ObjectRecord",
    "Part",
    "Piece",
    "Prediction",
    "Problem",
    "RankInfo",
    "RankTransaction",
    "RankWriter",
    "Reader",
    "RefInfo",
    "Repository",
    "Retention",
    "RowSet",
    "SkipSet",
    "Snapshot",
    "StepTransaction",
    "StepWriter",
    "Storage",
    "Transaction",
    "TransactionProxy",
    "VerifyReport",
    "Writer",
    "abort_vote",
    "adam_predictions",
    "as_float",
    "batches_of",
    "check_array_path",
    "collect_parts",
    "digest",
    "dtype_itemsize",
    "dtype_name",
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
