"""Hugging Face models converted by `bd.parallelize` with the plans they carry, compared with the
unconverted model: tiny Llama (grouped-query attention, its own plan), BERT (a plan set on its
config), GPT-2 (``Conv1D`` layers, column/row with their transposed layout); LFM2, whose own plan
names only its embedding and head, is told what to do, and the plan of its own that
docs/converting-models.md gives converts it exactly (`check_parallel`'s rules). Built from
configs, nothing downloaded.

Tolerance: fp32 everywhere. TP changes only the order of sums (row-parallel partial products
all-reduced, vocab-parallel lookups summed), ~1e-7 relative per op; through 2 layers, softmax and
3 AdamW steps at lr 1e-3 the observed differences stay below 1e-6, so 2e-5 (rel and abs) is far
from noise yet catches any wrong slice (which moves outputs by O(1)).
"""
import copy
import logging
import re

import pytest
import safetensors.torch
import torch

import bigdense as bd
from bigdense.testing import check_parallel, run_ranks
from helpers import ROOT, assert_close

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=2e-5, atol=2e-5)
NO_DROPOUT = dict(attention_dropout=0.0)


def tiny_llama():
    # GQA: 4 query heads, 2 key/value heads; vocabulary 61 is uneven over 2 ranks.
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


BERT_PLAN = {  # what a user sets on a config that ships none (Megatron's split of a BERT layer)
    "encoder.layer.*.attention.self.query": "colwise", "encoder.layer.*.attention.self.key": "colwise",
    "encoder.layer.*.attention.self.value": "colwise", "encoder.layer.*.attention.output.dense": "rowwise",
    "encoder.layer.*.intermediate.dense": "colwise", "encoder.layer.*.output.dense": "rowwise",
}


