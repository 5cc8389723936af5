"""Low-rank adapters (`bd.add_lora`) against PEFT's LoRA on the plain transformers model, and at every
TP size against each other.

The reference is PEFT itself: ``peft.get_peft_model`` on the unconverted model, trained by torch's
AdamW in this process; bigdense's side is the model converted by its own plan at tp 1, 2 and 3
(uneven: hidden 36, 6 heads over 3 key/value heads, MLP width 44), started from the adapter PEFT
saved (`bd.load_peft_adapter`) and trained by bigdense's engine. Nothing of bigdense's adapter code
is in the reference.

Tolerances, fp32: TP changes the order of the sums (row layers' partial products and the adapters'
(tokens, r) partial products all-reduced), ~1e-7 relative per op; AdamW divides by sqrt(v), so an
update is ~lr whatever the gradient's size, and a last-bit change in a tiny gradient moves that
weight by ~1e-7 of lr. Over 3 steps at lr 1e-3 the observed differences stay below 1e-6; 1e-5 (the
issue's bound) catches any wrong slice or a missing all-reduce (which move the loss by 1e-3 or
more). The frozen base must not move at all: compared bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F

import bigdense as bd
from bigdense.config import EngineConfig, OptimConfig, PrecisionConfig
from bigdense.layers.base import named_shard_specs
from bigdense.layers.lora import adapted_layers, lora_settings
from bigdense.models import CausalLM
from bigdense.testing import run_ranks
from helpers import uneven_llama

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS, LR, TOL = 3, 1e-3, 1e-5
OPTIM = OptimConfig(lr=LR, min_lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup_steps=0,
                    schedule="constant", grad_clip=0.0)


def batches():
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, 61, (2, 13), generator=g) for _ in range(STEPS)]
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in ids]


@pytest.fixture(scope="module")
def peft_run(tmp_path_factory):
    """A PEFT adapter on every projection (B made non-zero, so the adapter acts from the first step),
    saved by PEFT; then PEFT's own 3 AdamW steps: losses and the trained adapter, by bigdense's names."""
    directory = tmp_path_factory.mktemp("adapter")
    model = peft.get_peft_model(uneven_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=PROJECTIONS))
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.save_pretrained(directory)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=(0.9, 0.999),
                                  eps=1e-8, weight_decay=0.0)
    losses = []
    for x, y in batches():
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    trained = {n.replace("base_model.model.", "").replace(".default", ""): p.detach().clone()
               for n, p in model.named_parameters() if "lora_" in n}
    return directory, losses, trained


def _train_from_adapter(directory):
    """On each rank: the converted model, PEFT's adapter loaded, 3 steps of bigdense's DDP engine."""
    ctx = bd.get_default_context()
    model = CausalLM(bd.parallelize(uneven_llama()) if ctx.tp_size > 1 else uneven_llama())
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    bd.load_peft_adapter(model, directory)
    model.prepare_loss()
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind="ddp"), optim_cfg=OPTIM,
                             precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=2, max_steps=STEPS)
    losses = [engine.train_step([batch]).loss for batch in batches()]
    specs = named_shard_specs(model)
    moved = [n for n, p in model.named_parameters() if n in base and not torch.equal(p, base[n])]
    adapters = {n.removeprefix("lm."): (p.detach().clone(), specs.get(n)) for n, p in model.named_parameters()
                if p.requires_grad}
    return losses, adapters, moved


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_adapters_train_as_peft_does_at_every_tp_size(peft_run, tp):
    directory, want_losses, want = peft_run
    for losses, adapters, moved in run_ranks(_train_from_adapter, tp, str(directory), timeout=240):
        assert moved == [], f"frozen base weights changed: {moved[:4]}"
        assert set(adapters) == set(want)
        assert losses == pytest.approx(want_losses, rel=TOL, abs=0)
        for name, (local, spec) in adapters.items():
            expected = want[name] if spec is None else spec.slice_of(want[name])
            torch.testing.assert_close(local, expected, rtol=TOL, atol=TOL * 1e-2, msg=name)


# ---- the reference GPT: the same adapters at every TP size (the layers' promise) ----
def _gpt(sequence_parallel: bool):
    cfg = bd.models.GPTConfig(vocab_size=50, d_model=36, n_layers=2, n_heads=6, d_hidden=44, activation="swiglu",
                              max_seq_len=16, dropout=0.1, sequence_parallel=sequence_parallel)
    torch.manual_seed(0)
    model = bd.models.GPT(cfg)
    bd.add_lora(model, r=3, alpha=6, dropout=0.2)
    with torch.no_grad():  # B non-zero, alike at every TP size: its slice of one global tensor
        g = torch.Generator().manual_seed(11)
        for layer in adapted_layers(model).values():
            full = torch.randn(layer.lora_B.global_shape, generator=g) * 0.1
            spec = layer.lora_B.shard_spec("weight")
            layer.lora_B.weight.copy_(full if spec is None else spec.slice_of(full))
    return model


def _gpt_adapter_gradients(sequence_parallel):
    """On each rank: one training forward/backward with dropout on (the model's and the adapters');
    the loss, and every adapter's full factor and gradient (gathered)."""
    model = _gpt(sequence_parallel)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 50, (3, 14), generator=g), torch.randint(0, 50, (3, 14), generator=g)
    torch.manual_seed(1)  # dropout keys
    loss = model(x, y)
    loss.backward()
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)
    specs, out = named_shard_specs(model), {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            spec = specs.get(name)
            group = model.get_submodule(name.rpartition(".")[0]).tp_group
            full = (lambda t: t.clone()) if spec is None else (lambda t: bd.layers.base.gather_shards(t, spec, group))
            out[name] = (full(p.detach()), full(p.grad))
    return loss.item(), out


@pytest.mark.parametrize("tp,sequence_parallel", [(2, False), (3, True)])
def test_gpt_adapters_are_the_same_at_every_tp_size(tp, sequence_parallel):
    """Initialisation (A's law drawn from the global shape), output and gradients with layout-free
    dropout in the model and the adapters, packed SwiGLU projections, fused qkv, uneven shards and
    sequence parallelism: tp=2 and tp=3 equal tp=1 (sums in another order: 1e-5)."""
    (want_loss, want), = run_ranks(_gpt_adapter_gradients, 1, False, timeout=120)
    for loss, got in run_ranks(_gpt_adapter_gradients, tp, sequence_parallel, timeout=180):
        assert loss == pytest.approx(want_loss, rel=TOL)
        assert set(got) == set(want)
        for name, (weight, grad) in got.items():
            assert torch.equal(weight, want[name][0]), name  # initialisation: bit-identical
            torch.testing.assert_close(grad, want[name][1], rtol=TOL, atol=TOL * 1e-2, msg=name)


def test_initialisation_is_peft_rule():
    """A ~ kaiming_uniform_(a=sqrt(5)) = U(+-1/sqrt(in)) (PEFT's), B = 0, scale alpha/r or alpha/sqrt(r)."""
    model = bd.add_lora(torch.nn.Sequential(torch.nn.Linear(400, 300), torch.nn.ReLU(), torch.nn.Linear(300, 20)),
                        r=64, alpha=16, rslora=True)
    first = model[0]
    bound = 1 / 400 ** 0.5
    a = first.lora_A.weight
    assert a.shape == (64, 400) and a.abs().max() <= bound and a.std().item() == pytest.approx(bound / 3 ** 0.5, rel=0.02)
    assert torch.count_nonzero(first.lora_B.weight) == 0 and first.lora_B.weight.shape == (300, 64)
    assert lora_settings(first).scaling == 16 / 8
    assert [n for n, p in model.named_parameters() if p.requires_grad] == [
        "0.lora_A.weight", "0.lora_B.weight", "2.lora_A.weight", "2.lora_B.weight"]


def test_plain_layers_equal_their_formula():
    """An unconverted nn.Linear: its output plus scale * B A x (no dropout in eval)."""
    layer = torch.nn.Linear(8, 5)
    model = bd.add_lora(torch.nn.Sequential(layer), r=2, alpha=3, dropout=0.5).eval()
    with torch.no_grad():
        layer.lora_B.weight.normal_()
    x = torch.randn(4, 8)
    want = F.linear(x, layer.weight, layer.bias) + 1.5 * x @ layer.lora_A.weight.T @ layer.lora_B.weight.T
    torch.testing.assert_close(model(x), want)


@pytest.mark.parametrize("targets,error", [
    (["nope"], r"targets \['nope'\] match no module"),
    (["0"], r"not linear layers: \['0 \(Embedding\)'\]"),
    ([], "targets is empty"),
])
def test_bad_targets_are_named(targets, error):
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match=error):
        bd.add_lora(model, r=2, targets=targets)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="r must be a positive integer, got 0"):
        bd.add_lora(torch.nn.Linear(3, 3), r=0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\), got 1.0"):
        bd.add_lora(torch.nn.Sequential(torch.nn.Linear(3, 3)), r=1, dropout=1.0)


