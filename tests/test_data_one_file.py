"""A corpus of one file of one's own (``data=files data.path=FILE``), as a new user brings it: it
trains at every ``data.val_fraction`` in (0, 1), whatever the hash of its name says, or the launch
stops with one line that says why, before any directory exists where the file sizes tell.

The file is 50 JSON records (about 7 kB). Its held-out tail is cut between lines at
``1 - val_fraction`` of the text; a split shorter than one window (``data.seq_len + 1`` tokens)
takes what it lacks from the other side of the cut, so both splits hold a window and no token is
in both: the two token streams, end-of-text marks removed, decode to the file itself.
"""
import json
import os
import random
import re
import subprocess
import sys

import pytest

import bigdense as bd
from bigdense.config import ConfigError, DataConfig
from bigdense.data import EOT, prepare_data
from bigdense.data.corpus import held_out_share
from bigdense.testing import run_ranks
from helpers import TRAIN

SEQ_LEN = 64
WORDS = "the quick brown fox jumps over lazy dog alpha beta gamma delta records sample notes".split()


@pytest.fixture
def records(tmp_path):
    rng = random.Random(0)
    path = tmp_path / "notes.txt"
    path.write_text("".join(json.dumps({"id": i, "text": " ".join(rng.choices(WORDS, k=20))}) + "\n"
                            for i in range(50)))
    return path


def _cfg(path, tmp_path, **kw):
    return DataConfig(**{**dict(source="files", path=str(path), pattern="**/*.txt", vocab_size=300, seq_len=SEQ_LEN,
                                micro_batch_size=2, val_fraction=0.02, cache_dir=str(tmp_path / "cache")), **kw})


def test_one_file_trains_at_every_held_out_share(records, tmp_path):
    share = held_out_share(records.name)  # below val_fraction, the hash alone would hold the file out
    text = records.read_text()
    for val_fraction in (1e-6, 0.02, 0.3, share - 1e-3, share + 1e-3, 0.97, 1 - 1e-6):
        data = prepare_data(_cfg(records, tmp_path, val_fraction=val_fraction))
        train, val = data.train_tokens.tolist(), data.val_tokens.tolist()
        assert min(len(train), len(val)) >= SEQ_LEN + 1, (val_fraction, len(train), len(val))
        assert data.tokenizer.decode(train + val).replace(EOT, "") == text, val_fraction
        data.train_batch(0), data.val_batches(1)
        if 0.02 < val_fraction < 0.97:  # a window on each side anyway: the share is the one asked for
            assert abs(len(val) / (len(train) + len(val)) - val_fraction) < 0.05, (val_fraction, len(val))


def test_a_file_too_short_for_two_windows_says_so_in_one_line(records, tmp_path):
    short = tmp_path / "short.txt"
    # 100 bytes: too few for two windows of 65 tokens whatever the tokenizer, known before anything is read.
    short.write_text(records.read_text()[:100])
    with pytest.raises(ConfigError) as err:
        prepare_data(_cfg(short, tmp_path))
    assert str(err.value) == (f"data.path='{short}': 1 file(s) of 100 bytes in all, too little text for two windows "
                              "of data.seq_len + 1 = 65 tokens (one to train on, one held out; a token holds a byte at "
                              "least): lower data.seq_len, or give more text (data.path, data.max_corpus_mb)")
    # 400 bytes could hold them; their tokens do not (a vocabulary that merges whole words), which is
    # known once they are tokenised.
    short.write_text(records.read_text()[:400])
    with pytest.raises(ConfigError) as err:
        prepare_data(_cfg(short, tmp_path, vocab_size=1000))
    said = re.fullmatch(r"the corpus holds (\d+) tokens \((\d+) to train on, (\d+) held out\), fewer than two windows "
                        r"of data\.seq_len \+ 1 = 65 \(one to train on, one held out\): lower data\.seq_len, or give "
                        r"more text \(data\.path, data\.max_corpus_mb\)", str(err.value))
    assert said, str(err.value)
    tokens, train, val = map(int, said.groups())
    assert tokens == train + val < 2 * 65 and val > 0


def test_text_that_is_not_utf8_is_named(tmp_path, records):
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(("café au lait = 1\n" * 40).encode("latin-1"))
    with pytest.raises(ConfigError, match=rf"^no text to train on in {latin}: latin1.txt is not UTF-8\. Give UTF-8 "
                                          r"text \(data\.path, data\.pattern\)$"):
        prepare_data(_cfg(latin, tmp_path))
    # Beside a file that decodes, it is skipped, and the one left is split within.
    both = tmp_path / "both"
    both.mkdir()
    latin.rename(both / "latin1.txt")
    records.rename(both / "notes.txt")
    data = prepare_data(_cfg(both, tmp_path, val_fraction=0.3))
    assert data.manifest["skipped"] == ["latin1.txt"]
    assert data.tokenizer.decode(data.train_tokens.tolist() + data.val_tokens.tolist()).replace(EOT, "") == \
        (both / "notes.txt").read_text()


def _prepare_on_rank(cfg):
    bd.init_parallel(tp=1)  # two DP ranks: rank 0 builds, rank 1 waits for it
    try:
        prepare_data(cfg)
    except Exception as e:  # noqa: BLE001 - what each rank ends with is what the test checks
        return type(e).__name__, str(e)


def test_every_rank_ends_with_the_builders_one_line(tmp_path):
    # Found by rank 0 as it reads the text: the waiting rank raises the same ConfigError, so a
    # launch prints one line (rank 0's), not a peer's traceback.
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(("café au lait = 1\n" * 40).encode("latin-1"))
    said = run_ranks(_prepare_on_rank, 2, _cfg(latin, tmp_path), timeout=120)
    assert said[0] == said[1] == ("ConfigError", f"no text to train on in {latin}: latin1.txt is not UTF-8. Give "
                                                 "UTF-8 text (data.path, data.pattern)"), said


def _launch(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, TRAIN, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.slow  # two launches of launch/train.py
def test_a_launch_on_one_file_trains_or_stops_in_one_line_before_any_directory(records, tmp_path):
    tiny = ["model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.head_chunk_size=64",
            "data.vocab_size=300", f"data.seq_len={SEQ_LEN}", "data.micro_batch_size=2", "trainer.max_steps=2",
            "trainer.eval_batches=1", "trainer.log_interval=1", "trainer.progress_bar=false", "trainer.plot=false",
            f"data.cache_dir={tmp_path / 'cache'}"]
    # The case of the report: the held-out share above the file's name hash (the whole file held out, once).
    work = tmp_path / "work"
    work.mkdir()
    above = f"data.val_fraction={held_out_share(records.name) + 0.01:.4f}"
    code, out = _launch(["data=files", f"data.path={records}", above, *tiny], work)
    assert code == 0 and "Traceback" not in out, out
    assert "held-out loss" in out
    # Too little text: one line, exit 2, no run directory.
    short = tmp_path / "short.txt"
    short.write_text(records.read_text()[:100])
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out = _launch(["data=files", f"data.path={short}", *tiny], empty)
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 2 and lines == [f"bigdense: bad config: data.path='{short}': 1 file(s) of 100 bytes in all, too "
                                   "little text for two windows of data.seq_len + 1 = 65 tokens (one to train on, one "
                                   "held out; a token holds a byte at least): lower data.seq_len, or give more text "
                                   "(data.path, data.max_corpus_mb)"], out
    assert list(empty.iterdir()) == []
