"""Where a run's bytes live: the ``Storage`` contract (``base``), POSIX files (``local``; its
blobs ``local_blob``, its system calls ``posix``) and the in-memory fake with a crash model
(``memory``). The commit protocol above sees only ``base``."""