# ---- the engines: the optimizer and the gradients hold the adapters alone ----
def _torch_optimizer(optimizer):
    """The torch optimizer holding the state (DeepSpeed's ZeRO wrapper keeps one inside)."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _state_and_gradient_bytes(kind, tp):
    """On each rank: one step of the engine ``kind`` on the adapted GPT; the optimizer's moment bytes,
    the frozen parameters holding a gradient, and the adapters' own bytes on this rank."""
    ctx = bd.init_parallel(tp=tp)
    model = _gpt(False)
    engine = bd.build_engine(model, ctx, engine_cfg=EngineConfig(kind=kind), optim_cfg=OPTIM,
                             precision_cfg=PrecisionConfig(dtype="fp32"), micro_batch_size=2, max_steps=2)
    g = torch.Generator().manual_seed(5)
    engine.train_step([(torch.randint(0, 50, (2, 14), generator=g), torch.randint(0, 50, (2, 14), generator=g))])
    moments = [t for s in _torch_optimizer(engine.optimizer).state.values() for k, t in s.items()
               if k in ("exp_avg", "exp_avg_sq")]
    frozen_grads = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    adapters = sum(_local(p).numel() * 4 for p in model.parameters() if p.requires_grad)
    return sum(_local(t).numel() * 4 for t in moments), frozen_grads, adapters, ctx.dp_size


