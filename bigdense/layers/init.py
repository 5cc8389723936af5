"""Weight initialisers that give the same full matrix at every tensor-parallel size.

Fan-in and fan-out always come from the *global* shape ``(out_features, in_features)``. Values
are drawn tile by tile (`bigdense.parallel.random.tiled_fill_`), so a rank only generates the
tiles that touch its shard; after the same ``torch.manual_seed`` the matrix assembled from the
shards is bit-identical at tp = 1, 2, 3, ... . The exception is ``"orthogonal"``, which needs a QR
of the whole matrix: every rank builds the full matrix once, then keeps its slice.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
import torch.nn as nn

from ..parallel.random import mix_seed, tiled_fill_

# Fills an fp32 tile in place: fill(tile, generator, fan_in, fan_out).
TileFill = Callable[[torch.Tensor, torch.Generator, int, int], None]


@dataclass(frozen=True)
class Initializer:
    """A named element-wise scheme; ``fill`` receives the global fans. Subclass for other kinds."""

    name: str
    fill: TileFill

    def init_(self, out: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int], seed: int) -> torch.Tensor:
        """Fill ``out``, the slice of the global weight at ``offsets``, in place."""
        fan_out, fan_in = int(global_shape[0]), int(global_shape[1])
        return tiled_fill_(out, global_shape, offsets, seed, lambda t, g: self.fill(t, g, fan_in, fan_out))


class _Orthogonal(Initializer):
    """``nn.init.orthogonal_`` on the global matrix. Each rank holds the full matrix while it runs."""

    def init_(self, out, global_shape, offsets, seed):
        rows, cols = int(global_shape[0]), int(global_shape[1])
        gaussian = torch.empty(rows, cols, dtype=torch.float32, device=out.device)
        tiled_fill_(gaussian, (rows, cols), (0, 0), seed, lambda t, g: t.normal_(0.0, 1.0, generator=g))
        flat = gaussian.t() if rows < cols else gaussian
        q, r = torch.linalg.qr(flat)
        q = q * torch.diagonal(r).sign()
        full = q.t() if rows < cols else q
        with torch.no_grad():
            out.copy_(full[offsets[0] : offsets[0] + out.shape[0], offsets[1] : offsets[1] + out.shape[1]])
        return out


class _PerTileCallable(Initializer):
    """A user's ``fn(tensor)`` applied to each tile of the global matrix, on CPU, with torch's RNG
    seeded per tile. Element-wise schemes with fixed parameters stay TP-invariant this way."""

    def __init__(self, fn: Callable[[torch.Tensor], object]):
        super().__init__(getattr(fn, "__name__", repr(fn)), None)
        object.__setattr__(self, "fn", fn)

    def init_(self, out, global_shape, offsets, seed):
        def fill(tile: torch.Tensor, generator: torch.Generator) -> None:
            tile_seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(tile_seed)
                cpu_tile = torch.empty(tile.shape, dtype=torch.float32)
                self.fn(cpu_tile)
            tile.copy_(cpu_tile)

        return tiled_fill_(out, global_shape, offsets, seed, fill)


def _uniform(bound: Callable[[int, int], float]) -> TileFill:
    def fill(t, g, fan_in, fan_out):
        b = bound(fan_in, fan_out)
        t.uniform_(-b, b, generator=g)

    return fill


def _normal(std: Callable[[int, int], float]) -> TileFill:
    def fill(t, g, fan_in, fan_out):
        t.normal_(0.0, std(fan_in, fan_out), generator=g)

    return fill


def _trunc_normal(std: Callable[[int, int], float]) -> TileFill:
    def fill(t, g, fan_in, fan_out):
        s = std(fan_in, fan_out)
        nn.init.trunc_normal_(t, 0.0, s, -2.0 * s, 2.0 * s, generator=g)

    return fill


def _zeros(t, g, fan_in, fan_out):
    t.zero_()


_RELU_GAIN = math.sqrt(2.0)
# Standard deviation of a unit normal truncated to [-2, 2]; flax divides by it so lecun_normal keeps
# variance 1/fan_in after truncation.
_TRUNC2_STD = 0.87962566103423978

INITIALIZERS: dict[str, Initializer] = {
    # nn.Linear's own: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    "torch": Initializer("torch", _uniform(lambda fi, fo: 1.0 / math.sqrt(fi))),
    "xavier_uniform": Initializer("xavier_uniform", _uniform(lambda fi, fo: math.sqrt(6.0 / (fi + fo)))),
    "xavier_normal": Initializer("xavier_normal", _normal(lambda fi, fo: math.sqrt(2.0 / (fi + fo)))),
    # torch's defaults for these: a=0, mode="fan_in", nonlinearity="leaky_relu" (gain sqrt(2)).
    "kaiming_uniform": Initializer("kaiming_uniform", _uniform(lambda fi, fo: _RELU_GAIN * math.sqrt(3.0 / fi))),
    "kaiming_normal": Initializer("kaiming_normal", _normal(lambda fi, fo: _RELU_GAIN / math.sqrt(fi))),
    # flax's lecun_normal: truncated at 2 std, rescaled so the variance is 1/fan_in.
    "lecun_normal": Initializer("lecun_normal", _trunc_normal(lambda fi, fo: 1.0 / math.sqrt(fi) / _TRUNC2_STD)),
    "orthogonal": _Orthogonal("orthogonal", None),
    # GPT-2 / Megatron's N(0, 0.02^2), truncated at 2 std (as timm's trunc_normal_(std=.02)):
    # the resulting std is 0.0176.
    "trunc_normal": Initializer("trunc_normal", _trunc_normal(lambda fi, fo: 0.02)),
    # nn.Embedding's own: N(0, 1).
    "normal": Initializer("normal", _normal(lambda fi, fo: 1.0)),
    "zeros": Initializer("zeros", _zeros),
}

_FAN_DEPENDENT = {
    nn.init.xavier_uniform_: "xavier_uniform",
    nn.init.xavier_normal_: "xavier_normal",
    nn.init.kaiming_uniform_: "kaiming_uniform",
    nn.init.kaiming_normal_: "kaiming_normal",
    nn.init.orthogonal_: "orthogonal",
}

InitSpec = Union[str, Initializer, Callable[[torch.Tensor], object]]


def resolve_init(init: InitSpec, owner: str) -> Initializer:
    """Turn ``init=`` into an `Initializer`; ``owner`` names the layer in error messages."""
    if isinstance(init, Initializer):
        return init
    if isinstance(init, str):
        if init not in INITIALIZERS:
            raise ValueError(f"{owner}: unknown init {init!r}; expected one of {sorted(INITIALIZERS)} or a callable")
        return INITIALIZERS[init]
    if callable(init):
        if init in _FAN_DEPENDENT:
            raise ValueError(
                f"{owner}: init={init.__name__} needs the fans of the whole matrix but a callable is applied "
                f"tile by tile; pass init={_FAN_DEPENDENT[init]!r} instead"
            )
        return _PerTileCallable(init)
    raise TypeError(f"{owner}: init must be a name, an Initializer or a callable, got {type(init).__name__}")


def init_bias_(out: torch.Tensor, init: Initializer, fan_in: int, global_len: int, offset: int, seed: int) -> torch.Tensor:
    """nn.Linear's bias law, U(+-1/sqrt(fan_in)), for ``init="torch"``; zeros for every other scheme."""
    if init.name != "torch":
        with torch.no_grad():
            return out.zero_()
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return tiled_fill_(out, (global_len,), (offset,), mix_seed(seed, 1), lambda t, g: t.uniform_(-bound, bound, generator=g))
