"""Low-rank adapters on a converted Hugging Face model, as in docs/lora.md, runnable as written.

    .venv/bin/python examples/lora.py OUT                                       # one process (unconverted)
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/lora.py OUT     # converted at tp=2

A tiny Llama written into OUT (random weights), adapters of rank 8 on its attention projections, a
few AdamW steps on random tokens, the adapter saved in PEFT's format and loaded back, then loaded by
PEFT itself on the plain model: the same logits; and the adapters merged into the weights, the same
logits again.
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import PeftModel
from transformers import AutoModelForCausalLM

import bigdense as bd
from bigdense.testing.pretrained import write_pretrained

ctx = bd.init_parallel(tp=int(os.environ.get("WORLD_SIZE", 1)))
out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/lora-example")
base_dir, adapter_dir = out / "tiny-llama", out / "adapter"
if ctx.is_main:
    write_pretrained(base_dir, "llama")
if ctx.world_size > 1:
    torch.distributed.barrier()  # the directory is written

model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
if ctx.tp_size > 1:
    model = bd.parallelize(model)                       # or bigdense's own layers; or unconverted at tp=1
bd.add_lora(model, r=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"], dropout=0.0, rslora=False)
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
torch.manual_seed(0)  # the same tokens on every rank
ids = torch.randint(0, 512, (2, 33))
for _ in range(3):
    loss = F.cross_entropy(model(input_ids=ids[:, :-1]).logits.flatten(0, 1), ids[:, 1:].flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
bd.save_peft_adapter(model, adapter_dir)          # every rank calls it; the factors gathered, rank 0 writes
bd.load_peft_adapter(model, adapter_dir)          # at any TP size; adds the adapters first if absent
with torch.no_grad():
    ours = model(input_ids=ids).logits
    merged = bd.merge_lora_(model)                      # fold them into the weights, shard by shard, no communication
    assert torch.allclose(merged(input_ids=ids).logits, ours, atol=1e-5)

if ctx.is_main:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapter_dir)
    with torch.no_grad():
        theirs = model(input_ids=ids).logits
    print(f"tp={ctx.tp_size}: loss {loss.item():.4f} after 3 steps; PEFT's logits of the saved adapter differ by "
          f"{(ours - theirs).abs().max().item():.1e}")
bd.destroy_parallel()
