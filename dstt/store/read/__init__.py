"""Reading committed steps: refs, lineage, arrays tables, verified chunks.

``reader`` the ``Reader`` (refs → lineage of commit headers → arrays tables) · ``chunks`` its
chunk reads (delta chains, whole arrays, row ranges) · ``shards`` logical arrays assembled
from pieces of stored flat arrays · ``_index_main`` the index job's entry point.
"""
