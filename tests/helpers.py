"""What the tests share: comparison helpers, paths, shard-spec collection, the independent plain-PyTorch
references (a classifier head on full logits with InsightFace's margins, a GPT on full weights), and
the small models several test files train (`TinyNet`; `TinyLM` with its data and reference states for
the checkpoint tests and `scripts/crash_train.py`). Test files import from here, never from each other."""
import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import bigdense as bd
from bigdense.parallel import comm

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # torchrun, deepspeed, accelerate of the running environment
TRAIN = str(ROOT / "launch" / "train.py")


def assert_close(actual, expected, what, *, rtol, atol):
    """torch.testing.assert_close with the name of the quantity in the message."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def clone_leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


def shard_specs(module) -> dict:
    """``{parameter path: ShardSpec}`` of every bigdense layer in ``module``, from the layers' reports."""
    specs = {}
    for prefix, sub in module.named_modules():
        if hasattr(sub, "bd_shard_specs"):
            for name, spec in sub.bd_shard_specs().items():
                specs[f"{prefix}.{name}" if prefix else name] = spec
    return specs


# ---- independent references, written with plain torch ops on full tensors ----
def insightface_logits(h, w, target, s, m1, m2, m3):
    """InsightFace's CombinedMarginLoss / ArcFace, on full logits: cos, the target's margin (with
    ArcFace's ``theta > pi - m`` fallback ``cos - sin(pi - m) * m``), times s."""
    cos = F.normalize(h) @ F.normalize(w).t()
    rows = torch.arange(h.shape[0])
    valid = target != -100
    t = cos[rows[valid], target[valid]]
    if m1 == 1.0 and m3 == 0.0:  # ArcFace, as losses.ArcFace computes it
        sin = torch.sqrt((1.0 - t * t).clamp_min(1e-12))
        cos_m = t * math.cos(m2) - sin * math.sin(m2)
        final = torch.where(t > math.cos(math.pi - m2), cos_m, t - math.sin(math.pi - m2) * m2)
    elif m1 == 1.0 and m2 == 0.0:  # CosFace
        final = t - m3
    else:  # the combined form (InsightFace's MXNet one), with ArcFace's fallback past m1 * theta + m2 = pi
        combined = torch.cos(m1 * torch.acos(t) + m2) - m3
        final = torch.where(m1 * torch.acos(t) + m2 < math.pi, combined, t - m3 - math.sin(math.pi - m2) * m2)
    cos = cos.index_put((rows[valid], target[valid]), final)
    return cos * s


def head_reference(w, h, target, *, margin=None, classes=None, eps=0.0, bias=None, reduction="mean", weights=None,
                   scale=64.0):
    """Loss and grads (h, w, b) of F.cross_entropy on full logits, optionally restricted to ``classes``
    (the softmax over those classes only, targets renumbered). ``margin``: (m1, m2, m3), InsightFace's
    logits at ``scale``. ``reduction="none"`` backpropagates ``weights`` (one per token) into the losses.
    A mean over no counted token is 0 with zero gradients (bigdense's rule; F.cross_entropy gives nan)."""
    w, h = w.clone().requires_grad_(), h.clone().requires_grad_()
    b = None if bias is None else bias.clone().requires_grad_()
    if margin is None:
        z = F.linear(h, w, b)
    else:
        z = insightface_logits(h, w, target, scale, *margin)
    t = target
    if classes is not None:  # the softmax over the given classes only, targets renumbered
        z = z[:, classes]
        remap = torch.full((w.shape[0],), -100, dtype=torch.long)
        remap[classes] = torch.arange(len(classes))
        t = torch.where(target >= 0, remap[target.clamp(min=0)], -100)
    if not bool((t != -100).any()):  # nothing counted (with sampling, maybe no class scored at all)
        loss = z.sum(-1) * 0.0 if reduction == "none" else z.sum() * 0.0
    else:
        loss = F.cross_entropy(z, t, label_smoothing=eps, reduction=reduction)
    (loss if reduction != "none" else (loss * weights).sum()).backward()
    return loss.detach(), h.grad, w.grad, None if b is None else b.grad



