"""Benchmarks of sparseattn's engines and maps (run them with ``sparseattn bench``)."""
