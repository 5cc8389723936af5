"""Text from a trained reference GPT, as nanoGPT's ``sample.py`` writes it, at any TP size.

    python -m bigdense.sample RUN_DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K] [--seed S]
    torchrun --standalone --nproc_per_node=2 -m bigdense.sample RUN_DIR --prompt TEXT    # tp=2

RUN_DIR is a run of ``launch/train.py`` (its latest checkpoint), its ``checkpoints/`` or ``latest``,
or one checkpoint directory. The model is built from the config its checkpoint records and loaded
at this launch's layout (every process a TP rank), in fp32, in eval mode; the tokenizer is the
run's (its data group's, from the data cache, built again the same way if the cache is gone).

Each new token comes from the sharded head's ``predict`` on the last position: the global top-k
candidates, gathered without the logits. ``--temperature 0`` takes the likeliest; otherwise a token
is drawn from the softmax of the ``--top-k`` candidates' logits divided by the temperature, by a
generator seeded with ``--seed`` alike on every rank, the candidates taken in order of token id. So
every TP size writes the same text for the same seed (up to logits equal within fp32 rounding).
``--top-k 0`` draws from the whole vocabulary (every rank's shard of the last position's logits
gathered). Ids the tokenizer never produces (a vocabulary larger than the corpus filled) are never
drawn. The context is the last ``data.seq_len`` tokens (the length the run trained on), run whole
for every token (no cache of keys and values, as in nanoGPT). A fine-tuned Hugging Face model
(``model=hf``) is refused: export it (``python -m bigdense.export_hf``) and use transformers'
``generate`` (docs/training.md).
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from .checkpoint.format import CheckpointError, read_manifest, resolve_checkpoint
from .compress.measure import load_reference_gpt
from .data import prepare_data

# nanoGPT's sample.py's defaults, but for the length (a CPU writes 200 tokens of the reference GPT in seconds).
DEFAULTS = dict(tokens=200, temperature=0.8, top_k=200, seed=1337)
HF_REFUSAL = ("is a fine-tuned Hugging Face model (model=hf): write it back with `python -m bigdense.export_hf "
              "RUN_DIR OUT` and generate with transformers (`model.generate`), as docs/training.md shows")


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bigdense.sample", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run directory of launch/train.py, its checkpoints/ or latest, or a checkpoint")
    parser.add_argument("--prompt", default="", help="the text to continue (default: none, a new document)")
    parser.add_argument("--tokens", type=int, default=DEFAULTS["tokens"], help="how many tokens to write")
    parser.add_argument("--temperature", type=float, default=DEFAULTS["temperature"],
                        help="divides the logits before the softmax; 0: the likeliest token each time")
    parser.add_argument("--top-k", type=int, default=DEFAULTS["top_k"],
                        help=f"draw among the K likeliest tokens (default {DEFAULTS['top_k']}); 0: all of them")
    parser.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="the draws' seed, the same on every rank")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        parser.error(f"--top-k must be >= 0, got {args.top_k}")
    return args


class TrainedRun(NamedTuple):
    """What `load_run` found: the model, its tokenizer, the checkpoint and its step, and the
    context length the run trained on (``data.seq_len``: later positions were never trained)."""

    model: torch.nn.Module
    tokenizer: object
    checkpoint: Path
    step: int
    context: int


def load_run(source, ctx) -> TrainedRun:
    """A `launch/train.py` run: its reference GPT built from the recorded config and loaded at
    ``ctx``'s layout (`load_reference_gpt`), and its tokenizer."""
    checkpoint = resolve_checkpoint(source)
    saved = read_manifest(checkpoint).get("config") or {}
    name = (saved.get("model") or {}).get("name")
    if name == "hf":
        raise ValueError(f"{checkpoint} {HF_REFUSAL}")
    if name != "gpt":
        raise ValueError(f"{checkpoint} holds no reference GPT of launch/train.py (its recorded model.name is "
                         f"{name!r}): bigdense.sample writes text with a language model")
    model, cfg, step = load_reference_gpt(checkpoint, ctx)
    model.eval()
    tokenizer = prepare_data(cfg.data, ctx, seed=cfg.trainer.seed).tokenizer
    return TrainedRun(model, tokenizer, checkpoint, step, min(int(cfg.data.seq_len), model.cfg.max_seq_len))


@torch.no_grad()
def next_token(model, context: torch.Tensor, known: int, temperature: float, top_k: int,
               generator: torch.Generator) -> int:
    """The token after ``context`` (1-D ids): the likeliest at ``temperature`` 0, else drawn from the
    softmax of the ``top_k`` likeliest (0: all) divided by ``temperature``; ids >= ``known`` never."""
    vocab = model.cfg.vocab_size
    want = 1 if temperature == 0 else (top_k or vocab)
    h = model.hidden(context[None])
    if not model.cfg.sequence_parallel:  # under SP `predict` gathers the sequence: all positions go in
        h = h[:, -1:]
    # Enough candidates that ``want`` remain once ids the tokenizer never produces are dropped.
    values, ids = model.head.predict(h, min(vocab, want + vocab - known))
    # The last position's, likeliest first; on the host, where the seeded generator draws.
    values, ids = values[0, -1].cpu(), ids[0, -1].cpu()
    usable = ids < known
    values, ids = values[usable][:want], ids[usable][:want]
    if temperature == 0:
        return int(ids[0])
    order = ids.argsort()  # by id: an order that does not depend on the logits' last bits, so on the layout
    cumulative = torch.softmax(values[order].double() / temperature, dim=0).cumsum(0)
    draw = torch.rand((), dtype=torch.float64, generator=generator)
    pick = min(int(torch.searchsorted(cumulative, draw, right=True)), len(order) - 1)
    return int(ids[order][pick])


def sample(run: TrainedRun, prompt: str, tokens: int, temperature: float, top_k: int, seed: int) -> str:
    """``tokens`` new tokens after ``prompt`` (none: after an end-of-text, as a new document),
    decoded; each sees the last ``run.context`` tokens."""
    device = next(run.model.parameters()).device
    ids = run.tokenizer.encode(prompt) or [run.tokenizer.eot_id]
    generator = torch.Generator().manual_seed(seed)
    new = []
    for _ in range(tokens):
        context = torch.tensor((ids + new)[-run.context:], dtype=torch.long, device=device)
        new.append(next_token(run.model, context, run.tokenizer.trained_vocab_size, temperature, top_k, generator))
    return run.tokenizer.decode(new)


def main(argv=None) -> int:
    from . import destroy_parallel, init_parallel
    from .jobs.setup import launcher_world

    args = parse(sys.argv[1:] if argv is None else argv)
    rank, world = launcher_world()
    if rank == 0:  # what it loads, or builds when the data cache is gone, on stderr; the text alone on stdout
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        ctx = init_parallel(tp=world)
        run = load_run(args.run, ctx)
        text = sample(run, args.prompt, args.tokens, args.temperature, args.top_k, args.seed)
    except (ValueError, CheckpointError) as err:
        if rank == 0:
            print(f"bigdense.sample: {err}", file=sys.stderr)
        return 2
    if ctx.is_main:
        print(f"bigdense.sample: {run.checkpoint} (step {run.step}) at tp={ctx.tp_size}: {args.tokens} tokens, "
              f"temperature {args.temperature:g}, top-k {args.top_k or 'all'}, seed {args.seed}", file=sys.stderr)
        print(args.prompt + text)
    destroy_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
