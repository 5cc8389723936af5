"""Benchmarks: ``python -m bigdense.bench.<name>``. Each prints medians and a ratio against a named
baseline measured in the same run; the numbers are for reading, never for assertions."""
import json


def append_json_lines(path, rows) -> None:
    """Append one JSON object per result to ``path`` (the ``--json`` output of a benchmark)."""
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
