"""Benchmarks: ``python -m bigdense.bench.<name>``. Each prints medians and a ratio against a named
baseline measured in the same run; the numbers are for reading, never for assertions."""
import json
import resource

SEED = 1234  # the benchmarks' weights and inputs


def append_json_lines(path, rows) -> None:
    """Append one JSON object per result to ``path`` (the ``--json`` output of a benchmark)."""
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM; ``ru_maxrss`` where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
