"""Every causal-LM architecture of the installed transformers that ships a tensor-parallel plan,
converted by `bd.parallelize` with its own plan (`bigdense.testing.hf_sweep`): exact against the
unconverted model (logits and loss before and after an SGD step, every gradient, fp32 round-off:
check_parallel's rtol 1e-4 of each value), its checkpoint saved sharded and exported into the
plain model bit for bit -- or refused at conversion with a message. None may differ or fail. Each
one's loss path in a `CausalLM` is named too: the fused head (its loss and every gradient held to
the plain model's logits and F.cross_entropy, within the same rtol), or the gathered logits and why;
at least 95% of the exact ones take the fused path.

It runs against whatever transformers is installed (the tested range is pyproject.toml's), and each
case's id and its failure table name that version. The whole sweep is slow (about 150 tiny models);
the quick part keeps a handful that cover every kind of style: dense (Llama), per-head norms
(Qwen3; Param2-MoE's, which its plan leaves out), mixture-of-experts (Mixtral, Qwen3-MoE: since
transformers 5.25 their experts are split by the expert-parallel plan), multi-head latent attention
(DeepSeek-V2), a split-input row (Phi-3), a tied embedding and head (Gemma 3), plans bigdense
corrects or partly keeps whole (Apertus, Doge, Dory's subclassed head, Inkling's experts), attention
sinks (MiMo-V2-Flash), identity experts (LongCat-Flash) and heads split in whole units (MiniCPM5-MoE's
``unit_colwise``). Architectures the installed transformers does not ship are left out.
"""
import pytest

from bigdense.testing.hf_sweep import architectures, markdown, sweep, versions

pytest.importorskip("transformers")

QUICK = ["llama", "qwen3", "mixtral", "qwen3_moe", "deepseek_v2", "phi3", "gemma3_text", "apertus", "doge", "dory",
         "mimo_v2_flash", "longcat_flash", "inkling_text", "param2moe", "minicpm5_moe"]
# At tp=3 the tiny models' 4 heads do not divide: attention stays whole, everything else splits
# unevenly (a vocabulary of 256, MLPs of 128, experts of 64 -- or 4 experts -- over 3 ranks). At
# tp=4 with 4 key/value heads, attention splits too, one head per rank.
UNEVEN = ["llama", "qwen3_moe", "mixtral", "deepseek_v2", "gemma3_text", "phi3", "longcat_flash", "llama4_text"]
TRANSFORMERS = [versions()["transformers"]]  # a parameter only to name it in every case's id


def _assert_all_exact(results, tp):
    table = markdown(results, tp)
    assert all(r.status in ("exact", "refused", "unbuildable") for r in results), table
    return table


@pytest.mark.parametrize("transformers_version", TRANSFORMERS, ids=lambda v: f"transformers-{v}")
def test_a_handful_of_architectures_convert_exactly_at_tp2(transformers_version):
    results = sweep(2, QUICK)
    table = _assert_all_exact(results, 2)
    assert table.startswith(f"tp=2 (transformers {transformers_version}, ")
    by_name = {r.name: r for r in results}
    shipped = {t for t, variant in architectures(QUICK) if not variant}
    assert shipped <= set(by_name) and {"llama", "mixtral", "qwen3_moe", "deepseek_v2"} <= shipped, table
    assert all(r.status == "exact" for n, r in by_name.items() if n in shipped), table
    # What bigdense keeps whole, and why, is said: Doge's attention builds its mask from every head.
    assert any("dynamic mask" in why for why in by_name["doge"].kept_whole.values())
    # The experts are split, by the tensor-parallel plan (transformers <= 5.24) or the expert-parallel one.
    assert by_name["mixtral"].sharded_fraction > 0.8 and by_name["qwen3_moe"].sharded_fraction > 0.8, table
    # The loss through the fused head, Gemma 3's tied head included; Dory's head has a learned
    # per-class scale inside it, so it keeps its logits, and says why.
    assert by_name["llama"].loss_path.startswith("fused") and by_name["gemma3_text"].loss_path.startswith("fused")
    assert by_name["dory"].loss_path.startswith("gathered logits: its output head (DoryLMHead)"), table


@pytest.mark.slow
@pytest.mark.parametrize("transformers_version", TRANSFORMERS, ids=lambda v: f"transformers-{v}")
def test_every_architecture_with_a_plan_converts_exactly_or_is_refused_at_tp2(transformers_version):
    results = sweep(2)
    table = _assert_all_exact(results, 2)
    assert len(results) == len(architectures()) >= 130, table
    exact = [r for r in results if r.status == "exact"]
    assert len(exact) >= 0.9 * len(results), table
    fused = [r for r in exact if r.loss_path.startswith("fused")]
    assert len(fused) >= 0.95 * len(exact), table
    assert all(r.loss_path.startswith("gathered logits: ") and len(r.loss_path) > 30 for r in exact if r not in fused)


@pytest.mark.slow
@pytest.mark.parametrize("transformers_version", TRANSFORMERS, ids=lambda v: f"transformers-{v}")
def test_uneven_splits_at_tp3_and_one_head_per_rank_at_tp4(transformers_version):
    _assert_all_exact(sweep(3, UNEVEN), 3)
    results = sweep(4, UNEVEN, num_attention_heads=4, num_key_value_heads=4)
    _assert_all_exact(results, 4)
    assert all(not any("heads" in why for why in (r.kept_whole or {}).values()) for r in results)
