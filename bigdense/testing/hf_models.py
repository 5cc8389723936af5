"""Tiny models of every causal-LM architecture of the installed ``transformers`` that ships a
tensor-parallel plan, built from their default configs shrunk to a few layers (nothing downloaded).

    types = planned_causal_lm_types()          # ["afmoe", "apertus", ..., "youtu"]
    model = build_tiny("qwen3_moe")            # torch.manual_seed first for the same weights
    model = build_tiny("qwen3_moe", variant=True)   # the layout that switches on the rest of its plan

Widths become 64 (hidden), 128 (MLP), 64 (experts), heads 4 (2 key/value) of 16, vocabulary 256,
4 experts choosing 2, and at most 4 layers chosen so that every kind of layer the default has (by
per-layer lists, layer-index lists and dense-prefix counts) is kept. Dropout is 0: a converted
model's dropout on split activations draws other masks than the plain model's, which says nothing
about its exactness. ``PER_ARCH`` repairs default configs that do not build or run as they are;
``VARIANTS`` switch on parts of a plan a default layout never builds (dense MLP layers of an
all-MoE default, MoE blocks behind a flag). Used by the sweep test and `bigdense.testing.hf_sweep`.
"""
from __future__ import annotations

import copy
import dataclasses

SMALL = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64,
    "intermediate_size": 128, "ffn_hidden_size": 128, "dense_intermediate_size": 128, "intermediate_size_mlp": 128,
    "first_dense_intermediate_size": 128,
    "moe_intermediate_size": 64, "expert_ffn_hidden_size": 64, "shared_expert_intermediate_size": 64,
    "shared_experts_intermediate_size": 64, "shared_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2, "n_layer": 2, "n_layers": 2, "num_layers": 2, "depth": 2,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4, "swa_num_attention_heads": 4,
    "num_key_value_heads": 2, "kv_n_heads": 2, "swa_num_key_value_heads": 2, "head_dim": 16, "swa_head_dim": 16,
    "vocab_size": 256, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_k": 2, "moe_top_k": 2, "moe_topk": 2,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 24, "o_lora_rank": 32, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4,
    "index_num_heads": 1,  # Kolibri-1.1's indexer: at most the query heads of one key head (1 with --heads 4 4)
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "linear_num_heads": 4, "linear_head_dim": 16, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
    "mamba_n_groups": 1, "mamba_chunk_size": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
    "n_groups": 1, "rotary_dim": 8, "mamba_d_ssm": 128, "laurel_rank": 8, "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": 256, "num_kv_shared_layers": 0, "zero_expert_num": 2,
}
CAP_ONE = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id", "eod_token_id", "sep_token_id", "decoder_start_token_id")
LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")
DENSE_PREFIX_KEYS = ("first_k_dense_replace", "num_dense_layers")
FILL_NONE = {"head_dim": 16, "num_key_value_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2,
             "n_shared_experts": 1}
MAX_LAYERS = 4
VOCAB = SMALL["vocab_size"]


def _text(d: dict) -> dict:
    """The dict holding the decoder's config: its text_config if it has one."""
    return d["text_config"] if isinstance(d.get("text_config"), dict) else d