def full_params(model, tp_group) -> dict:
    """``{name: full tensor}`` of ``model``'s parameters (each once; tied ones under their first name),
    gathered from the TP shards (a world-sharded head's from every rank) with plain collectives, as
    fresh leaves that require grad."""
    specs = shard_specs(model)
    out = {}
    for name, p in model.named_parameters():
        full = p.detach()
        if name in specs:
            group = torch.distributed.group.WORLD if specs[name].group == "world" else tp_group
            full = comm.all_gather_dim(full.contiguous(), specs[name].dim, group, specs[name].sizes)
        out[name] = full.clone().requires_grad_()
    return out


def plain_gpt_loss(p: dict, cfg, idx, targets, *, dropout: float = 0.0, eps: float = 1e-5):
    """The reference GPT's mean loss written with plain torch ops on full weights ``p`` (`full_params`):
    `plain_gpt_hidden`, then F.cross_entropy over full logits (-100 ignored). A batch with no counted
    token has loss 0 (bigdense's rule)."""
    x = plain_gpt_hidden(p, cfg, idx, dropout=dropout, eps=eps)
    logits = x @ p["head.weight" if "head.weight" in p else "tok_emb.weight"].T
    if not bool((targets != -100).any()):  # nothing counted: 0 (F.cross_entropy would give nan)
        return logits.sum() * 0.0
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), targets.reshape(-1))


def plain_gpt_hidden(p: dict, cfg, idx, *, dropout: float = 0.0, eps: float = 1e-5):
    """The GPT trunk's final normalised hidden states (B, S, d) in plain torch ops on full weights:
    explicit causal softmax attention (the fused projection laid out [q, k, v] head by head, as `GPT`
    documents) and the MLP's formula. Shares no code with the model's forward but the dropout masks:
    ``bd.tp_dropout`` on the whole, unsharded activation is what the masks are defined as, drawn in
    the model's order (embeddings; per block, attention output then MLP output)."""
    (b, s), d, n_heads = idx.shape, cfg.d_model, cfg.n_heads
    hd = d // n_heads

    def ln(x, name):
        return F.layer_norm(x, (d,), p[f"{name}.weight"], p.get(f"{name}.bias"), eps)

    def linear(x, name):
        return F.linear(x, p[f"{name}.weight"], p.get(f"{name}.bias"))

    def drop(x):
        return bd.tp_dropout(x, dropout) if dropout else x

    x = drop(F.embedding(idx, p["tok_emb.weight"]) + p["pos_emb.weight"][:s])
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(cfg.n_layers):
        blk = f"blocks.{i}"
        q, k, v = linear(ln(x, f"{blk}.ln1"), f"{blk}.attn.qkv").view(b, s, n_heads, 3, hd).unbind(3)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        x = x + drop(linear(torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d), f"{blk}.attn.out"))
        h = ln(x, f"{blk}.ln2")
        up = linear(h, f"{blk}.mlp.up")
        hidden = F.silu(linear(h, f"{blk}.mlp.gate")) * up if cfg.activation == "swiglu" else F.gelu(up)
        x = x + drop(linear(hidden, f"{blk}.mlp.down"))
    return ln(x, "ln_f")


# ---- TinyNet: a stack of transformer-shaped blocks built only from foundation layers: ``attn``
# (column -> GELU -> dropout on the *sharded* hidden units -> row) and ``mlp`` (column -> GELU ->
# row -> dropout on the *replicated* output), each behind a LayerNorm with a residual; the loss is
# the MSE against a target. Used by the recompute, precision and engine tests.

class Mixer(nn.Module):
    """Attention stand-in: dropout inside the TP region, on this rank's slice of the hidden units."""

    def __init__(self, d, h, p):
        super().__init__()
        self.up, self.down, self.p, self.h = bd.ColumnParallelLinear(d, h), bd.RowParallelLinear(h, d), p, h

    def forward(self, x):
        a = F.gelu(self.up(x))
        a = bd.tp_dropout(a, self.p, self.training, shard_dim=-1, global_size=self.h, offset=self.up.partition_start)
        return self.down(a)


class MLP(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.up, self.down, self.p = bd.ColumnParallelLinear(d, h), bd.RowParallelLinear(h, d), p

    def forward(self, x):
        return bd.tp_dropout(self.down(F.gelu(self.up(x))), self.p, self.training)


class Block(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Mixer(d, h, p)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d, h, p)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyNet(nn.Module):
    def __init__(self, d=16, h=24, n_blocks=4, p=0.2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h, p) for _ in range(n_blocks))

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x, y)


