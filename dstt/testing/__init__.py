"""Small real things for tests, demos and benchmarks (imports torch; not loaded by ``dstt``).

``models`` a tiny GPT and a deterministic batch stream · ``llama`` a Llama-style decoder at
real sizes · ``spike_scenarios`` tiny runs with one spike mechanism planted in each · ``soak``
the crash soak's training process · ``storage`` a conformance suite for ``Storage`` backends.
"""
