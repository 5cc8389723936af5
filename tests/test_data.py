"""The data pipeline: corpus split by file, cached BPE and token arrays, step-addressed batches."""
import json
import random
import re
import shutil

import numpy as np
import pytest
import torch

import bigdense as bd
from bigdense.config import ConfigError, DataConfig
from bigdense.data.corpus import held_out_share
from bigdense.data import EOT, BatchSampler, eval_batches, list_files, prepare_data, read_corpus, split_files
from bigdense.data import cache as data_cache
from bigdense.data.tokenizer import BPETokenizer, token_dtype
from bigdense.testing import run_ranks

WORDS = "def return class import self value index token layer shard weight tensor bias grad".split()


def _text(name: str, n_lines: int, rng: random.Random) -> str:
    # A marker unique to the file, to find out which split its text went to.
    lines = [f"# file MARK{name.replace('/', '_').replace('.', '_')}END"]
    for _ in range(n_lines):
        indent = " " * (4 * rng.randrange(3))
        lines.append(indent + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(2, 8))) + f" = {rng.randrange(1000)}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def corpus_dir(tmp_path):
    rng = random.Random(0)
    root = tmp_path / "corpus"
    for i in range(14):
        rel = f"pkg{i % 3}/mod{i:02d}.txt" if i % 2 else f"top{i:02d}.txt"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(_text(rel, 120, rng))
    (root / "pkg0" / "latin1.txt").write_bytes("caf\xe9 = 1\n".encode("latin-1"))  # not UTF-8: skipped
    (root / "pkg0" / "other.md").write_text("not matched by the pattern\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "third_party.txt").write_text("never read\n")
    return root


def _cfg(corpus_dir, tmp_path, **kw):
    base = dict(source="files", path=str(corpus_dir), pattern="**/*.txt", vocab_size=300, seq_len=16,
                micro_batch_size=4, val_fraction=0.2, cache_dir=str(tmp_path / "cache"))
    base.update(kw)
    return DataConfig(**base)


# ---- corpus ---------------------------------------------------------------------------------------

def test_files_are_listed_sorted_matching_the_pattern_without_site_packages(corpus_dir):
    root, files = list_files("files", str(corpus_dir), "**/*.txt", 24.0)
    rels = [f.rel for f in files]
    assert rels == sorted(rels) and len(rels) == 15
    assert "top00.txt" in rels and "pkg1/mod01.txt" in rels  # "**" matches zero directories too
    assert not any("site-packages" in r or r.endswith(".md") for r in rels)
    assert all(f.take == f.size for f in files)


def test_max_corpus_mb_cuts_the_sorted_list_and_the_last_file_at_a_line_end(corpus_dir):
    _, every = list_files("files", str(corpus_dir), "**/*.txt", 24.0)
    limit = every[0].size + every[1].size + 100
    _, files = list_files("files", str(corpus_dir), "**/*.txt", limit / 1e6)
    assert [f.rel for f in files] == [f.rel for f in every[:3]]
    assert sum(f.take for f in files) == limit and files[2].take == 100
    texts = read_corpus(files, 0.5)
    cut = [t for t in texts.train + texts.val if "MARK" + files[2].rel.replace("/", "_").replace(".", "_") in t]
    assert len(cut) == 1 and len(cut[0].encode()) <= 100 and cut[0].endswith("\n")


def test_split_is_by_file_and_held_out_text_never_reaches_training(corpus_dir, tmp_path):
    _, files = list_files("files", str(corpus_dir), "**/*.txt", 24.0)
    train, val = split_files(files, 0.2)
    assert train and val and not {f.rel for f in train} & {f.rel for f in val}
    assert {f.rel for f in train} | {f.rel for f in val} == {f.rel for f in files}
    # A file's side depends on its own path only (so it does not move when other files come or go).
    held = {f.rel for f in files if held_out_share(f.rel) < 0.2}
    assert held and {f.rel for f in val} == held
    # A side the hash leaves empty gets one file.
    assert len(split_files(files, 1e-9)[1]) == 1 and len(split_files(files, 1 - 1e-9)[0]) == 1

    data = prepare_data(_cfg(corpus_dir, tmp_path))
    train_text = data.tokenizer.decode(data.train_tokens.tolist())
    val_text = data.tokenizer.decode(data.val_tokens.tolist())
    for f in files:
        if f.rel == "pkg0/latin1.txt":
            assert "caf" not in train_text + val_text
            continue
        mark = "MARK" + f.rel.replace("/", "_").replace(".", "_") + "END"
        in_val = f in val
        assert (mark in val_text) == in_val and (mark in train_text) != in_val, f.rel
    assert data.manifest["skipped"] == ["pkg0/latin1.txt"]


def test_a_single_file_holds_out_its_tail(corpus_dir, tmp_path):
    one = corpus_dir / "top00.txt"
    data = prepare_data(_cfg(one, tmp_path, val_fraction=0.25))
    text = one.read_text()
    train = data.tokenizer.decode(data.train_tokens.tolist())
    val = data.tokenizer.decode(data.val_tokens.tolist())
    assert train.endswith(EOT) and val.endswith(EOT)
    train, val = train[: -len(EOT)], val[: -len(EOT)]
    assert train + val == text and train.endswith("\n")  # cut between lines
    assert 0.15 < len(val) / len(text) < 0.35


# ---- tokenizer ------------------------------------------------------------------------------------

def test_encode_decode_round_trip_and_token_arrays(corpus_dir, tmp_path):
    data = prepare_data(_cfg(corpus_dir, tmp_path))
    tok = data.tokenizer
    assert tok.vocab_size == 300 and tok.trained_vocab_size <= 300
    for s in ["", "def f(x):\n\treturn x  # ok\n", "  leading spaces", "naïve café — 東京 🙂\r\n", "\x00\x7f"]:
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert all(0 <= i < tok.trained_vocab_size for i in ids)
    assert len(tok.encode("index token layer index token layer")) < len("index token layer index token layer")
    assert data.train_tokens.dtype == np.uint16 and isinstance(data.train_tokens, np.memmap)
    assert not data.train_tokens.flags.writeable
    # The stream is each document followed by EOT, nothing more.
    corpus = read_corpus(list_files("files", str(corpus_dir), "**/*.txt", 24.0)[1], 0.2)
    assert tok.decode(data.train_tokens.tolist()) == "".join(t + EOT for t in corpus.train)
    assert int((data.train_tokens == tok.eot_id).sum()) == len(corpus.train)


def test_token_dtype():
    assert token_dtype(300) == np.uint16 and token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


# ---- cache ----------------------------------------------------------------------------------------

def test_second_call_reuses_the_cache_without_training(corpus_dir, tmp_path, monkeypatch, caplog):
    cfg = _cfg(corpus_dir, tmp_path)
    with caplog.at_level("INFO", logger="bigdense"):
        first = prepare_data(cfg)
    assert first.built and first.cache_path.parent == tmp_path / "cache" / "data"
    # The first use says what it builds and how long that takes, before the silence.
    announce = [r.getMessage() for r in caplog.records if "first use of this corpus" in r.getMessage()]
    assert len(announce) == 1 and "300-entry byte-level BPE" in announce[0], caplog.text
    assert re.search(r"this takes \d+-\d+ s", announce[0]) and str(first.cache_path) in announce[0]
    caplog.clear()

    def no_training(*a, **k):
        raise AssertionError("the tokenizer was trained again")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    second = prepare_data(cfg)
    assert not second.built and second.cache_path == first.cache_path
    assert np.array_equal(second.train_tokens, first.train_tokens)
    assert np.array_equal(second.val_tokens, first.val_tokens)
    assert "loaded" in second.describe() and str(second.cache_path) in second.describe()
    assert [p.name for p in (tmp_path / "cache" / "data").iterdir()] == [first.cache_path.name]
    assert "first use" not in caplog.text


def test_anything_that_changes_the_result_changes_the_cache_folder(corpus_dir, tmp_path):
    base = prepare_data(_cfg(corpus_dir, tmp_path)).cache_path
    assert prepare_data(_cfg(corpus_dir, tmp_path, vocab_size=320)).cache_path != base
    assert prepare_data(_cfg(corpus_dir, tmp_path, val_fraction=0.3)).cache_path != base
    # seq_len and batch size only shape the batches: same cache.
    assert prepare_data(_cfg(corpus_dir, tmp_path, seq_len=8, micro_batch_size=2)).cache_path == base
    with open(corpus_dir / "top00.txt", "a") as fh:
        fh.write("appended = 1\n")
    assert prepare_data(_cfg(corpus_dir, tmp_path)).cache_path != base


def test_a_models_own_tokenizer_encodes_the_corpus_with_its_own_end_token_cached_per_tokenizer(
        corpus_dir, tmp_path, monkeypatch):
    # A fine-tuned model's tokenizer.json (model=hf): never trained again, documents end with its
    # end-of-sequence token, ids up to the model's vocabulary, one cache folder per tokenizer file.
    from bigdense.data import TokenizerFile

    trained = BPETokenizer.train(["def f(x):\n    return x\n"] * 20, 300)
    trained._tok.add_special_tokens(["</s>"])
    trained.save(tmp_path / "tokenizer.json")
    monkeypatch.setattr(BPETokenizer, "train", lambda *a, **k: pytest.fail("the model's tokenizer was not used"))
    own = TokenizerFile(tmp_path / "tokenizer.json", "</s>", 1000)
    data = prepare_data(_cfg(corpus_dir, tmp_path), tokenizer=own)
    eos = data.tokenizer.eot_id
    assert data.tokenizer.vocab_size == 1000 and data.tokenizer.eot == "</s>"
    assert eos == trained._tok.token_to_id("</s>") != trained.eot_id
    assert data.train_tokens.max() == eos and "tokenizer.json" in data.describe()
    trained._tok.add_special_tokens(["<extra>"])
    trained.save(tmp_path / "tokenizer.json")
    assert prepare_data(_cfg(corpus_dir, tmp_path), tokenizer=own).cache_path != data.cache_path


def test_an_interrupted_build_leaves_nothing_that_loads(corpus_dir, tmp_path, monkeypatch):
    cfg = _cfg(corpus_dir, tmp_path)
    real_save = np.save

    def dies_on_val(path, arr, *a, **k):
        if str(path).endswith("val.npy"):
            raise KeyboardInterrupt  # as if the job were killed mid-write
        return real_save(path, arr, *a, **k)

    monkeypatch.setattr(data_cache.np, "save", dies_on_val)
    with pytest.raises(KeyboardInterrupt):
        prepare_data(cfg)
    data_dir = tmp_path / "cache" / "data"
    assert not [p for p in data_dir.iterdir() if not p.name.startswith(".")]
    monkeypatch.setattr(data_cache.np, "save", real_save)
    assert prepare_data(cfg).built


def test_leftover_temporary_and_broken_folders_are_ignored(corpus_dir, tmp_path):
    cfg = _cfg(corpus_dir, tmp_path)
    good = prepare_data(cfg)
    reference = np.array(good.train_tokens)
    # What a killed build leaves behind: a complete-looking temporary folder with wrong contents.
    leftover = good.cache_path.with_name(f".{good.cache_path.name}.partial-1-dead")
    shutil.copytree(good.cache_path, leftover)
    np.save(leftover / "train.npy", np.zeros(len(reference), np.uint16))
    shutil.rmtree(good.cache_path)
    rebuilt = prepare_data(cfg)
    assert rebuilt.built and np.array_equal(rebuilt.train_tokens, reference)
    # A final folder that is inconsistent (truncated array) is rebuilt, not loaded.
    np.save(good.cache_path / "train.npy", reference[:10])
    again = prepare_data(cfg)
    assert again.built and np.array_equal(again.train_tokens, reference)
    manifest = json.loads((good.cache_path / "manifest.json").read_text())
    assert manifest["train_tokens"] == len(reference)


# ---- batches --------------------------------------------------------------------------------------

def test_batches_are_a_pure_function_of_the_step_and_y_is_x_shifted():
    tokens = np.arange(5000, dtype=np.uint16)  # every value is its own position
    s = BatchSampler(tokens, seq_len=16, micro_batch_size=4, seed=7)
    x, y = s.batch(3, 1, 0, 1)
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
    assert torch.equal(x, x[:, :1] + torch.arange(16))  # contiguous windows of the stream
    torch.manual_seed(0)
    state = torch.get_rng_state()
    again = BatchSampler(tokens, 16, 4, seed=7).batch(3, 1, 0, 1)
    assert torch.equal(torch.get_rng_state(), state)  # the default generator is untouched
    assert torch.equal(again[0], x) and torch.equal(again[1], y)
    for other in [s.batch(4, 1, 0, 1), s.batch(3, 0, 0, 1), BatchSampler(tokens, 16, 4, seed=8).batch(3, 1, 0, 1)]:
        assert not torch.equal(other[0], x)
    short = BatchSampler(np.arange(40, dtype=np.uint16), 16, 4, seed=7)
    every_start = np.concatenate([short.global_starts(step, 0, 1) for step in range(100)])
    assert set(every_start.tolist()) == set(range(40 - 16))  # every window, the last one too, and no other


def test_dp_slices_together_are_the_dp1_batch_of_the_same_global_size():
    tokens = np.arange(5000, dtype=np.uint16)
    for step, micro in [(0, 0), (5, 2)]:
        whole = BatchSampler(tokens, 16, 8, seed=3).batch(step, micro, 0, 1)
        halves = [BatchSampler(tokens, 16, 4, seed=3).batch(step, micro, r, 2) for r in range(2)]
        quarters = [BatchSampler(tokens, 16, 2, seed=3).batch(step, micro, r, 4) for r in range(4)]
        for parts in (halves, quarters):
            assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
            assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])
    with pytest.raises(ValueError, match="dp_rank"):
        BatchSampler(tokens, 16, 4, seed=3).batch(0, 0, 2, 2)