@pytest.mark.parametrize("kind,tp", [("ddp", 2), ("fsdp", 1), ("deepspeed", 1)])
def test_optimizer_and_gradients_hold_the_adapters_only(kind, tp):
    """Counted bytes: AdamW's two moments of the adapters (DDP, FSDP's shards of them; ZeRO-1's
    partition of them, padded to its alignment), and no gradient on a frozen parameter."""
    results = run_ranks(_state_and_gradient_bytes, 2, kind, tp, timeout=240)
    for moments, frozen_grads, adapters, dp in results:
        assert frozen_grads == []
        if kind == "deepspeed":  # each DP rank its partition of the flat adapters, padded to ZeRO's alignment
            assert 2 * adapters / dp <= moments <= 2 * (adapters / dp + 4 * 512)
        else:  # DDP: the rank's adapter slices; FSDP: its shards of them
            assert moments == 2 * adapters


# ---- a packed [gate; up] weight converted in place by a plan, against PEFT on the plain module ----
class PackedMLP(torch.nn.Module):
    """``down(silu(gate) * up)`` with gate and up in one fused ``gate_up`` weight, [gate; up]."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gate_up, self.down = torch.nn.Linear(12, 2 * 10), torch.nn.Linear(10, 12)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


PACKED_PLAN = {"gate_up": ("column", {"packed": 2}), "down": "row"}


def _packed_adapter_outputs(adapter_dir):
    """On each rank: the plan's in-place packed column (each block split on its own; 10 hidden units
    uneven over 3) and its row partner, PEFT's adapter loaded; the output and every factor's full
    gradient."""
    model = bd.parallelize(PackedMLP(), PACKED_PLAN)
    bd.load_peft_adapter(model, adapter_dir)
    assert model.gate_up.bd_style.packed == 2 and model.gate_up.lora_B.shard_spec("weight").parts == 2
    x = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(2))
    y = model(x)
    y.square().sum().backward()
    specs, grads = named_shard_specs(model), {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            layer = model.get_submodule(name.rpartition(".")[0])
            spec = specs.get(name)
            grads[name] = p.grad if spec is None else bd.layers.base.gather_shards(p.grad, spec, layer.tp_group)
    return y.detach(), grads


@pytest.mark.parametrize("tp", [2, 3])
def test_packed_layer_converted_in_place_takes_peft_adapter(tmp_path, tp):
    """B of the packed column is split block by block like its weight: output and gradients equal PEFT's
    on the plain module (sums in another order: 1e-5)."""
    reference = peft.get_peft_model(PackedMLP(), peft.LoraConfig(r=3, lora_alpha=6, target_modules=["gate_up", "down"]))
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for name, p in reference.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    reference.save_pretrained(tmp_path)
    x = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(2))
    want = reference(x)
    want.square().sum().backward()
    want_grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad
                  for n, p in reference.named_parameters() if p.requires_grad}
    for y, grads in run_ranks(_packed_adapter_outputs, tp, str(tmp_path), timeout=120):
        torch.testing.assert_close(y, want.detach(), rtol=TOL, atol=TOL)
        assert set(grads) == set(want_grads)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, want_grads[name], rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")
