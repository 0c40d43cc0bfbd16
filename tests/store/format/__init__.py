"""Tests of ``dstt.store.format``: the hand-written ZIP records (``test_zipfmt``), the spliced
arrays table (``test_table_template``) and a step as plain Zarr v3 for zarr-python, xarray and
tensorstore (``test_interop``).
"""
