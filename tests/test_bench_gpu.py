"""`python -m bigdense.bench.gpu` on a machine without CUDA runs its smoke test: every case of the
GPU run on the tiny ``smoke`` model -- bigdense eager, ``blocks`` and ``model`` (aot_eager), the
Hugging Face GPT-2 twin eager and compiled -- through the same measurement (`gpu_profile.measure`),
with the CUDA-graph mode skipped and ``gpu_busy`` None. Its rows are checked for structure and
sense, never for timings. The busy fraction's arithmetic (the union of device intervals) and the
choice of the bigdense row a peer is compared with are checked on made-up numbers. The fine-tuning
case (`gpu_finetune`) runs its eager contenders on its tiny Llama: bigdense's `CausalLM` (the fused
head) takes the same first loss as transformers' own, at fp32, on the same weights and batch."""
import importlib.util
import json
import math
from types import SimpleNamespace

import pytest
import torch

import bigdense as bd
from bigdense.bench import gpu, gpu_finetune, gpu_peer, gpu_profile

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def _strict_json(line: str) -> dict:
    def refuse(constant):
        raise AssertionError(f"{constant} in a JSON row (not JSON): {line}")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, main() runs the whole GPU benchmark")
def test_cpu_smoke_writes_a_row_per_case(tmp_path, capsys):
    path = tmp_path / "gpu.jsonl"
    assert gpu.main(["--json", str(path)]) == 0
    rows = [_strict_json(line) for line in path.read_text().splitlines()]
    finetune = [r for r in rows if r["case"] == "finetune"]  # after the GPT cases (the next test checks them)
    assert [(r["contender"], r["mode"]) for r in finetune] == list(gpu_finetune.CONTENDERS), finetune
    assert all(r["smoke"] and r["model"] == "smoke" for r in finetune), finetune
    compiled = next(r for r in finetune if r["mode"] == "model")
    if HAS_TRANSFORMERS:  # the whole CausalLM, its fused head included: one graph each way
        assert (compiled["graphs_forward"], compiled["graphs_backward"], compiled["graph_breaks"]) == (1, 1, 0), \
            compiled
    rows = [r for r in rows if r["case"] != "finetune"]
    by_case = {(r["case"], r["mode"]): r for r in rows}
    assert all(r["smoke"] and r["model"] == "smoke" and r["tp"] == 1 for r in rows), rows
    assert set(by_case) == set(gpu.CASE_ORDER), sorted(by_case)

    assert by_case["gpt", "model+cuda_graphs"]["error"].startswith("skipped: CUDA graphs"), by_case
    measured = [r for r in rows if "error" not in r]
    for row in measured:
        assert math.isfinite(row["loss"]) and row["loss"] > 0, row
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["precision"] == "fp32", row
        assert row["gpu_busy"] is None and row["gpu_kernel_ms"] is None, row  # no device kernels on a CPU
        assert row["peak_mem_gb"] is None and row["mfu"] is None, row
        assert row["compiled"] == (row["mode"] != "eager"), row

    eager, model = by_case["gpt", "eager"], by_case["gpt", "model"]
    assert "error" not in eager and "graphs_forward" not in eager and eager["warmup"] == 1, eager
    # The whole model: one graph each way, no break, nothing compiled after the warm-up.
    assert (model["graphs_forward"], model["graphs_backward"], model["graph_breaks"], model["recompiled_later"]) \
        == (1, 1, 0, 0), model
    assert model["warmup"] == 2, model
    blocks = by_case["gpt", "blocks"]
    assert blocks["graphs_forward"] >= 1 and blocks["graphs_backward"] >= 1, blocks
    assert (blocks["graph_breaks"], blocks["recompiled_later"]) == (0, 0), blocks

    out = capsys.readouterr().out
    assert "no CUDA device here" in out and "bigdense model+cuda_graphs" in out, out
    if not HAS_TRANSFORMERS:
        assert all(by_case["gpt_peer", mode]["error"].startswith("skipped: transformers") for mode in gpu.PEER_MODES)
        return
    peer_eager, peer_compiled = by_case["gpt_peer", "eager"], by_case["gpt_peer", "compiled"]
    for peer in (peer_eager, peer_compiled):
        assert "error" not in peer and peer["peer"] == "hf_gpt2", peer
        assert peer["params"] == eager["params"], (peer, eager)  # the twin: the same parameters, tied once
        assert peer["ratio_vs_bigdense"] > 0, peer
    assert peer_eager["vs_mode"] == "eager" and peer_eager["compiled"] is False, peer_eager
    assert peer_compiled["vs_mode"] in ("blocks", "model"), peer_compiled
    # torch.compile takes the Hugging Face model whole: one graph each way.
    assert (peer_compiled["graphs_forward"], peer_compiled["graphs_backward"], peer_compiled["graph_breaks"]) \
        == (1, 1, 0), peer_compiled
    assert "hf_gpt2 eager / bigdense eager" in out, out


