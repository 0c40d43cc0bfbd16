"""The run's index: a derived, checksummed cache of the commit headers, so readers open a run
of 100,000 steps without reading 100,000 headers.

``view`` the reader's side (segments, which rows are trusted, ``Index``, ``IndexedHeader``) ·
``rows`` rows from headers and row operations · ``writer`` the writing side (pending rows,
segments, merges) · ``job`` segments written by a job process · ``repair`` whole-index
rewrites (gc, ``dstt index``, verify) · ``shard_summaries`` sharded tensors' summaries folded
into one row per logical tensor · ``source`` what the index reads a run through.
"""
