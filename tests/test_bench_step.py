"""`python -m bigdense.bench.step` measures what it says: its tile-loop baseline replaces
`tp_dropout` in every module that calls it (one it missed would stay counter-based in both variants),
and its op count runs on meta tensors with a fake process group, where the baseline launches about
twice the ops at batch 8 x 256 tokens (4,107 against 2,187 when measured)."""
from bigdense.bench import step
from bigdense.testing import run_ranks


def test_step_bench_counts_ops_on_meta_tensors():
    counts = run_ranks(step._count_ops, 1, [256], 8, init_process_group=False, timeout=300)[0]
    baseline, current = counts["baseline", 256], counts["current", 256]
    assert baseline > 1.8 * current > 3000, counts


def test_the_baseline_replaces_tp_dropout_in_every_module_that_calls_it():
    import sys

    import bigdense.models  # noqa: F401 - every caller imported
    from bigdense.parallel.dropout import tp_dropout

    def callers():
        return sorted(name for name, module in list(sys.modules.items())
                      if name.startswith("bigdense.") and not hasattr(module, "__path__")  # (packages re-export)
                      and name != "bigdense.parallel.dropout" and getattr(module, "tp_dropout", None) is tp_dropout)

    assert callers() == ["bigdense.layers.base", "bigdense.layers.dropout", "bigdense.layers.lora",
                         "bigdense.models.gpt"]
    with step.variant("baseline", checks=False):
        assert callers() == []


def test_step_bench_reports_graphs_and_breaks_of_the_whole_model_compile(tmp_path):
    # `--compile model --json FILE` writes graphs_forward, graphs_backward and graph_breaks: at tp=2
    # the whole forward is one graph and its backward one, with no break and nothing recompiled
    # by the later steps (aot_eager: no C++ compiler needed).
    import json

    path = tmp_path / "step.jsonl"
    step.main(["--quick", "--compile", "model", "--json", str(path)])
    row = json.loads(path.read_text().splitlines()[-1])
    assert (row["graphs_forward"], row["graphs_backward"], row["graph_breaks"], row["recompiled_later"]) == (1, 1, 0, 0)
    assert row["host_syncs_eager"] == 0 and row["kernels"] > 0, row


def test_dropout_under_inductor_is_one_fused_pass_per_site_with_no_mask_stored():
    # bench.dropout's compiled measure: one generated kernel forward (the key's randint left to
    # aten) and one backward, which regenerates the mask from the saved 8-byte key; F.dropout
    # stores a byte per element for its backward.
    import torch

    from bigdense.bench import dropout

    ours = dropout.compiled_cost(dropout._contenders()["bd.tp_dropout"], (4, 64, 96), torch.bfloat16)
    theirs = dropout.compiled_cost(dropout._contenders()["F.dropout (baseline)"], (4, 64, 96), torch.bfloat16)
    assert (ours["kernels_forward"], ours["kernels_backward"]) == (1, 1), ours
    assert ours["saved_bytes_per_element_compiled"] == 8 / (4 * 64 * 96), ours
    assert theirs["saved_bytes_per_element_compiled"] >= 1.0, theirs