def test_the_busy_time_counts_overlapping_device_work_once():
    assert gpu_profile.union_length([]) == 0
    assert gpu_profile.union_length([(20, 25), (0, 10), (5, 15)]) == 20  # 0..15 and 20..25
    assert gpu_profile.union_length([(0, 100), (10, 20), (30, 40)]) == 100  # nested on another stream
    assert gpu_profile.union_length([(0, 10), (10, 20)]) == 20  # back to back


def test_only_device_work_counts_as_busy():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(device, activity, start, end):
        return SimpleNamespace(device_type=lambda: device, activity_type=lambda: activity,
                               start_ns=lambda: start, end_ns=lambda: end)

    events = [event(cuda, "kernel", 0, 10), event(cuda, "gpu_memcpy", 20, 30), event(cuda, "gpu_memset", 40, 45),
              event(cuda, "gpu_user_annotation", 0, 100),  # a region on the GPU's timeline, idle gaps included
              event(cpu, "cpu_op", 0, 100), event(cpu, "cuda_runtime", 50, 60)]
    assert gpu_profile.device_intervals(events) == [(0, 10), (20, 30), (40, 45)]


def test_busy_fraction_is_none_without_device_activity():
    steps = []
    busy = gpu_profile.busy_fraction(lambda: steps.append(1) or torch.zeros(()), 2, torch.device("cpu"))
    assert busy == dict(gpu_busy=None, gpu_kernel_ms=None) and len(steps) == 2


def test_the_peer_is_compared_with_bigdense_eager_and_its_fastest_compiled_mode():
    def ours(mode, ms, tp=1, **extra):
        return dict(case="gpt", model="gpt_small", tp=tp, mode=mode, step_ms=ms, **extra)

    def peer(mode, ms):
        return dict(case="gpt_peer", model="gpt_small", tp=1, mode=mode, compiled=mode == "compiled", step_ms=ms)

    rows = [ours("eager", 100.0), ours("blocks", 80.0), ours("model", 60.0), ours("model+cuda_graphs", 50.0, tp=2),
            ours("model+cuda_graphs", 40.0, error="boom"), peer("eager", 150.0), peer("compiled", 90.0),
            dict(case="gpt_peer", model="gpt_1b", tp=1, mode="eager", compiled=False, step_ms=1.0)]
    gpu_peer.add_ratios(rows)
    assert (rows[5]["ratio_vs_bigdense"], rows[5]["vs_mode"]) == (1.5, "eager")
    assert (rows[6]["ratio_vs_bigdense"], rows[6]["vs_mode"]) == (1.5, "model")  # failed and tp=2 rows left out
    assert "ratio_vs_bigdense" not in rows[7]  # no bigdense gpt_1b row to compare with


