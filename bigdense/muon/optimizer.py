"""`Muon`: Muon for the dense layers' weights at any TP x DP layout, AdamW for the other parameters.

Per step, on each Muon weight (its local tensors: a TP shard, an FSDP chunk of one, or a replica):

    buf  <- lerp(buf, grad, 1 - momentum)                  elementwise, local
    u    <- lerp(grad, buf, momentum)  (nesterov; else buf) elementwise, local
    O    <- Newton-Schulz(u) of each whole logical matrix   on its owner (`exchange.py`)
    w    <- w (1 - lr wd) - lr * lr_ratio(matrix) * O       elementwise, local

which is ``torch.optim.Muon``'s step on the unsharded matrix: only the orthogonalisation needs the
whole matrix, so each matrix goes to one rank (`assignment.py`), is orthogonalised there once and its
result comes back in pieces. The other parameters are stepped by a torch ``AdamW`` inside (fused
where the engines ask for it), sharing this optimizer's ``param_groups`` (flag ``"muon"``) and
``state``, so one ``state_dict`` -- and one bigdense checkpoint -- holds both. The momentum buffer is
shaped like its weight's local tensor, so checkpoints save it sharded like the weight (layout-free).

No host synchronisation: the LR may be a device tensor, and a step the engine votes to skip
(``found_inf``, as fused AdamW reads it) leaves weights and momentum untouched through
``torch.where``. A weight with no gradient on a step keeps its weight and momentum, but its
(zero) pieces still travel so that every rank issues the same collectives.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..parallel.sharding import local_tensor
from .exchange import Exchange
from .geometry import Layout, MatrixGeometry
from .newton_schulz import DEFAULT_COEFFICIENTS, lr_ratio, ns_flops, orthogonalizer


class Muon(torch.optim.Optimizer):
    """Muon (groups with ``"muon": True``, 2-D parameters) + AdamW (the other groups).

    ``matrices``: for each Muon parameter, in group order, the `MatrixGeometry` list of the matrices
    it holds (`geometry.matrices_of`); ``layout``, ``rank``, ``group``: the mesh, this rank in it
    and the process group spanning it (None alone); ``comm``: the exchange scheme
    (`exchange.SCHEMES`); ``ns_dtype``: the Newton-Schulz iteration's dtype (and the exchange's);
    ``ns_backend``: a ``torch.compile`` backend for the iteration (None: eager).
    Hyper-parameters are ``torch.optim.Muon``'s (``adjust_lr``: its ``adjust_lr_fn``, here
    defaulting to ``match_rms_adamw``) and AdamW's (``betas``, ``adam_eps``; ``fused``,
    ``capturable``).
    """

    algorithm = "muon"  # what a checkpoint records (`bigdense.checkpoint.optimizer`)

    def __init__(self, groups: Sequence[dict], matrices: Sequence[Sequence[MatrixGeometry]], *, layout: Layout,
                 rank: int = 0, group=None, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, ns_coefficients=DEFAULT_COEFFICIENTS, ns_steps: int = 5, eps: float = 1e-7,
                 adjust_lr: str = "match_rms_adamw", betas=(0.9, 0.95), adam_eps: float = 1e-8,
                 comm: str = "all_to_all", ns_dtype: torch.dtype = torch.float32, ns_backend: Optional[str] = None,
                 fused: Optional[bool] = None, capturable: bool = False):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), ns_steps=ns_steps, ns_eps=eps, adjust_lr=adjust_lr)
        super().__init__([dict(g) for g in groups], defaults)
        for g in self.param_groups:
            g.setdefault("muon", False)
            if g["muon"] and any(p.dim() != 2 for p in g["params"]):
                raise ValueError("Muon: a group flagged muon holds a parameter that is not 2-D")
        self.ns_dtype = ns_dtype
        self._orthogonalize = orthogonalizer(ns_backend)
        self._matrices = [list(ms) for ms in matrices]
        if len(self._matrices) != len(self._muon_params()):
            raise ValueError(f"Muon: {len(self._matrices)} matrix layouts for {len(self._muon_params())} Muon parameters")
        flat = [m for ms in self._matrices for m in ms]
        steps = {int(g["ns_steps"]) for g in self.param_groups if g["muon"]} or {ns_steps}
        self.exchange = Exchange(flat, [ns_flops(m.shape, max(steps)) for m in flat], layout, rank, group, comm)
        aux = [g for g in self.param_groups if not g["muon"]]
        self._adamw = None
        if aux:
            self._adamw = torch.optim.AdamW(aux, lr=lr, betas=tuple(betas), eps=adam_eps, fused=fused,
                                            capturable=capturable)
            self._adamw.state = self.state

    def _muon_params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups if g["muon"] for p in g["params"]]

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        if self._adamw is not None:  # the loaded groups are new dicts: hand AdamW its own again
            self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self._adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skip = getattr(self, "found_inf", None)
        if self._adamw is not None:
            self._adamw.found_inf, self._adamw.grad_scale = skip, getattr(self, "grad_scale", None)
            self._adamw.step()
        self._muon_step(skip)
        return loss

    def _muon_step(self, skip: Optional[torch.Tensor]) -> None:
        keep = None if skip is None else skip == 0
        pieces, targets, first = [], [], 0
        for group in (g for g in self.param_groups if g["muon"]):
            params = group["params"]
            matrices, first = self._matrices[first:first + len(params)], first + len(params)
            for p, u, ms in zip(params, self._momentum(group, params, keep), matrices):
                pending = _PendingWeight(group, p, u, len(ms))
                for m in ms:
                    pieces.append(m.piece(self.exchange.rank).take(u).to(self.ns_dtype))
                    targets.append((pending, m))
        u = None  # the last weight's update lives on in its pending entry only

        def deliver(i: int, values: torch.Tensor) -> None:
            pending, m = targets[i]
            targets[i] = None
            ratio = lr_ratio(m.shape, pending.group["adjust_lr"])
            m.piece(self.exchange.rank).put(pending.direction, values.to(pending.direction.dtype) * ratio)
            pending.remaining -= 1
            if pending.remaining == 0:  # every matrix of the weight is back: step it, free its update
                self._apply(pending.group, pending.param, pending.direction, self._keep(pending.param, keep))
                pending.direction = None

        self.exchange.run(pieces, lambda i, whole: self._newton_schulz(whole, targets[i][0].group), deliver)

    def _newton_schulz(self, whole: torch.Tensor, group: dict) -> torch.Tensor:
        return self._orthogonalize(whole, group["ns_coefficients"], int(group["ns_steps"]), float(group["ns_eps"]),
                                   self.ns_dtype)

    def _momentum(self, group: dict, params: list, keep) -> list[torch.Tensor]:
        """Update the momentum buffers (unless the step is skipped); return the step's updates
        (local tensors; foreach ops, one launch per group where the backend fuses them)."""
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        bufs = [local_tensor(self.state[p]["momentum_buffer"]) for p in params]
        grads = [torch.zeros_like(b) if p.grad is None else local_tensor(p.grad) for p, b in zip(params, bufs)]
        momentum = float(group["momentum"])
        new_bufs = torch._foreach_lerp(bufs, grads, 1 - momentum)
        updates = torch._foreach_lerp(grads, new_bufs, momentum) if group["nesterov"] else new_bufs
        for p, buf, new in zip(params, bufs, new_bufs):
            self._write(buf, new, self._keep(p, keep))
        return updates

    @staticmethod
    def _keep(p: torch.Tensor, keep: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Where the step applies: None (everywhere), or a device flag (False on a skipped step, and
        for a parameter with no gradient)."""
        if p.grad is None:
            return torch.zeros((), dtype=torch.bool, device=local_tensor(p).device)
        return keep

    @staticmethod
    def _write(target: torch.Tensor, new: torch.Tensor, keep: Optional[torch.Tensor]) -> None:
        target.copy_(new if keep is None else torch.where(keep, new, target))

    @staticmethod
    def _apply(group: dict, p: torch.Tensor, direction: torch.Tensor, keep: Optional[torch.Tensor]) -> None:
        """``w <- w (1 - lr wd) - lr * direction`` in place (``direction``, already scaled by its
        matrices' LR ratios, is consumed); where ``keep`` is False nothing changes (factor 1, direction 0)."""
        w, lr = local_tensor(p), group["lr"]
        factor = 1 - lr * float(group["weight_decay"])
        if keep is not None:
            factor = torch.where(keep, factor, 1.0)
            direction.masked_fill_(~keep, 0.0)  # a skipped step's update may hold inf or nan
        w.mul_(factor)
        w.sub_(direction.mul_(lr))


class _PendingWeight:
    """A Muon weight waiting for the results of its matrices: its update ``u`` becomes its direction
    when it is one matrix (its piece was sent already), else a zeroed tensor is filled block by block."""

    def __init__(self, group: dict, param: torch.Tensor, update: torch.Tensor, matrices: int):
        self.group, self.param, self.remaining = group, param, matrices
        self._direction = update if matrices == 1 else None
        self._like = (update.shape, update.dtype, update.device)  # not the update itself: it may go

    @property
    def direction(self) -> torch.Tensor:
        if self._direction is None:  # made when the first block comes back, not before
            shape, dtype, device = self._like
            self._direction = torch.zeros(shape, dtype=dtype, device=device)
        return self._direction

    @direction.setter
    def direction(self, value) -> None:
        self._direction = value