def tiny_bert():
    cfg = transformers.BertConfig(vocab_size=61, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    cfg.base_model_tp_plan = BERT_PLAN
    return transformers.BertForMaskedLM(cfg)


def tiny_gpt2():
    cfg = transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg.base_model_tp_plan = {"h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}
    return transformers.GPT2LMHeadModel(cfg)


BUILDERS = {"llama": tiny_llama, "bert": tiny_bert, "gpt2": tiny_gpt2}
EXPECTED = {  # module -> class after conversion, on top of what the plan converts
    "llama": {"lm_head": "ColumnParallelLinear", "model.embed_tokens": "VocabParallelEmbedding",
              "model.layers.1.self_attn.k_proj": "ColumnParallelLinear", "model.layers.0.mlp.down_proj": "RowParallelLinear"},
    "bert": {"bert.encoder.layer.0.attention.self.query": "ColumnParallelLinear",
             "bert.encoder.layer.1.output.dense": "RowParallelLinear"},
    "gpt2": {"transformer.h.0.mlp.c_fc": "ColumnParallelConv1D", "transformer.h.1.mlp.c_proj": "RowParallelConv1D"},
}


def _compare_with_unconverted(kind):
    ctx = bd.init_parallel(tp=2)
    torch.manual_seed(0)
    reference = BUILDERS[kind]()
    model = bd.parallelize(copy.deepcopy(reference))  # plan=None: the model's own plan
    assert model.bd_parallel_plan_source == "the model's Hugging Face tensor-parallel plan"
    for name, cls in EXPECTED[kind].items():
        assert type(model.get_submodule(name)).__name__ == cls, (name, type(model.get_submodule(name)))
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    kwargs = {"labels": ids}
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        ref_out, out = reference(input_ids=ids, **kwargs), model(input_ids=ids, **kwargs)
        assert_close(out.logits, ref_out.logits, f"{kind} logits at step {step}", **TOL)
        assert_close(out.loss, ref_out.loss, f"{kind} loss at step {step}", **TOL)
        for m, o, loss in ((reference, opt_ref, ref_out.loss), (model, opt, out.loss)):
            loss.backward()
            o.step()
            o.zero_grad()
    return ctx.tp_rank


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_hf_model_converted_by_its_plan_matches_the_unconverted_model(kind):
    assert run_ranks(_compare_with_unconverted, 2, kind, timeout=180) == [0, 1]


def test_the_plan_used_is_reported(caplog):
    torch.manual_seed(0)
    model = tiny_llama()
    assert bd.plan_parallelism(model)["model.layers.0.self_attn.o_proj"] == "row"
    with caplog.at_level(logging.INFO, logger="bigdense.parallelize"):
        bd.parallelize(model)
    assert "using the model's Hugging Face tensor-parallel plan" in caplog.text


def test_unknown_hf_styles_are_refused_by_name():
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=44, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    cfg.base_model_tp_plan = {**cfg.base_model_tp_plan, "layers.*.mlp.up_proj": "colwise_sideways"}
    model = transformers.LlamaModel(cfg)
    with pytest.raises(ValueError, match=r"does not know: \{'layers.\*.mlp.up_proj': 'colwise_sideways'\}"):
        bd.parallelize(model)
    assert type(model.layers[0].mlp.up_proj) is torch.nn.Linear  # refused before anything changed


def test_gpt2_conv1d_in_a_plan_keeps_its_layout_and_names():
    torch.manual_seed(0)
    reference = tiny_gpt2()
    model = bd.parallelize(copy.deepcopy(reference), {"transformer.h.*.mlp.c_fc": "column",
                                                      "transformer.h.*.mlp.c_proj": "row"})
    layer = model.transformer.h[0].mlp.c_fc
    assert isinstance(layer, bd.ColumnParallelConv1D) and layer.weight.shape == (32, 128)  # Conv1D layout kept
    assert model.state_dict().keys() == reference.state_dict().keys()
    ids = torch.randint(0, 61, (2, 8))
    assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, "gpt2 logits at tp=1", **TOL)


def _tied_llama_converts_in_place_and_stays_tied():
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=44, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    reference = transformers.LlamaForCausalLM(cfg)
    model = bd.parallelize(copy.deepcopy(reference))
    # The embedding and the head keep their classes and share one slice of the vocabulary.
    assert isinstance(model.lm_head, torch.nn.Linear) and isinstance(model.model.embed_tokens, torch.nn.Embedding)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.shape == (31 - bd.get_default_context().tp_rank, 32)  # 61 rows over 2 ranks
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(3):
        ref_out, out = reference(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
        assert_close(out.logits, ref_out.logits, f"tied llama logits at step {step}", **TOL)
        for o, loss in ((opt_ref, ref_out.loss), (opt, out.loss)):
            loss.backward()
            o.step()
            o.zero_grad()
    return model.bd_parallel_report.sharded_fraction


def test_a_tied_embedding_and_head_in_an_hf_plan_convert_in_place_and_stay_tied():
    assert all(f > 0.9 for f in run_ranks(_tied_llama_converts_in_place_and_stays_tied, 2, timeout=180))


def _save_converted_gpt2(path):
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    model = bd.parallelize(tiny_gpt2())
    bd.save_checkpoint(path, model, step=1)


def test_converted_gpt2_checkpoint_exports_to_the_plain_model(tmp_path):
    """Conv1D shards are saved in Conv1D layout: the export loads into an unconverted GPT-2."""
    run_ranks(_save_converted_gpt2, 2, str(tmp_path / "ckpt" / "step_1"), timeout=180)
    out = bd.export_dense(tmp_path / "ckpt" / "latest", tmp_path / "gpt2.safetensors")
    torch.manual_seed(0)
    reference = tiny_gpt2()  # the weights the ranks converted
    torch.manual_seed(1)
    plain = tiny_gpt2()
    safetensors.torch.load_model(plain, out)  # GPT-2's tied lm_head is stored once
    for name, value in reference.state_dict().items():
        assert torch.equal(plain.state_dict()[name], value), name


def test_an_hf_model_without_a_plan_is_told_what_to_do():
    # GPT-2 ships no plan; the automatic patterns would convert only its position embedding.
    cfg = transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel carries no Hugging Face tensor-parallel plan.*"
                                         r"'transformer\.h\.\*\.mlp\.c_fc'"):
        bd.parallelize(model)
    assert type(model.transformer.wpe) is torch.nn.Embedding  # nothing changed


def _tiny_lfm2():
    from bigdense.testing.hf_models import build_tiny

    return build_tiny("lfm2", variant=True)  # a convolution layer and an attention layer, as released LFM2s mix


def _lfm2_by_its_own_plan():
    bd.init_parallel(tp=2)
    torch.manual_seed(0)
    report = bd.parallelize(_tiny_lfm2()).bd_parallel_report
    return report.notes, report.sharded_fraction


def test_a_plan_that_names_little_says_what_a_user_can_do():
    notes, fraction = run_ranks(_lfm2_by_its_own_plan, 2, timeout=180)[0]
    hint = [n for n in notes if "pass a plan of your own" in n]
    assert fraction < 0.2 and len(hint) == 1, notes
    assert hint[0].startswith(f"Lfm2ForCausalLM's own plan splits {fraction:.0%} of its parameters; 9 dense layer")
    assert "model.layers.*.feed_forward.w1" in hint[0] and "docs/converting-models.md" in hint[0], hint[0]


def _docs_plan_for_lfm2() -> dict:
    """The entries docs/converting-models.md adds to LFM2's own plan (its block under 'A plan of
    your own for a Hugging Face model'), so that the page shows the plan this test checks."""
    section = (ROOT / "docs" / "converting-models.md").read_text().split("### A plan of your own", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    assert "**model.tp_plan" in block, block
    return dict(re.findall(r'"([^"]+)": "([^"]+)"', block))


def test_the_docs_plan_of_your_own_converts_lfm2_exactly():
    from bigdense.testing.hf_models import token_batch

    plan = {**_tiny_lfm2().tp_plan, **_docs_plan_for_lfm2()}
    check = check_parallel(_tiny_lfm2, token_batch(), tp=2, steps=1, plan=plan, verbose=False)
    assert check.exact, str(check)
    split = float(re.search(r"([\d.]+)% of the parameters split", check.results[2].conversion).group(1))
    assert split > 80, check.results[2].conversion  # the attention and the MLPs too, not only the embedding
