"""`python -m bigdense.bench.muon --quick` runs end to end (a tiny GPT at tp=2 x dp=2 on 4 gloo
processes, then the planner's gpt_1b rows) and writes what it printed: counts and bytes are held
exactly, times only to be positive (they are for reading)."""
import json

import pytest

from bigdense.bench import muon


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "muon.jsonl"
    assert muon.main(["--quick", "--json", str(path)]) == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_both_schemes_move_the_same_counted_bytes_as_planned(rows):
    measured = [r for r in rows if r["part"] == "measured"]
    assert {(r["engine"], r["scheme"]) for r in measured} == {(e, s) for e in muon.ENGINES for s in muon.SCHEMES}
    for engine in muon.ENGINES:
        a2a, gather = (next(r for r in measured if (r["engine"], r["scheme"]) == (engine, s)) for s in muon.SCHEMES)
        assert a2a["sent_bytes"] == gather["sent_bytes"] == a2a["planned_sent_bytes"], engine
        assert min(a2a["sent_bytes"]) > 0 and a2a["ns_gflops"] == gather["ns_gflops"]
        # two per round against two per matrix: 2 layers x 6 matrices over 4 ranks make 3 rounds
        assert a2a["all_to_alls"] == [6] * 4 and gather["all_to_alls"] == [24] * 4
        for r in (a2a, gather):
            assert len(r["step_s"]) == 2 and min(r["step_s"]) > 0 and r["step_ms"] > 0
            assert min(r["ns_s"]) > 0 and r["gather_over_all_to_all"] > 0


def test_planned_1b_rows_state_their_assumptions(rows):
    planned = [r for r in rows if r["part"] == "planned"]
    assert {(r["tp"], r["dp"], r["engine"], r["scheme"]) for r in planned} == {
        (tp, dp, e, s) for tp, dp in muon.PLANNED_LAYOUTS for e in muon.ENGINES for s in muon.SCHEMES}
    for r in planned:
        twin = next(o for o in planned if (o["tp"], o["dp"], o["engine"]) == (r["tp"], r["dp"], r["engine"])
                    and o["scheme"] != r["scheme"])
        assert r["sent_bytes_max"] == twin["sent_bytes_max"] > 0 and r["ns_flops_max"] == twin["ns_flops_max"]
        # 18 layers x (q, k, v, out, up, down)
        assert r["matrices"] == 108 and r["collectives"] == 2 * (r["rounds"] if r["scheme"] == "all_to_all" else 108)
        assert r["modelled_ms"] > 0 and {"tflops", "gbps", "latency_us"} <= set(r)