# ---- TinyLM: a tiny tensor-parallel language model, its data and its reference states, for the
# checkpoint tests.
#
# Every sharded dimension is uneven at tp = 2, 3 and 4 (vocabulary 11, hidden 10 at tp 3/4), the
# embedding and the head are tied, the MLP is SwiGLU (gate/up/down) with dropout, and a LayerNorm
# is replicated: each kind of tensor a checkpoint must place.
#
# `full_states` gathers global tensors with plain collectives (not with the checkpoint code), so the
# tests compare the checkpoint against an independent reference.

VOCAB, D_MODEL, D_HIDDEN = 11, 6, 10


class TinyLM(nn.Module):
    def __init__(self, dropout: float = 0.1):
        super().__init__()
        self.emb = bd.VocabParallelEmbedding(VOCAB, D_MODEL)
        self.mlp = bd.ParallelMLP(D_MODEL, D_HIDDEN, "swiglu", dropout=dropout)
        self.norm = nn.LayerNorm(D_MODEL)
        self.head = bd.ParallelClassifierHead(D_MODEL, VOCAB)
        bd.tie_weights(self.emb, self.head)

    def forward(self, ids, target):
        h = self.emb(ids)
        h = h + self.mlp(h)
        return self.head.loss(self.norm(h), target)


def batch(pos: int, n: int = 8):
    """The batch at data position ``pos``: the same on every rank, a function of ``pos`` only."""
    g = torch.Generator().manual_seed(1000 + pos)
    ids = torch.randint(0, VOCAB, (n,), generator=g)
    return ids, (ids * 3 + 1) % VOCAB


def make_optimizer(model, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return opt, sched


def train_steps(model, opt, sched, start: int, stop: int, scaler=None) -> list[float]:
    """Steps ``start..stop-1`` (data position = step); returns the losses."""
    losses = []
    for step in range(start, stop):
        loss = model(*batch(step))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def local_states(model, opt=None) -> dict[str, torch.Tensor]:
    """This rank's tensors: ``model/<name>`` and ``optim/<param name>/<key>``."""
    out = {f"model/{n}": t.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}
    if opt is not None:
        for name, p in model.named_parameters():
            for key, value in opt.state.get(p, {}).items():
                out[f"optim/{name}/{key}"] = value.detach().clone()
    return out


def full_states(model, opt=None, tp_group=None) -> dict[str, torch.Tensor]:
    """Global tensors assembled from every TP rank's shard (collective over TP)."""
    specs = shard_specs(model)
    out = {}
    for key, value in local_states(model, opt).items():
        name = key.split("/")[1]
        spec = specs.get(name)
        if spec is not None and value.dim() > 0:
            value = comm.all_gather_dim(value, spec.dim, tp_group, spec.sizes)
        out[key] = value
    return out


def assert_matches_reference(model, opt, reference: dict[str, torch.Tensor], what: str) -> int:
    """Every local tensor is bit-identical to its slice of the reference; returns how many were compared."""
    specs = shard_specs(model)
    local = local_states(model, opt)
    missing = sorted(set(reference) - set(local))
    assert not missing, f"{what}: not restored: {missing}"
    for key, value in local.items():
        full = reference[key]
        spec = specs.get(key.split("/")[1])
        expected = spec.slice_of(full) if spec is not None and value.dim() > 0 else full
        assert value.dtype == expected.dtype and torch.equal(value, expected), f"{what}: {key} differs"
    return len(local)


def compile_for_sm90_in_a_fresh_process(module: str, expected: int) -> None:
    """Run ``bigdense.kernels.<module>.compile_for_cuda(90)`` with the interpreter off, in a fresh
    process (where the kernels are defined for the compiler, not the lenient interpreter), and
    check that it compiled ``expected`` variants, each to a non-empty cubin."""
    import os
    import subprocess

    code = (f"from bigdense.kernels.{module} import compile_for_cuda\n"
            "sizes = compile_for_cuda(90)\n"
            f"assert len(sizes) == {expected} and all(sizes.values()), sizes\n"
            "print('compiled', len(sizes))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and f"compiled {expected}" in done.stdout, done.stderr[-3000:]


def uneven_llama(seed: int = 0):
    """A tiny transformers Llama whose sizes split unevenly over 2 and 3 ranks (hidden 36, 6 heads over
    3 key/value heads, MLP 44, vocabulary 61), in eval mode, its weights drawn after
    ``torch.manual_seed(seed)``: the low-rank adapter tests' model."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=61, hidden_size=36, intermediate_size=44, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()
