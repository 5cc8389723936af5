"""A Hugging Face causal language model as bigdense's engines and jobs call a model.

bigdense's engines call ``loss = model(x, y)`` (`bigdense.train.engines.base`): ``x`` the input
ids, ``y`` the next ids (``-100`` ignored). A transformers causal LM takes ``input_ids`` and returns
logits (and, given ``labels``, a loss over labels it shifts itself). `CausalLM` is the bridge: it
holds the transformers model, converted by `bd.parallelize` or not, as ``lm`` (so its parameters
are ``lm.<transformers name>``) and returns the mean cross-entropy against ``y`` over the tokens
whose target is not -100, in fp32, computed from the hidden states the model gives its output head
and that head's shard of the vocabulary by bigdense's fused vocab-parallel cross-entropy: no
(tokens x vocabulary) tensor exists, the model's own transform of its logits (a softcap, a scale,
a vocabulary slice) included, found and proved on a probe batch (`bigdense.models.hf_loss`). A model
whose transform is none of those keeps the gathered path (its logits and ``F.cross_entropy``), and
says why (``loss_path``). It also gives the jobs what they ask of a model: its decoder layers as
``blocks`` (for ``torch.compile`` and activation checkpointing), global parameter counts, frozen
input embeddings. transformers itself is not imported here.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..layers.base import global_numel
from ..parallel import comm
from ..layers.head.fused_ce import check_logit_options
from . import hf_loss
from .hf_loss import HeadTap, LossPath, LogitTransform


class CausalLM(nn.Module):
    """``loss = CausalLM(hf_model)(x, y)``: mean cross-entropy of ``hf_model(input_ids=x).logits``
    against ``y`` over the tokens whose target is not -100, computed in fp32 -- through the fused
    head (see the module docstring). ``pretrained``: the ``save_pretrained`` directory the weights
    come from (the fine-tune job loads it after TP). ``z_loss``: coefficient of each counted token's
    ``lse**2`` added to its loss (0: none; the fused path only). ``fused_loss=False`` keeps the
    gathered path.

    The loss path is decided by `prepare_loss`, once the weights are real: the fine-tune job calls
    it after loading them (before ``torch.compile`` and the engine); a loop of one's own gets it at
    the first ``forward``. ``loss_path`` then says which path runs and why."""

    def __init__(self, lm: nn.Module, pretrained: Optional[str] = None, *, z_loss: float = 0.0,
                 fused_loss: bool = True):
        super().__init__()
        self.lm = lm
        self.pretrained = pretrained
        self.z_loss = check_logit_options(f"{self._where()}: ", None, z_loss)[1]
        self.fused_loss = bool(fused_loss)
        self.loss_path: Optional[LossPath] = None
        self._tap: Optional[HeadTap] = None

    @property
    def blocks(self) -> Optional[nn.ModuleList]:
        """The decoder layers (``model.layers`` in most architectures), None when there is no such list."""
        decoder = self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else None
        for owner in (decoder, getattr(self.lm, "model", None), getattr(self.lm, "transformer", None)):
            for name in ("layers", "h", "blocks"):
                found = getattr(owner, name, None)
                if isinstance(found, nn.ModuleList):
                    return found
        return None

    def edges(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The input embeddings, and the decoder's final norm with the output head (units of
        `bigdense.train.engines.fsdp.apply_fsdp`); either list is empty where the model has none."""
        decoder = self.lm.get_decoder() if hasattr(self.lm, "get_decoder") else None
        inputs = [self.lm.get_input_embeddings()] if hasattr(self.lm, "get_input_embeddings") else []
        head = self._output_head()
        outputs = [m for m in (getattr(decoder, "norm", None), head) if isinstance(m, nn.Module)]
        return [m for m in inputs if isinstance(m, nn.Module)], outputs

    def num_parameters(self) -> dict[str, int]:
        """Global parameter counts (unsharded): total, and of the output head (a tied head shares
        the embedding's)."""
        head = self._output_head()
        return {"total": global_numel(self), "head": global_numel(head) if head is not None else 0}

    def depth_and_width(self) -> tuple[int, int]:
        """``(decoder layers, hidden size)``, for the FLOPs of a token (`bigdense.train.flops`)."""
        config = self.text_config()
        return config.num_hidden_layers, config.hidden_size

    def freeze_embeddings(self) -> list[str]:
        """Stop training the input embeddings (and an output head tied to them); the names frozen."""
        embeddings = self.lm.get_input_embeddings()
        embeddings.requires_grad_(False)
        return [name for name, p in self.named_parameters(remove_duplicate=False) if not p.requires_grad]

    def _where(self) -> str:
        return f"CausalLM({type(self.lm).__name__})"

    def prepare_loss(self, *, weights_loaded: bool = True) -> LossPath:
        """Decide the loss path (``loss_path``): fused when the output head's shard is usable, the
        model's logit transform is found and the fused loss and gradients equal its own logits path's
        on a probe batch (the model in eval mode, the random streams untouched; nothing is trained);
        else gathered, with the reason. Every rank of the job decides alike (one all-reduce).

        ``weights_loaded=False`` (a resumed run, whose checkpoint is read after this): the probe runs
        on placeholder weights, each parameter drawn from a generator of its own index (replicated
        ones alike on every rank), which the load then replaces; the path depends on the model's
        functions, not on its numbers. A model on the meta device (the planner's) takes the fused
        path unproved."""
        if not weights_loaded:
            with torch.no_grad():
                for index, p in enumerate(self.lm.parameters()):
                    p.normal_(0.0, 0.02, generator=torch.Generator(p.device).manual_seed(index))
        self.loss_path = _agreed(self._decide(), self.lm)
        return self.loss_path

    def _decide(self) -> LossPath:
        if not self.fused_loss:
            return LossPath(False, reason="fused_loss=False")
        head = self._output_head()
        if not isinstance(head, nn.Module):
            return LossPath(False, reason="the model has no output head (get_output_embeddings)")
        try:
            shard = hf_loss.head_shard(head)
        except ValueError as err:
            return LossPath(False, reason=str(err))
        if getattr(head, "sequence_parallel", False):
            return LossPath(False, reason="its output head takes sequence-parallel input")
        extra = sorted({name.rpartition(".")[2] for name, _ in head.named_parameters()} - {"weight", "bias"})
        if extra:
            return LossPath(False, reason=f"its output head ({type(head).__name__}) has parameters beside a weight and "
                                          f"a bias ({', '.join(extra)}): its forward is more than a linear map")
        if self._tap is None:
            self._tap = HeadTap(head)
        if shard.weight.device.type == "meta":
            return LossPath(True, LogitTransform(), "on the meta device: not proved")
        return self._probe(shard)

    def _probe(self, shard: hf_loss.HeadShard) -> LossPath:
        """`hf_loss.find_transform` and `hf_loss.prove` on a probe batch, in eval mode."""
        vocab_in = getattr(self.text_config(), "vocab_size", None) or shard.num_classes
        was_training = self.lm.training
        device = shard.weight.device
        try:
            self.lm.eval()
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                transform = hf_loss.find_transform(self.lm, self._tap, shard.num_classes,
                                                   hf_loss.probe_ids(min(vocab_in, shard.num_classes), device))
                ids = hf_loss.probe_ids(min(vocab_in, transform.keep or shard.num_classes), device)
                wrong = hf_loss.prove(self.lm, self._tap, transform, ids, self._where())
        except Exception as err:  # noqa: BLE001 - the model's own forward on stand-in logits: anything may fail
            return LossPath(False, reason=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        finally:
            self.lm.train(was_training)
        return LossPath(False, transform, wrong) if wrong else LossPath(True, transform)

    def text_config(self):
        """The language model's config (a multimodal model's text part)."""
        config = self.lm.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    def _output_head(self) -> Optional[nn.Module]:
        """The output head (``get_output_embeddings``), None where the model has none."""
        return self.lm.get_output_embeddings() if hasattr(self.lm, "get_output_embeddings") else None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The model's own logits (gathered over TP), for prediction and generation."""
        return self.lm(input_ids=x, use_cache=False).logits

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.loss_path is None:  # a loop of one's own: decided at the first call, on its weights
            self.prepare_loss()
        if not self.loss_path.fused:
            logits = self.logits(x)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        losses = []

        def loss_of(h: torch.Tensor) -> torch.Tensor:
            losses.append(hf_loss.fused_loss(h, y, hf_loss.head_shard(self._tap.head), self.loss_path.transform,
                                             where=self._where(), z_loss=self.z_loss))
            return losses[-1]

        logits = self._tap.run(self.lm, x, loss_of)  # empty, but on the loss's autograd path (`HeadTap`)
        return losses[0] + logits.sum()


def _agreed(path: LossPath, lm: nn.Module) -> LossPath:
    """``path`` if every rank of the job took the fused path or none did; else the gathered path on
    every rank (a proof within its tolerance on one rank and not on another), saying so."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return path
    device = next((p.device for p in lm.parameters() if p.device.type != "meta"), torch.device("cpu"))
    every = comm.all_reduce_(torch.tensor([float(path.fused)], device=device), dist.group.WORLD, op=dist.ReduceOp.MIN)
    if path.fused and not bool(every.item()):
        return LossPath(False, path.transform, "another rank's probe did not prove the fused loss")
    return path
