"""Where a run's bytes live: the ``Storage`` contract and its ``Blob`` (``base``), POSIX files
(``local``; its step-file blobs ``local_blob``, its system calls ``posix``: fsync_dir,
pwritev, syncfs), the in-memory fake with a crash model (``memory``: ``MemoryStorage``, whose
``"fsync"`` mode is a barrier per handle, ``DelegatingStorage``, ``FaultyStorage``), S3
(``s3``: ``S3Storage`` on obstore, a lease and compare-and-swap refs; ``s3_lease`` its lease,
``s3_blob`` its step-file uploads, ``s3_config`` URL and environment configuration) and
``urls`` (``storage_for(url)``). The commit protocol above sees only ``base``."""
