"""Everything about bytes on disk: Zarr v3 arrays, commit manifests, refs. Knows no torch."""

from .api import Snapshot, dtype_name, load, save
from .backend import Durability, LocalStorage, Storage
from .codec import DeltaPolicy
from .delta import EncodeStats
from .layout import ChunkPlan, plan_chunks
from .maintenance import GcReport, Problem, VerifyReport
from .manifest import ArrayRecord, ChunkRecord, CommitHeader, ObjectRecord, RefInfo
from .parts import Part
from .reader import Reader
from .repository import Repository
from .shards import LogicalArray, Piece
from .writer import Transaction, Writer

__all__ = [
    "ArrayRecord",
    "ChunkPlan",
    "ChunkRecord",
    "CommitHeader",
    "DeltaPolicy",
    "Durability",
    "EncodeStats",
    "GcReport",
    "LocalStorage",
    "LogicalArray",
    "ObjectRecord",
    "Part",
    "Piece",
    "Problem",
    "Reader",
    "RefInfo",
    "Repository",
    "Snapshot",
    "Storage",
    "Transaction",
    "VerifyReport",
    "Writer",
    "dtype_name",
    "load",
    "plan_chunks",
    "save",
]
