"""Small real things for tests, demos and benchmarks (imports torch; not loaded by ``dstt``)."""