def test_val_batches_are_fixed_spread_and_sliced_like_training():
    tokens = np.arange(3000, dtype=np.uint16)
    one = eval_batches(tokens, 5, 16, 8, 0, 1)
    assert len(one) == 5 and all(x.shape == (8, 16) for x, _ in one)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, eval_batches(tokens, 5, 16, 8, 0, 1)))
    starts = torch.cat([x[:, 0] for x, _ in one])
    assert len(set(starts.tolist())) == 40 and bool((starts.diff() >= 16).all())  # no overlap
    assert starts.max() > len(tokens) * 0.9  # spread to the end of the split
    halves = [eval_batches(tokens, 5, 16, 4, r, 2) for r in range(2)]
    for i in range(5):
        assert torch.equal(torch.cat([halves[0][i][0], halves[1][i][0]]), one[i][0])
        assert torch.equal(torch.cat([halves[0][i][1], halves[1][i][1]]), one[i][1])


def test_data_object_batches_and_describe(corpus_dir, tmp_path):
    data = prepare_data(_cfg(corpus_dir, tmp_path), seed=11)
    x, y = data.train_batch(2, 0)
    assert x.shape == (4, 16) and torch.equal(y[:, :-1], x[:, 1:])
    assert int(x.max()) < data.tokenizer.vocab_size
    assert torch.equal(data.train_batch(2, 0)[0], x) and not torch.equal(data.train_batch(3, 0)[0], x)
    vals = data.val_batches(3)
    assert len(vals) == 3 and vals[0][0].shape == (4, 16)
    assert data.batch_rows(1, 2) == (4, 8)
    text = data.describe()
    assert "15 files" in text and "vocab 300" in text and "built in" in text


