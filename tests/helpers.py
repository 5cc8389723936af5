"""Comparison helpers shared by the tests."""
import torch


def assert_close(actual, expected, what, *, rtol, atol):
    """torch.testing.assert_close with the name of the quantity in the message."""
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def clone_leaf(t):
    return t.detach().clone().requires_grad_(t.requires_grad)
