"""GPU kernels (Triton) and their torch references.

Each kernel lives in a ``triton_*`` module, imported only where it runs (a CUDA device, or Triton's
interpreter on CPU tensors in the tests), beside a torch reference of the same name in a plain
module: the oracle the kernel is tested against, and what runs where Triton does not.

* `softmax_ce`: the fused cross-entropy's two passes over a chunk of logits, tokens-major: each
  token's softmax statistics (`row_stats`), then the scaled softmax gradient written in place
  (`softmax_grad_`). `ce_kernels(device)` picks the implementation.
* `counter_hash`: the counter hash of layout-free random numbers (`fmix32`) and a dropout site's
  full-size pass (`keep_scale`: hash, threshold, scale), whose Triton kernel is `triton_dropout`.
  `dropout_kernels(device)` picks the implementation.
"""
from .softmax_ce import CEKernels, ce_kernels, row_stats, softmax_grad_

__all__ = ["CEKernels", "ce_kernels", "row_stats", "softmax_grad_"]
