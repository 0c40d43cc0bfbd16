"""The flusher process: a flat step's checksums, zip entries, digests and writes off the GIL.

``parent`` the engine-side handle (``Flusher``) · ``child`` the process's side · ``_main`` its
entry point (``python -m dstt.store.flusher._main``). The digests of a flat buffer are the
summary kernel's (``dstt.analysis.summary_kernel.digest``), run here or in process.
"""