def _fix_dory(d):
    d.update(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1, n_recurrent_loops=2,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"], rope_parameters=None)


def _fix_qwen4_exp(d):
    _text(d).update(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                    indexer_compress_ratio=4)


def _fix_dots3_note(d):
    _text(d).update(num_key_value_heads=_text(d)["num_attention_heads"])
    for override in (_text(d).get("per_layer_config") or {}).values():  # a second MLA geometry, kv heads == heads
        override.update(num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=64, head_dim=40,
                        qk_nope_head_dim=32, v_head_dim=32, qk_rope_head_dim=8)
    for sub, key in (("vision_config", "adapter_in_dim"), ("audio_config", "adapter_input_size")):
        if isinstance(d.get(sub), dict):
            d[sub][key] = d[sub]["hidden_size"]
            if "adapter_out_dim" in d[sub]:
                d[sub]["adapter_out_dim"] = _text(d)["hidden_size"]


# Default configs that do not build or run as they are, and layouts that need a layer of each kind.
PER_ARCH = {
    "jamba": lambda d: d.update(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "llama4": lambda d: _text(d).update(interleave_moe_layer_step=1),
    "llama4_text": lambda d: d.update(interleave_moe_layer_step=1),
    "gemma4_assistant": lambda d: _text(d).update(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                                                  enable_moe_block=False, use_double_wide_mlp=False,
                                                  num_kv_shared_layers=0),
    "dory": _fix_dory,
    "lfm2_moe": lambda d: d.update(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "bamba": lambda d: d.update(attn_layer_indices=[1]),
    "granitemoehybrid": lambda d: d.update(layer_types=["linear_attention", "full_attention"]),
    "hrm_text": lambda d: d.update(num_hidden_layers=1, num_layers_per_stack=None, H_cycles=1, L_cycles=1,
                                   L_bp_cycles=[1]),
    "cohere_compass_text": lambda d: d.update(rope_parameters={"full_attention": {"rope_type": "default",
                                                                                   "rope_theta": 10000.0}}),
    "qwen4_exp": _fix_qwen4_exp,
    "qwen4_exp_text": _fix_qwen4_exp,
    "dots3_note": _fix_dots3_note,
    "dots3_note_text": _fix_dots3_note,
    "dbrx": lambda d: d["attn_config"].update(rope_theta=10000.0, clip_qkv=8.0),
}

# Layouts that switch on plan entries a default never builds.
VARIANTS = {
    "doge": {"is_moe": True, "num_experts": 16, "num_experts_per_tok": 2},
    "cohere2_moe": {"mlp_layer_types": ["dense", "sparse"]},
    "mellum": {"mlp_layer_types": ["dense", "sparse"]},
    "inkling_text": {"mlp_layer_types": ["dense", "sparse"]},
    "deepseek_v2": {"q_lora_rank": None, "first_k_dense_replace": 1},
    "dots1": {"first_k_dense_replace": 1},
    "minicpm3": {"q_lora_rank": None},
    "qwen2_moe": {"mlp_only_layers": [0]},
    "qwen3_moe": {"mlp_only_layers": [0]},
    "qwen3_next": {"mlp_only_layers": [0]},
    "gemma4_text": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64},
    "qwen4_exp_text": {"ple_layer_ids": [1], "ple_embed_dim": 32, "ngram_vocab_size_base": 256, "eos_token_id": 2},
    "dory": {"tie_word_embeddings": True, "pad_token_id": 0},  # a tied embedding, and its padding row
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},  # released checkpoints mix both
}


def _config_mapping():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING


def planned_causal_lm_types() -> list[str]:
    """Every causal-LM ``model_type`` of the installed transformers whose config or model class
    carries a tensor-parallel plan."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        config_class = _config_mapping()[model_type]
        try:
            base = config_class().base_model_tp_plan
        except Exception:  # noqa: BLE001 - a default config that does not build: the class attribute says
            base = getattr(config_class, "base_model_tp_plan", None)
        if base or getattr(getattr(transformers, class_name, None), "_tp_plan", None):
            out.append(model_type)
    return sorted(out)


def _layer_count(d):
    for k in LAYER_COUNT_KEYS:
        if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
            return k, d[k]
    return None, None


def _choose_layers(d: dict, n: int):
    """Up to MAX_LAYERS layer indices covering every kind of layer of an ``n``-layer config."""
    per_layer = {k: v for k, v in d.items() if isinstance(v, list) and len(v) == n and n > 0 and v != list(range(n))}
    index_lists = {
        k: v for k, v in d.items()
        if isinstance(v, list) and k not in per_layer and v and all(isinstance(x, int) and not isinstance(x, bool)
                                                                    for x in v)
        and all(0 <= x < n for x in v) and ("layer" in k or "idx" in k or "index" in k) and v != list(range(n))
    }
    every = [k for k, v in d.items() if isinstance(v, list) and n > 0 and v == list(range(n))]
    prefixes = {k: d[k] for k in DENSE_PREFIX_KEYS if isinstance(d.get(k), int)}
    overrides = d.get("per_layer_config") if isinstance(d.get("per_layer_config"), dict) else {}

    def kind(i):
        return (repr(sorted((overrides.get(i) or {}).items())), *(repr(v[i]) for v in per_layer.values()),
                *(i in v for v in index_lists.values()), *(i < p for p in prefixes.values()))

    chosen, kinds = [], set()
    for i in range(n):
        if kind(i) not in kinds and len(chosen) < MAX_LAYERS:
            kinds.add(kind(i))
            chosen.append(i)
    for i in range(n):
        if len(chosen) >= min(2, n):
            break
        if i not in chosen:
            chosen.append(i)
    return sorted(chosen), per_layer, index_lists, every, prefixes


def _fields_of(model_type):
    cls = _config_mapping().get(model_type) if model_type in _config_mapping() else None
    return {f.name for f in dataclasses.fields(cls)} if cls is not None and dataclasses.is_dataclass(cls) else None


def _shrink(d: dict, model_type: str) -> dict:
    d = dict(d)
    names = _fields_of(d.get("model_type") or model_type)
    if names:  # derived attributes are recomputed from the shrunk values
        d = {k: v for k, v in d.items() if k in names or k in ("model_type", "per_layer_config")}
    _, n = _layer_count(d)
    if n:
        chosen, per_layer, index_lists, every, prefixes = _choose_layers(d, n)
        for k, v in per_layer.items():
            d[k] = [v[i] for i in chosen]
        for k, v in index_lists.items():
            d[k] = [j for j, o in enumerate(chosen) if o in v]
        for k in every:
            d[k] = list(range(len(chosen)))
        for k, p in prefixes.items():
            d[k] = sum(1 for o in chosen if o < p)
        if isinstance(d.get("per_layer_config"), dict):
            d["per_layer_config"] = {
                j: {a: (SMALL[a] * 2 if a in SMALL and isinstance(v, int) and not isinstance(v, bool) else v)
                    for a, v in d["per_layer_config"][o].items()}
                for j, o in enumerate(chosen) if d["per_layer_config"].get(o)}
    for k, v in list(d.items()):
        if isinstance(v, bool):
            continue
        if k in SMALL and isinstance(v, int):
            d[k] = SMALL[k]
        elif k in CAP_ONE and isinstance(v, int):
            d[k] = min(v, 1)
        elif k in ("sliding_window", "sliding_window_size") and isinstance(v, int):
            d[k] = min(v, 16)
        elif k == "original_max_position_embeddings" and isinstance(v, int):
            d[k] = 64
        elif k in FILL_NONE and v is None:
            d[k] = FILL_NONE[k]
        elif ("dropout" in k or "pdrop" in k) and isinstance(v, float):
            d[k] = 0.0
    if "kv_lora_rank" in d:  # multi-head latent attention: a key per query head; RoPE on qk_rope_head_dim
        d["num_key_value_heads"] = d.get("num_attention_heads", 4)
        if "head_dim" in d:
            d["head_dim"] = d.get("qk_rope_head_dim", 8)
    if n:
        for k in LAYER_COUNT_KEYS:
            if isinstance(d.get(k), int) and not isinstance(d.get(k), bool):
                d[k] = len(chosen)
    for k in TOKEN_KEYS:
        v = d.get(k)
        if isinstance(v, int) and v >= VOCAB:
            d[k] = {"pad_token_id": 0, "bos_token_id": 1}.get(k, 2)
        elif isinstance(v, list):
            d[k] = [x if x < VOCAB else 2 for x in v]
    for k, v in list(d.items()):
        if isinstance(v, dict) and k.endswith("config") and "model_type" in v:
            d[k] = _shrink(v, v.get("model_type") or model_type)
    return d


def _fields(config) -> dict:
    """A config's fields as a dict (sub-configs as dicts carrying their model_type)."""
    import transformers

    names = [f.name for f in dataclasses.fields(config)] if dataclasses.is_dataclass(config) else list(config.to_dict())
    get = getattr(config, "_getattr_without_heterogeneous_validation", None)
    out = {}
    for name in names:
        value = get(name, None) if get is not None else getattr(config, name, None)
        out[name] = _fields(value) if isinstance(value, transformers.PreTrainedConfig) else copy.deepcopy(value)
    out["model_type"] = getattr(config, "model_type", None) or out.get("model_type")
    spec = config.__dict__.get("_heterogeneity_spec")
    if spec is not None:  # per-layer overrides of a heterogeneous config
        out["per_layer_config"] = copy.deepcopy(spec.per_layer_overrides)
    return out


def tiny_config(model_type: str, variant: bool = False, **overrides):
    """The shrunk default config of ``model_type`` (with ``variant``: its `VARIANTS` layout;
    ``overrides``: values for its decoder's config, e.g. ``num_key_value_heads=4``)."""
    config_class = _config_mapping()[model_type]
    try:
        fields = _fields(config_class())
    except Exception:  # noqa: BLE001 - a default that does not build (a drafter): from its sub-configs
        fields = {}
        for key, sub in (config_class.sub_configs or {}).items():
            if sub.__name__ != "AutoConfig":
                fields[key] = _fields(sub())
    shrunk = _shrink(fields, model_type)
    if model_type in PER_ARCH:
        PER_ARCH[model_type](shrunk)
    if variant:
        _text(shrunk).update(copy.deepcopy(VARIANTS[model_type]))
    _text(shrunk).update(overrides)
    for key in ("transformers_version", "architectures", "_name_or_path"):
        shrunk.pop(key, None)
    return config_class(**shrunk)


def build_tiny(model_type: str, variant: bool = False, **overrides):
    """The tiny causal LM of ``model_type`` (eager attention, fp32, on the CPU; see `tiny_config`)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, variant, **overrides)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def token_batch(seed: int = 0, shape=(2, 8)) -> dict:
    """Input ids (and the same as labels) inside every tiny vocabulary, away from its special tokens."""
    import torch

    ids = torch.randint(3, VOCAB - 16, shape, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}

