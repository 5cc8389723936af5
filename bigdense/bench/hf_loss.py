"""Memory of a Hugging Face model's loss: the gathered logits against bigdense's fused head.

    python -m bigdense.bench.hf_loss                   # Llama-shaped, 128,256 entries, d=64, 4 x 1024 tokens
    python -m bigdense.bench.hf_loss --quick           # a small smoke run (seconds)
    python -m bigdense.bench.hf_loss --json out.jsonl  # also append the rows as JSON lines

A Llama-shaped model (transformers' ``LlamaConfig``, random weights from the config, nothing
downloaded: d=64, one decoder layer, 4 query and 2 key/value heads, an untied head), at tp=1, fp32
on CPU. Measured: the peak of live tensor bytes (`bigdense.plan.measure.LiveTensorBytes`, the
parameters tracked from the start, no gradient before) over one loss and its backward, of

* ``gathered`` -- ``CausalLM(lm, fused_loss=False)``: the logits, ``.float()`` and
  ``F.cross_entropy`` (what `CausalLM` computed before it had the fused head): the baseline;
* ``fused`` -- ``CausalLM(lm)``: the loss through bigdense's fused vocab-parallel cross-entropy
  from the hidden states the model gives its head (`bigdense.models.hf_loss`);
* ``own head`` -- the same decoder's last hidden states (``lm.model``) into
  `bd.ParallelClassifierHead`'s ``loss``, on the same weight (the head's parameter itself): what
  bigdense's own models pay, the floor the fused path is held to (at most 1.5x).

Printed: each peak, fused / own head, gathered / fused, and beside the two `CausalLM` measurements
the planner's prediction (`bigdense.plan.estimate` of the same model, less AdamW's moments: the
benchmark runs no optimizer) and its error. Then a vocabulary sweep of the fused path (32k to 256k
entries): the peak's growth over the smallest vocabulary beside the growth of what is
vocabulary-sized at the peak (inside the loss's forward: the embedding and the head's weight, the
head weight's gradient) and the loss's chunk buffer (the loop's logits of one chunk, within
`ce_chunks.AUTO_CHUNK_BYTES`), and what else grew. Live tensor
bytes are deterministic (no timing).
"""
from __future__ import annotations

import argparse

import torch

from . import SEED, append_json_lines

FULL = dict(vocab=128_256, d=64, layers=1, batch=4, seq=1024, sweep=(32_768, 65_536, 128_256, 262_144))
QUICK = dict(vocab=4_096, d=64, layers=1, batch=2, seq=128, sweep=(2_048, 4_096, 8_192))


def build_llama(vocab: int, d: int, layers: int, seq: int):
    """A Llama-shaped causal LM of random weights (transformers' own init, a fixed seed), in train mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=(8 * d // 3 + 15) // 16 * 16,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=seq, tie_word_embeddings=False)
    return LlamaForCausalLM(config).train()


def batch(vocab: int, b: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets (the last of each row ignored)."""
    g = torch.Generator().manual_seed(SEED + 1)
    x = torch.randint(0, vocab, (b, s), generator=g)
    y = torch.cat([x[:, 1:], torch.full((b, 1), -100)], dim=1)
    return x, y


def peak_bytes(loss_fn, params) -> int:
    """Peak live tensor bytes of ``loss_fn().backward()``, ``params`` counted from the start (their
    gradients cleared before)."""
    from ..plan.measure import LiveTensorBytes

    for p in params:
        p.grad = None
    with LiveTensorBytes() as live:
        live.track(params)
        loss_fn().backward()
    for p in params:
        p.grad = None
    return live.peak


def planned_bytes(model, b: int, s: int) -> int:
    """The planner's peak for one loss and backward of ``model`` (a `CausalLM`) at tp=1, fp32 on CPU:
    its estimate of the training step less AdamW's moments (in every moment alike)."""
    from ..plan import estimate

    est = estimate(model, tp=1, precision="fp32", micro_batch_size=b, seq_len=s, device_type="cpu")
    return est.peak_bytes - est.bytes_per_rank["optimizer"]


def causal_lm_case(lm, x, y, fused: bool) -> dict:
    """``CausalLM(lm)``'s loss on the fused path or the gathered one: measured and planned."""
    from ..models import CausalLM

    model = CausalLM(lm, fused_loss=fused)
    path = model.prepare_loss()  # outside the measurement: the proof runs its own probe batch
    measured = peak_bytes(lambda: model(x, y), list(lm.parameters()))
    planned = planned_bytes(model, *x.shape)
    return {"case": "fused" if fused else "gathered", "loss_path": path.describe(), "peak_bytes": measured,
            "planned_bytes": planned, "planner_error": planned / measured - 1}


