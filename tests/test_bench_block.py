"""`python -m bigdense.bench.block` at toy size: the counts it reports are the ones the code has."""
import json

import pytest

from bigdense.bench import block


@pytest.mark.slow  # five process pairs
def test_block_bench_reports_saved_bytes_and_all_reduces(tmp_path):
    path = tmp_path / "block.jsonl"
    block.main(["--tp", "1", "2", "--seq", "32", "--layers", "1", "--batch", "1", "--steps", "1", "--vocab", "512",
                "--json", str(path)])
    rows = {(r["tp"], r["sequence_parallel"], r["overlap_comm"]): r for r in map(json.loads, open(path))}
    assert set(rows) == {(1, False, True), (2, False, True), (2, False, False), (2, True, True), (2, True, False)}
    base = rows[1, False, True]["saved_bytes"]
    for overlap in (True, False):
        sp, tp = rows[2, True, overlap], rows[2, False, overlap]
        assert sp["saved_bytes"] <= 1.1 / 2 * base < tp["saved_bytes"]
        # One block: without SP 2 all-reduces of activations each way, the embedding's output and the
        # head's input gradient; the engine adds the norm and the skip vote. With SP: the 6 partial
        # sums (ln1, ln2 weight and bias, two row biases) and ln_f's 2, one all-reduce in the engine.
        assert (tp["all_reduces_fwd_bwd"], tp["all_reduces_engine_step"]) == (6, 8)
        assert (sp["all_reduces_fwd_bwd"], sp["all_reduces_engine_step"]) == (8, 3)
