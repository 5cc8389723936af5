"""The dropout site's Triton pass (`kernels/triton_dropout.py`) against its torch reference, on CPU
through Triton's interpreter (conftest sets TRITON_INTERPRET=1 without CUDA).

The mask is an integer hash, so which elements are dropped is compared for equality in every
region `tp_dropout` serves: replicated, a sharded dimension, a sequence share, inside a batch slice.
The values too, bit for bit in fp32. In bf16 the kernel multiplies in fp32 and rounds once to bf16
(to nearest on a GPU; Triton's interpreter truncates), where torch's CPU ``mul`` by a Python number
first rounds the scale to bf16: the kept values agree within one bf16 step.
"""
import pytest
import torch

from bigdense.kernels import counter_hash
from bigdense.parallel.dropout import batch_slice, tp_dropout

from helpers import compile_for_sm90_in_a_fresh_process

CASES = {
    "replicated": dict(shape=(2, 5, 40), kwargs={}),
    "sharded heads": dict(shape=(2, 3, 5, 5), kwargs=dict(shard_dim=1, global_size=8, offset=2)),
    "sequence share": dict(shape=(3, 4, 24), kwargs=dict(shard_dim=-2, global_size=9, offset=5)),
    "a column block wider than one program": dict(shape=(3, 2500), kwargs={}),
}


def _run(x, kwargs, kernels, monkeypatch, p=0.3):
    monkeypatch.setenv(counter_hash.KERNELS_ENV, kernels)
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(7)
    with batch_slice(2, 6):
        y = tp_dropout(x, p, **kwargs)
    y.backward(torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape) % 7 - 3)
    return y.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_the_triton_pass_equals_the_torch_reference_bit_for_bit(case, dtype, monkeypatch):
    shape, kwargs = CASES[case]["shape"], CASES[case]["kwargs"]
    x = torch.randn(shape).to(dtype)
    y_torch, g_torch = _run(x, kwargs, "torch", monkeypatch)
    y_triton, g_triton = _run(x, kwargs, "triton", monkeypatch)
    assert torch.equal(y_triton == 0, y_torch == 0) and torch.equal(g_triton == 0, g_torch == 0), case
    if dtype == torch.float32:
        assert torch.equal(y_triton, y_torch) and torch.equal(g_triton, g_torch), case
    else:
        torch.testing.assert_close(y_triton, y_torch, rtol=2**-7, atol=0)  # one bf16 step (see above)
        torch.testing.assert_close(g_triton, g_torch, rtol=2**-7, atol=0)
    assert 0 < (y_torch == 0).float().mean() < 0.6  # some dropped, most kept at p = 0.3


def test_the_triton_pass_saves_no_mask(monkeypatch):
    # The backward regenerates the mask: autograd keeps the two word vectors (n + m int32), not
    # a byte per element.
    monkeypatch.setenv(counter_hash.KERNELS_ENV, "triton")
    saved = []
    x = torch.randn(64, 128, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        tp_dropout(x, 0.1)
    assert sum(saved) == (64 + 128) * 4, saved


def test_the_kernel_choice_is_checked(monkeypatch):
    monkeypatch.setenv(counter_hash.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="BIGDENSE_DROPOUT_KERNELS must be triton or torch"):
        counter_hash.dropout_kernels(torch.device("cpu"))
    monkeypatch.delenv(counter_hash.KERNELS_ENV)
    assert counter_hash.dropout_kernels(torch.device("cpu")) == "torch"
    assert counter_hash.dropout_kernels(torch.device("cuda")) == "triton"


def test_the_kernel_compiles_for_an_sm90_gpu():
    # As the head's kernels (tests/test_head_kernels.py): the compiler, not the lenient interpreter,
    # in a fresh process.
    compile_for_sm90_in_a_fresh_process("triton_dropout", 2)  # fp32 and bf16 activations
