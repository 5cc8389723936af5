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

    assert callers() == ["bigdense.layers.base", "bigdense.layers.dropout", "bigdense.models.gpt"]
    with step.variant("baseline", checks=False):
        assert callers() == []
