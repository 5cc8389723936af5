"""Sparse products and int8 weights for inference, as in docs/compression.md, runnable as written.

    .venv/bin/python examples/sparse_int8.py                                      # one process
    .venv/bin/torchrun --standalone --nproc_per_node=2 examples/sparse_int8.py    # the layers sharded, tp=2

A 1024 -> 4096 -> 1024 MLP pruned to 90% and given CSR products where they are faster than its dense
ones; the same MLP with int8 weights, saved sharded, exported as one file and read back into plain
PyTorch. Files go to outputs/example_sparse_int8 (or the directory given as the first argument).
"""
import os
import sys
from pathlib import Path

import safetensors.torch
import torch

import bigdense as bd
from bigdense.layers.mlp import DenseMLP

out = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/example_sparse_int8")
ctx = bd.init_parallel(tp=int(os.environ.get("WORLD_SIZE", 1)))
torch.manual_seed(0)  # the same on every rank: shards of one TP-invariant initialisation
x = torch.randn(128, 1024, device=ctx.device)

mlp = bd.ParallelMLP(1024, 4096, init="trunc_normal", device=ctx.device)  # one scale for up and down
bd.prune(mlp, 0.9)  # one threshold over both: weight_mask buffers, the pruned weights zero (docs/pruning.md)
masked = mlp(x)
with torch.no_grad():
    report = bd.to_sparse(mlp, sample_tokens=128)  # times dense and CSR per layer; converts where CSR is faster
chosen = {row["layer"]: row["format"] for row in report.layers}  # the same on every rank: timings all-reduced
sparse_error = (mlp(x) - masked).abs().max().item()  # float rounding: the same nonzero products

mlp8 = bd.quantize_int8(bd.ParallelMLP(1024, 4096, device=ctx.device))  # int8 weights, one scale per output
bd.save_checkpoint(out / "int8", mlp8)  # weight (int8) and weight_scale, sharded like the float weights
y8 = mlp8(x)  # a collective: on every rank
if ctx.is_main:  # offline, one process, no process group
    bd.export_dense(out / "int8", out / "int8.safetensors")
    sd = safetensors.torch.load_file(out / "int8.safetensors")  # plain PyTorch from here on
    plain = {k: v for k, v in sd.items() if not k.endswith(".weight_scale")}
    plain.update({k[:-len("_scale")]: sd[k[:-len("_scale")]].float() * v[:, None] for k, v in sd.items() if k.endswith(".weight_scale")})
    dense = DenseMLP(1024, 4096).to(ctx.device)
    dense.load_state_dict(plain)  # a plain nn.Linear per layer, weights dequantised
    torch.testing.assert_close(dense(x), y8, rtol=1e-4, atol=1e-4)
    print(f"tp={ctx.tp_size}: sparse products {chosen}, max difference to the masked layers {sparse_error:.1e}; "
          f"int8 export read into plain PyTorch, {(out / 'int8.safetensors').stat().st_size / 1e6:.1f} MB")
bd.destroy_parallel()