# ---- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw,match", [
    (dict(path="/nonexistent/bigdense-data"), r"data\.path='/nonexistent/bigdense-data' does not exist"),
    (dict(path=None), r"data\.source=files needs data\.path"),
    (dict(source="web"), r"data\.source='web'"),
    (dict(pattern="**/*.nothing"), r"data\.path=.*no non-empty file matches data\.pattern"),
    (dict(vocab_size=100), r"data\.vocab_size must be in \[257"),
    (dict(val_fraction=0.0), r"data\.val_fraction"),
    (dict(seq_len=100000), r"too little text for two windows of data\.seq_len \+ 1 = 100001 tokens"),
    (dict(seq_len=30000), r"the corpus holds [\d,]+ tokens .*, fewer than two windows of data\.seq_len \+ 1"),
])
def test_clear_errors_name_the_config_key(corpus_dir, tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        prepare_data(_cfg(corpus_dir, tmp_path, **kw)).val_batches(1)


# ---- the standard library -------------------------------------------------------------------------

def test_a_small_slice_of_the_standard_library(tmp_path):
    cfg = DataConfig(source="stdlib", max_corpus_mb=0.3, vocab_size=512, seq_len=32, micro_batch_size=2,
                     val_fraction=0.1, cache_dir=str(tmp_path))
    root, files = list_files(cfg.source, cfg.path, cfg.pattern, cfg.max_corpus_mb)
    assert (root / "os.py").is_file() and all(f.rel.endswith(".py") for f in files)
    data = prepare_data(cfg)
    assert data.manifest["files"] == len(files) and 0.25e6 < data.manifest["bytes"] <= 0.3e6
    assert data.cache_path.name.startswith("stdlib-") and data.cache_path.parent.parent == tmp_path
    assert len(data.val_tokens) > 0 and data.tokenizer.trained_vocab_size == 512
    sample = (root / files[0].rel).read_text()[:500]
    assert data.tokenizer.decode(data.tokenizer.encode(sample)) == sample
    x, _ = data.train_batch(0)
    assert x.shape == (2, 32)


# ---- several ranks --------------------------------------------------------------------------------

def _prepare_on_rank(cfg, fail_on_rank0):
    ctx = bd.init_parallel(tp=1)
    if fail_on_rank0 and ctx.rank == 0:
        def broken(*a, **k):
            raise OSError("disk full")
        data_cache.build = broken
    try:
        data = prepare_data(cfg, ctx, seed=5)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    x, y = data.train_batch(1, 0)
    return data.built, str(data.cache_path), x, y, np.asarray(data.train_tokens).sum()


def test_only_the_main_rank_builds_and_dp_ranks_split_the_global_batch(corpus_dir, tmp_path):
    cfg = _cfg(corpus_dir, tmp_path)
    out = run_ranks(_prepare_on_rank, 2, cfg, False, timeout=120)
    assert [o[0] for o in out] == [True, False]
    assert out[0][1] == out[1][1] and out[0][4] == out[1][4]
    whole = prepare_data(_cfg(corpus_dir, tmp_path, micro_batch_size=8), seed=5).train_batch(1, 0, 0, 1)
    assert torch.equal(torch.cat([out[0][2], out[1][2]]), whole[0])
    assert torch.equal(torch.cat([out[0][3], out[1][3]]), whole[1])


def test_a_failed_build_stops_every_rank(corpus_dir, tmp_path):
    out = run_ranks(_prepare_on_rank, 2, _cfg(corpus_dir, tmp_path), True, timeout=120)
    assert out[0] == "OSError: disk full"
    assert out[1].startswith("RuntimeError: data preparation failed on another rank: rank 0: OSError: disk full")
    assert not (tmp_path / "cache" / "data").exists() or not list((tmp_path / "cache" / "data").iterdir())
