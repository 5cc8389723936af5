"""`python -m bigdense.sample`: text from a trained run's reference GPT, at any TP size.

The next token is held to a draw written here on the full logits of an independent plain-PyTorch
GPT (`helpers.plain_gpt_hidden` on the gathered weights, `torch.topk` over the whole vocabulary):
the likeliest at temperature 0, else the inverse-CDF draw over the top-k ordered by id with the
same seeded generator. The sharded path (`predict`'s gathered candidates) must pick the same id at
tp 1, 2 and 3; the logits differ by float rounding only, far below the gaps between the draws'
boundaries at these seeds. The command itself runs on a checkpoint saved here (one process) and,
end to end, on a run of `make train` at tp=1 and tp=2, which must write the same text.
"""
import os
import subprocess
import sys

import pytest
import torch

import bigdense as bd
from bigdense.models import GPT, GPTConfig
from bigdense.sample import HF_REFUSAL, main, next_token
from bigdense.testing import run_ranks
from helpers import BIN, ROOT, TRAIN, full_params, plain_gpt_hidden

VOCAB = 203  # uneven over 2 and 3 ranks
SETTINGS = [  # (temperature, top_k, ids the tokenizer produces)
    (0.0, 0, VOCAB), (0.8, 5, VOCAB), (1.3, 0, VOCAB), (0.8, 20, 150), (0.0, 0, 150),
]
TIMEOUT = 300


def plain_next(logits: torch.Tensor, temperature: float, top_k: int, known: int, generator) -> int:
    """The reference draw on one position's full logits."""
    logits = logits[:known].double()
    if temperature == 0:
        return int(logits.argmax())
    top = torch.topk(logits, top_k or known).indices.sort().values
    probs = torch.softmax(logits[top] / temperature, dim=0)
    u = torch.rand((), dtype=torch.float64, generator=generator)
    return int(top[min(int((probs.cumsum(0) <= u).sum()), len(top) - 1)])


def _draws(tp):
    ctx = bd.init_parallel(tp=tp)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, d_model=36, n_layers=2, n_heads=6, max_seq_len=16, head_chunk_size=7)
    model = GPT(cfg, tp_group=ctx.tp_group).eval()
    weights = {k: v.detach() for k, v in full_params(model, ctx.tp_group).items()}
    contexts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (1, 5, 16)]
    ours, plain = [], []
    for temperature, top_k, known in SETTINGS:
        g_ours, g_plain = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        for context in contexts * 3:
            ours.append(next_token(model, context, known, temperature, top_k, g_ours))
            with torch.no_grad():
                h = plain_gpt_hidden(weights, cfg, context[None], eps=model.ln_f.eps)[0, -1]
            plain.append(plain_next(h @ weights["tok_emb.weight"].T, temperature, top_k, known, g_plain))
    return ours, plain


def test_the_next_token_is_the_plain_draw_from_the_full_logits_at_every_tp_size():
    results = [_draws(1), *run_ranks(_draws, 2, 2), *run_ranks(_draws, 3, 3)]
    reference = results[0][1]
    assert len(set(reference)) > 5  # the draws differ: a constant pick would pass too easily
    for rank, (ours, plain) in enumerate(results):
        assert plain == reference, rank  # the reference does not depend on the layout
        assert ours == reference, rank


def _saved_run(tmp_path, small, model_name="gpt"):
    """A checkpoint as launch/train.py writes one (the config recorded), of an untrained GPT."""
    from bigdense.jobs import build_gpt
    from bigdense.plan.__main__ import DEFAULT_CONF, compose

    cfg = compose(small, DEFAULT_CONF)
    ctx = bd.init_parallel(tp=1)
    model = build_gpt(cfg, cfg.data.vocab_size, ctx)
    cfg.model.name = model_name
    bd.save_checkpoint(tmp_path / "run" / "checkpoints" / "step_0000000", model, step=0, config=cfg)
    bd.destroy_parallel()
    return tmp_path / "run"


def test_the_command_writes_text_after_the_prompt(tmp_path, small, capsys):
    run = _saved_run(tmp_path, small)
    assert main([str(run), "--prompt", "def main(", "--tokens", "12", "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def main(") and len(out) > len("def main(\n"), out
    assert f"{run / 'checkpoints' / 'step_0000000'} (step 0) at tp=1: 12 tokens, temperature 0.8, top-k 200, " \
           "seed 3" in err
    assert main([str(run), "--prompt", "def main(", "--tokens", "12", "--seed", "3"]) == 0
    assert capsys.readouterr().out == out  # the same seed, the same text


def test_a_fine_tuned_hugging_face_run_is_refused_pointing_to_the_export(tmp_path, small, capsys):
    run = _saved_run(tmp_path, small, model_name="hf")
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and HF_REFUSAL in err and "python -m bigdense.export_hf" in err, err


def _run(cmd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout, done.stderr


@pytest.mark.slow  # a torchrun training and two sampling launches
def test_a_run_of_make_train_writes_the_same_text_at_tp1_and_tp2(tmp_path, small):
    run = tmp_path / "run"
    # `make train` is this torchrun line (tp=2), here on the test corpus and for a few steps.
    _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", TRAIN, *small, "trainer.max_steps=6",
          f"trainer.run_dir={run}"])
    args = ["-m", "bigdense.sample", str(run), "--prompt", "import os", "--tokens", "30"]
    one, said_one = _run([sys.executable, *args])
    two, said_two = _run([str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", *args])
    assert one.startswith("import os") and len(one.strip()) > len("import os"), one
    assert two == one
    assert "(step 6) at tp=1" in said_one and "(step 6) at tp=2" in said_two
