"""Benchmarks: ``python -m bigdense.bench.<name>``. Each prints medians and a ratio against a named
baseline measured in the same run; the numbers are for reading, never for assertions."""
