"""What the bytes mean: every key of a run (``layout``), Zarr v3 documents (``zarr_meta``), the
stored-zip step file (``zipfmt``, ``stepfile``, ``flat``), commit manifests and the arrays
table (``manifest``; their values ``records``, the checksummed envelope ``envelope``), and
pickled/JSON objects (``objects``). Pure functions of bytes: no storage access, no threads."""
