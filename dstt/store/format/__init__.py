"""What the bytes mean: every key of a run (``layout``), Zarr v3 documents (``zarr_meta``), the
stored-zip step file (``zipfmt``, ``stepfile``, ``flat``), commit manifests and the arrays
table (``manifest``; their values ``records``, the checksummed envelope ``envelope``),
pickled/JSON objects (``objects``), index segments (``segment``), a rank's part manifest
(``parts``) and data attribution's records (``batches``). Functions of bytes; the few that
touch files (``stepfile``, the part and skip files) take a ``Storage`` and know nothing of
runs, writers or readers."""