def test_warm_up_leaves_compilation_and_the_cuda_graph_recording_out_of_the_timed_steps():
    from bigdense.train.cuda_graphs import WARMUP_STEPS

    assert gpu._warmup_steps("eager", 1) == 1
    assert gpu._warmup_steps("model", 1) == gpu._warmup_steps("compiled", 1) == 2
    assert gpu._warmup_steps("model+cuda_graphs", 1) == WARMUP_STEPS + 1  # eager steps, then the recording
    assert gpu._warmup_steps("blocks", 5) == 5


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_the_twin_config_has_the_bigdense_case_shape():
    spec = gpu.MODELS["gpt_small"]
    config = gpu_peer.twin_config(spec, dropout=0.1, attention_dropout=0.0)
    assert (config.n_embd, config.n_layer, config.n_head, config.vocab_size, config.n_positions) == (768, 12, 12, 50304,
                                                                                                      1024)
    assert (config.resid_pdrop, config.embd_pdrop, config.attn_pdrop) == (0.1, 0.1, 0.0)
    assert config.tie_word_embeddings and config._attn_implementation == "sdpa" and not config.use_cache
    assert config.activation_function == "gelu" and config.n_inner is None  # exact GELU, 4 x d hidden


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_the_finetune_case_trains_the_same_llama_and_bigdense_starts_from_transformers_loss(capsys):
    # The CPU smoke of the fine-tuning case, less its compiled mode (the slow test above runs it):
    # every contender a row with its fields, the peers skipped, saying why.
    sched = gpu.Schedule(steps=1, warmup=1, busy_steps=0, backend="aot_eager")
    eager = [c for c in gpu_finetune.CONTENDERS if c[1] == "eager"]
    rows = gpu_finetune.run(bd.init_parallel(tp=1), "smoke", torch.device("cpu"), sched, precision="fp32",
                            warmup_steps=gpu._warmup_steps, release=gpu._release, contenders=eager)
    assert [(r["contender"], r["mode"]) for r in rows] == eager, rows
    by_name = {r["contender"]: r for r in rows}
    ours, theirs = by_name["bigdense"], by_name["transformers"]
    for row in (ours, theirs):
        assert "error" not in row, row
        assert (row["case"], row["model"], row["precision"], row["compiled"]) == ("finetune", "smoke", "fp32", False)
        assert row["params"] == ours["params"] and row["step_ms"] > 0 and row["tokens_per_s"] > 0, row
        assert row["peak_mem_gb"] is None and row["gpu_busy"] is None and row["mfu"] is None, row  # a CPU
        assert math.isfinite(row["loss"]) and row["loss"] != row["first_loss"], row  # one step trained it
    assert ours["loss_path"] == "fused (logit transform: none)", ours
    # The same weights and batch, fp32: the fused head's loss is transformers' own (F.cross_entropy
    # on the logits, its shift of labels=x), before either trained.
    assert ours["first_loss"] == pytest.approx(theirs["first_loss"], rel=1e-5), (ours, theirs)
    assert theirs["ratio_vs_bigdense"] > 0 and theirs["peak_ratio_vs_bigdense"] is None, theirs
    for name in gpu_finetune.PEERS:
        assert by_name[name]["error"].startswith("skipped: "), by_name[name]  # a CPU: their kernels need CUDA

    gpu_finetune.print_table(rows)
    out = capsys.readouterr().out
    assert "bigdense eager" in out and "transformers eager       time" in out, out


def test_a_patch_of_the_llama_module_is_undone_after_its_contender():
    module = pytest.importorskip("transformers.models.llama.modeling_llama")
    rope, norm = module.apply_rotary_pos_emb, module.LlamaRMSNorm
    with gpu_finetune._module_restored(module.__name__):
        module.apply_rotary_pos_emb, module.LlamaRMSNorm = print, object  # as Liger's patch swaps them
        module.added_by_a_patch = 1
    assert (module.apply_rotary_pos_emb, module.LlamaRMSNorm) == (rope, norm)
    assert not hasattr(module, "added_by_a_patch")
