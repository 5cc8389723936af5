"""Weight initialisers that give the same full matrix at every tensor-parallel size.

Fan-in and fan-out always come from the *global* shape ``(out_features, in_features)``. The named
schemes are counter-based (`bigdense.parallel.random.counter_fill_`): element ``(row, col)`` is a
pure function of (the layer's seed, global row, global column), so a rank only generates its own
shard, with a fixed handful of vectorised ops per chunk on the weight's device, and after the same
``torch.manual_seed`` the matrix assembled from the shards is bit-identical at tp = 1, 2, 3, ... .
``"orthogonal"`` needs a QR of the whole matrix: every rank builds the full matrix once, then keeps
its slice. User callables, and `Initializer` objects built from a generator-based ``fill``, need
torch's generator: they keep the tile path (`bigdense.parallel.random.tiled_fill_`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import torch
import torch.nn as nn

from ..parallel import random as prng
from ..parallel.random import mix_seed, tiled_fill_

# Fills an fp32 tile in place: fill(tile, generator, fan_in, fan_out).
TileFill = Callable[[torch.Tensor, torch.Generator, int, int], None]


@dataclass(frozen=True)
class Initializer:
    """A named element-wise scheme drawn tile by tile with torch's generator (`tiled_fill_`);
    ``fill`` receives the global fans. The built-in schemes are `CounterInitializer`s."""

    name: str
    fill: TileFill

    def init_(self, out: torch.Tensor, global_shape: Sequence[int], offsets: Sequence[int], seed: int) -> torch.Tensor:
        """Fill ``out``, the slice of the global weight at ``offsets``, in place."""
        fan_out, fan_in = int(global_shape[0]), int(global_shape[1])
        return tiled_fill_(out, global_shape, offsets, seed, lambda t, g: self.fill(t, g, fan_in, fan_out))


# Turns int32 hash words into fp32 values: law(words, fan_in, fan_out).
CounterLaw = Callable[[torch.Tensor, int, int], torch.Tensor]


@dataclass(frozen=True)
class CounterInitializer(Initializer):
    """A named element-wise scheme drawn counter-based (`counter_fill_`); ``law`` receives the
    global fans and turns hash words into values."""

    law: CounterLaw = None

    def init_(self, out, global_shape, offsets, seed):
        fan_out, fan_in = int(global_shape[0]), int(global_shape[1])
        return prng.counter_fill_(out, global_shape, offsets, seed, lambda w: self.law(w, fan_in, fan_out))


class _Zeros(Initializer):
    def init_(self, out, global_shape, offsets, seed):
        with torch.no_grad():
            return out.zero_()


class _Orthogonal(Initializer):
    """``nn.init.orthogonal_`` on the global matrix. Each rank holds the full matrix while it runs."""

    def init_(self, out, global_shape, offsets, seed):
        rows, cols = int(global_shape[0]), int(global_shape[1])
        gaussian = torch.empty(rows, cols, dtype=torch.float32, device=out.device)
        prng.counter_fill_(gaussian, (rows, cols), (0, 0), seed, prng.standard_normal)
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


def _uniform(name: str, bound: Callable[[int, int], float]) -> Initializer:
    """U(-bound, bound)."""
    return CounterInitializer(name, None, lambda w, fi, fo: prng.uniform_symmetric(w) * bound(fi, fo))


def _normal(name: str, std: Callable[[int, int], float]) -> Initializer:
    """N(0, std^2)."""
    return CounterInitializer(name, None, lambda w, fi, fo: prng.standard_normal(w) * std(fi, fo))


def _trunc_normal(name: str, std: Callable[[int, int], float]) -> Initializer:
    """N(0, std^2) cut at +-2 std."""
    return CounterInitializer(name, None, lambda w, fi, fo: prng.truncated_normal(w, 2.0) * std(fi, fo))


_RELU_GAIN = math.sqrt(2.0)
# Standard deviation of a unit normal truncated to [-2, 2]; flax divides by it so lecun_normal keeps
# variance 1/fan_in after truncation.
_TRUNC2_STD = 0.87962566103423978

INITIALIZERS: dict[str, Initializer] = {
    # nn.Linear's own: kaiming_uniform_(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    "torch": _uniform("torch", lambda fi, fo: 1.0 / math.sqrt(fi)),
    "xavier_uniform": _uniform("xavier_uniform", lambda fi, fo: math.sqrt(6.0 / (fi + fo))),
    "xavier_normal": _normal("xavier_normal", lambda fi, fo: math.sqrt(2.0 / (fi + fo))),
    # torch's defaults for these: a=0, mode="fan_in", nonlinearity="leaky_relu" (gain sqrt(2)).
    "kaiming_uniform": _uniform("kaiming_uniform", lambda fi, fo: _RELU_GAIN * math.sqrt(3.0 / fi)),
    "kaiming_normal": _normal("kaiming_normal", lambda fi, fo: _RELU_GAIN / math.sqrt(fi)),
    # flax's lecun_normal: truncated at 2 std, rescaled so the variance is 1/fan_in.
    "lecun_normal": _trunc_normal("lecun_normal", lambda fi, fo: 1.0 / math.sqrt(fi) / _TRUNC2_STD),
    "orthogonal": _Orthogonal("orthogonal", None),
    # GPT-2 / Megatron's N(0, 0.02^2), truncated at 2 std (as timm's trunc_normal_(std=.02)):
    # the resulting std is 0.0176.
    "trunc_normal": _trunc_normal("trunc_normal", lambda fi, fo: 0.02),
    # nn.Embedding's own: N(0, 1).
    "normal": _normal("normal", lambda fi, fo: 1.0),
    "zeros": _Zeros("zeros", None),
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
    return prng.counter_fill_(out, (global_len,), (offset,), mix_seed(seed, 1), lambda w: prng.uniform_symmetric(w) * bound)