def own_head_case(lm, x, y) -> dict:
    """The decoder's last hidden states into bigdense's head, its weight the model's head's parameter."""
    from ..layers import ParallelClassifierHead

    weight = lm.get_output_embeddings().weight
    head = ParallelClassifierHead(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = weight
    params = list(lm.parameters())  # the head's weight among them, once

    def loss():
        h = lm.model(input_ids=x, use_cache=False).last_hidden_state
        return head.loss(h.reshape(-1, h.shape[-1]), y.reshape(-1))

    return {"case": "own head", "loss_path": "ParallelClassifierHead.loss", "peak_bytes": peak_bytes(loss, params)}


def compare(vocab: int, d: int, layers: int, b: int, s: int) -> list[dict]:
    """The three cases on one model."""
    lm = build_llama(vocab, d, layers, s)
    x, y = batch(vocab, b, s)
    rows = [causal_lm_case(lm, x, y, fused=False), causal_lm_case(lm, x, y, fused=True), own_head_case(lm, x, y)]
    for row in rows:
        row.update(bench="hf_loss", vocab=vocab, d=d, layers=layers, tokens=b * s)
    return rows


def vocab_bytes(vocab: int, d: int) -> int:
    """What of the vocabulary's size is alive at the fused path's peak, inside the loss's forward
    (fp32): the embedding and the head's weight, and the head weight's gradient (formed there; the
    embedding's comes at the end of the backward)."""
    return 3 * vocab * d * 4


def chunk_buffer_bytes(vocab: int, tokens: int) -> int:
    """The fused loss's logits buffer of one chunk on the CPU loop at tp=1 (fp32, one slot)."""
    from ..layers.head.fused_ce import loss_chunk_tokens

    return vocab * min(tokens, loss_chunk_tokens(vocab, "cpu", torch.float32, 1)) * 4


def sweep(vocabs, d: int, layers: int, b: int, s: int) -> list[dict]:
    """The fused path's peak at each vocabulary size, its growth, and what the growth is made of."""
    rows = []
    for vocab in vocabs:
        lm = build_llama(vocab, d, layers, s)
        x, y = batch(vocab, b, s)
        row = causal_lm_case(lm, x, y, fused=True)
        row.update(bench="hf_loss_sweep", vocab=vocab, d=d, layers=layers, tokens=b * s,
                   vocab_weight_bytes=vocab_bytes(vocab, d), chunk_buffer_bytes=chunk_buffer_bytes(vocab, b * s))
        rows.append(row)
        del lm
    first = rows[0]
    for row in rows:
        row["growth_bytes"] = row["peak_bytes"] - first["peak_bytes"]
        row["vocab_weight_growth_bytes"] = row["vocab_weight_bytes"] - first["vocab_weight_bytes"]
        row["chunk_buffer_growth_bytes"] = row["chunk_buffer_bytes"] - first["chunk_buffer_bytes"]
        row["other_growth_bytes"] = (row["growth_bytes"] - row["vocab_weight_growth_bytes"]
                                     - row["chunk_buffer_growth_bytes"])
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:9.1f} MiB"


def print_comparison(rows: list[dict]) -> dict:
    """The three cases' table; returns their ratios."""
    by = {r["case"]: r for r in rows}
    ratios = {"fused_over_own_head": by["fused"]["peak_bytes"] / by["own head"]["peak_bytes"],
              "gathered_over_fused": by["gathered"]["peak_bytes"] / by["fused"]["peak_bytes"]}
    r0 = rows[0]
    print(f"Llama-shaped, vocabulary {r0['vocab']:,}, d={r0['d']}, {r0['layers']} layer(s), {r0['tokens']:,} tokens, "
          f"tp=1, fp32, CPU: peak live tensor bytes of loss + backward (parameters included)")
    print(f"  {'case':<10} {'measured':>13} {'planner':>13} {'error':>8}  loss path")
    for r in rows:
        planned = f"{_mib(r['planned_bytes'])} {r['planner_error']:+8.2%}" if "planned_bytes" in r else " " * 22
        print(f"  {r['case']:<10} {_mib(r['peak_bytes'])} {planned}  {r['loss_path']}")
    print(f"  fused / own head {ratios['fused_over_own_head']:.2f}x (at most 1.5x), "
          f"gathered / fused {ratios['gathered_over_fused']:.1f}x")
    return ratios


def print_sweep(rows: list[dict]) -> None:
    print(f"\nfused path by vocabulary ({rows[0]['tokens']:,} tokens): the peak's growth over {rows[0]['vocab']:,} "
          f"entries beside that of the weights (embedding, head) with the head's gradient, and of the loss's chunk "
          f"buffer (within its budget); other: what else grew")
    print(f"  {'vocab':>8} {'peak':>13} {'planner':>8} {'growth':>13} {'weights+grad':>13} {'chunk buffer':>13} "
          f"{'other':>13}")
    for r in rows:
        print(f"  {r['vocab']:>8,} {_mib(r['peak_bytes'])} {r['planner_error']:+8.2%} {_mib(r['growth_bytes'])} "
              f"{_mib(r['vocab_weight_growth_bytes'])} {_mib(r['chunk_buffer_bytes'])} {_mib(r['other_growth_bytes'])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
    parser.add_argument("--vocab", type=int, help="the compared model's vocabulary")
    parser.add_argument("--sweep", type=int, nargs="*", help="vocabularies of the fused path's sweep (none: skip it)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--json", help="append the rows here as JSON lines")
    args = parser.parse_args(argv)
    shape = dict(QUICK if args.quick else FULL)
    shape.update({k: v for k, v in (("vocab", args.vocab), ("batch", args.batch), ("seq", args.seq),
                                    ("sweep", args.sweep)) if v is not None})
    rows = compare(shape["vocab"], shape["d"], shape["layers"], shape["batch"], shape["seq"])
    ratios = print_comparison(rows)
    for row in rows:
        row.update(ratios)
    swept = sweep(shape["sweep"], shape["d"], shape["layers"], shape["batch"], shape["seq"]) if shape["sweep"] else []
    if swept:
        print_sweep(swept)
    if args.json:
        append_json_lines(args.json, rows + swept)
        print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
