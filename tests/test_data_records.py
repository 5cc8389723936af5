"""data=records: the targets of each record shape against what transformers marks, packing, the
order at any layout, bad records, and the fine-tune job against plain transformers.

The model directory is written here (`bigdense.testing.pretrained`: a tiny Llama, a byte-level BPE
with `</s>`, a chat template with {% generation %} markers); so are the records. The targets are
checked token by token against transformers' own ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` and the prompt's length from ``tokenizer(prompt)``: exact.
The job's losses are checked against a loop of plain transformers on the same padded, masked
batches (F.cross_entropy over every counted target of the step): fp32, tensor parallelism changes
the order of the sums only, so 1e-5 relative over three steps (measured: below 1e-6).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import BIN, ROOT, TRAIN
from bigdense.config.schema import DataConfig
from bigdense.data import prepare_data
from bigdense.data.prepare import check_source
from bigdense.errors import ConfigError
from bigdense.models.hf_dir import HFDirectory
from bigdense.testing.pretrained import write_pretrained

SEED = 1234  # trainer.seed's default


class OneRank:
    dp_rank, dp_size = 0, 1


def chat(i: int) -> list[dict]:
    a, b = i % 17, 3 * i % 23
    turns = [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
    if i % 3 == 0:
        turns = [{"role": "system", "content": "Answer in one line."}, *turns,
                 {"role": "user", "content": "And doubled?"}, {"role": "assistant", "content": f"{2 * (a + b)}."}]
    return turns


def pair(i: int) -> dict:
    return {"prompt": f"Translate {i} to words: ", "completion": f"number {i} " * (1 + i % 3)}


def text(i: int) -> dict:
    return {"text": f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 4)}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The model directory and, per record shape, a train source and its held-out records."""
    import datasets

    root = tmp_path_factory.mktemp("records")
    model = write_pretrained(root / "model")
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": chat(i)}) + "\n" for i in range(40)))
    (root / "chats_val.jsonl").write_text("".join(json.dumps({"messages": chat(i)}) + "\n" for i in range(40, 46)))
    datasets.Dataset.from_list([pair(i) for i in range(40)]).to_parquet(str(root / "pairs.parquet"))
    datasets.Dataset.from_list([pair(i) for i in range(40, 46)]).to_parquet(str(root / "pairs_val.parquet"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list([text(i) for i in range(40)]),
                          "validation": datasets.Dataset.from_list([text(i) for i in range(40, 46)])}
                         ).save_to_disk(str(root / "texts"))
    return {
        "model": model, "cache": root / "cache", "root": root,
        "messages": [f"data.path={root / 'chats.jsonl'}", f"data.val_path={root / 'chats_val.jsonl'}"],
        "prompt_completion": [f"data.path={root / 'pairs.parquet'}", f"data.val_path={root / 'pairs_val.parquet'}"],
        "text": [f"data.path={root / 'texts'}"],
    }


def data_config(sources, shape: str, **options) -> DataConfig:
    kv = dict(o.split("=", 1) for o in sources[shape])
    fields = dict(source="records", path=kv["data.path"], val_path=kv.get("data.val_path"), seq_len=96,
                  micro_batch_size=2, cache_dir=str(sources["cache"]))
    return DataConfig(**{**fields, **options})


def expected_example(tok, shape: str, i: int) -> tuple[list[int], list[int]]:
    """Record ``i``'s ids and target flags as transformers gives them (the first token never a target)."""
    if shape == "messages":
        out = tok.apply_chat_template(chat(i), tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    elif shape == "prompt_completion":
        p = tok(pair(i)["prompt"])["input_ids"]
        c = tok(pair(i)["completion"], add_special_tokens=False)["input_ids"]
        ids, mask = p + c + [tok.eos_token_id], [0] * len(p) + [1] * (len(c) + 1)
    else:
        ids = tok(text(i)["text"])["input_ids"] + [tok.eos_token_id]
        mask = [1] * len(ids)
    return ids, [0] + mask[1:]


@pytest.mark.parametrize("shape", ["messages", "prompt_completion", "text"])
def test_targets_are_the_tokens_transformers_marks(sources, shape):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sources["model"])
    data = prepare_data(data_config(sources, shape, pack=False), OneRank, seed=SEED,
                        tokenizer=HFDirectory.open(sources["model"]).tokenizer())
    assert data.manifest["shapes"]["train"] == {shape: 40}
    for g in range(data.train.rows_per_epoch(0)):
        (i,) = data.train.examples(g).tolist()
        ids, mask = expected_example(tok, shape, i)
        x, y = data.train.row(g)
        n = len(ids) - 1
        assert x[:n].tolist() == ids[:-1], (shape, i)
        assert y[:n].tolist() == [t if m else -100 for t, m in zip(ids[1:], mask[1:])], (shape, i)
        assert (y[n:] == -100).all()  # the padding


def test_packing_keeps_every_target_and_masks_boundaries(sources):
    tokenizer = HFDirectory.open(sources["model"]).tokenizer()
    packed = prepare_data(data_config(sources, "messages"), OneRank, seed=SEED, tokenizer=tokenizer)
    one_each = prepare_data(data_config(sources, "messages", pack=False), OneRank, seed=SEED, tokenizer=tokenizer)

    def targets(rows):
        return [t for g in range(rows.rows_per_epoch(0)) for t in rows.row(g)[1].tolist() if t != -100]

    assert targets(packed.train) == targets(one_each.train)  # the same examples in the same order
    assert packed.train.rows_per_epoch(0) < one_each.train.rows_per_epoch(0)
    eos = packed.tokenizer.eot_id
    for g in range(packed.train.rows_per_epoch(0)):
        x, y = packed.train.row(g)
        after_eos = np.flatnonzero(x[:-1] == eos) + 1  # where the next example starts
        assert (y[after_eos - 1][x[after_eos] != eos] == -100).all()  # its first token predicted from nothing


def test_rows_follow_the_global_batch_at_any_layout(sources):
    """Steps at dp=1 x 4 rows, dp=2 x 2 rows and grad_accum=2 take the same rows in the same order, so
    a run resumed at another layout continues at the next example."""
    tokenizer = HFDirectory.open(sources["model"]).tokenizer()

    def stream(micro_batch_size, dp, grad_accum, steps):
        data = prepare_data(data_config(sources, "prompt_completion", micro_batch_size=micro_batch_size,
                                         grad_accum=grad_accum), OneRank, seed=SEED, tokenizer=tokenizer)
        return [data.train_batch(s, m, r, dp)[1] for s in steps for m in range(grad_accum) for r in range(dp)]

    whole = torch.cat(stream(4, 1, 1, range(1, 41)))  # 40 steps: past the end of an epoch
    resumed = torch.cat(stream(2, 2, 1, range(1, 21)) + stream(1, 2, 2, range(21, 41)))
    assert torch.equal(whole, resumed)


def write_texts(path: Path, rows: list[dict]) -> None:
    import datasets
    import pyarrow as pa

    table = datasets.Dataset.from_list(rows)
    if path.suffix == ".csv":
        table.to_csv(str(path), index=False)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:  # .arrow: an Arrow IPC stream, what datasets' "arrow" builder reads
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.data.table.schema) as writer:
            writer.write_table(table.data.table)


@pytest.mark.parametrize("suffix", [".csv", ".json", ".arrow"])
def test_csv_json_and_arrow_files_are_read_in_order(sources, tmp_path, suffix):
    rows = [text(i) for i in range(10)]
    write_texts(tmp_path / f"texts{suffix}", rows)
    cfg = data_config(sources, "text", path=str(tmp_path / f"texts{suffix}"), val_path=None, val_fraction=0.2,
                      pack=False)
    data = prepare_data(cfg, OneRank, seed=SEED, tokenizer=HFDirectory.open(sources["model"]).tokenizer())
    assert data.manifest["records"] == {"train": 8, "val": 2}
    held_out = [data.tokenizer.decode(data.val.row(g)[0].tolist()).split(data.tokenizer.eot)[0] for g in range(2)]
    assert held_out == [rows[4]["text"], rows[9]["text"]]  # every fifth record, in file order


BAD = {  # kind: (file name, contents, words the message holds)
    "missing field": ("a.jsonl", ['{"prompt": "p", "completion": "c"}', '{"prompt": "p"}'], ["a.jsonl, line 2", "'completion'", "missing"]),
    "wrong type": ("b.jsonl", ['{"text": "t"}', '{"text": 5}'], ["b.jsonl, line 2", "'text'"]),
    "not JSON": ("c.jsonl", ['{"text": "t"}', '{"text": "t"'], ["c.jsonl, line 2", "JSON"]),
    "empty file": ("d.jsonl", [], ["d.jsonl", "empty"]),
    "no shape": ("e.jsonl", ['{"body": "t"}'], ["e.jsonl", "'body'", "no record shape"]),
    "messages not a list": ("f.jsonl", ['{"messages": "hi"}'], ["f.jsonl, line 1", "'messages'", "list"]),
    "turn without content": ("g.jsonl", ['{"messages": [{"role": "user"}]}'], ["g.jsonl, line 1", "'content'"]),
    "unknown role": ("h.jsonl", [json.dumps({"messages": chat(1)}), json.dumps({"messages": chat(2)}),
                                 '{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}'],
                     ["h.jsonl, line 3", "'messages'", "unknown role: robot"]),
    "no assistant turn": ("i.jsonl", ['{"messages": [{"role": "user", "content": "x"}]}'], ["i.jsonl, line 1", "no 'assistant' turn"]),
    "not parquet": ("j.parquet", ["these bytes are not a parquet file"], ["j.parquet", "parquet"]),
}


def write_bad(root: Path, kind: str) -> Path:
    name, lines, _ = BAD[kind]
    path = root / kind.replace(" ", "_") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("kind", sorted(BAD))
def test_a_bad_record_is_named_by_file_row_and_field(sources, kind):
    path = write_bad(sources["root"] / "bad", kind)
    cfg = data_config(sources, "text", path=str(path), val_path=None, val_fraction=0.5)
    with pytest.raises(ConfigError) as err:
        check_source(cfg, HFDirectory.open(sources["model"]).tokenizer())
    message = str(err.value)
    for words in BAD[kind][2]:
        assert words in message, (kind, message)
    assert "data.skip_bad_records" in message or "no record shape" in message


def test_bad_records_are_skipped_and_counted_when_asked(sources, tmp_path):
    lines = [json.dumps(pair(i)) for i in range(12)]
    lines[3] = '{"prompt": "no completion"}'
    lines[7] = '{"prompt": "x", "completion": null}'
    (tmp_path / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    cfg = data_config(sources, "text", path=str(tmp_path / "pairs.jsonl"), val_path=None, val_fraction=0.25,
                      skip_bad_records=True)
    data = prepare_data(cfg, OneRank, seed=SEED, tokenizer=HFDirectory.open(sources["model"]).tokenizer())
    assert data.manifest["bad_records"] == 2 and data.manifest["records"] == {"train": 8, "val": 2}
    assert "2 bad records skipped" in data.describe()


def test_all_masked_examples_are_dropped_and_counted(sources, tmp_path):
    rows = [pair(i) for i in range(8)] + [{"prompt": "long " * 200, "completion": "never seen"}]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = data_config(sources, "text", path=str(tmp_path / "pairs.jsonl"), val_path=None, val_fraction=0.2,
                      seq_len=48)
    data = prepare_data(cfg, OneRank, seed=SEED, tokenizer=HFDirectory.open(sources["model"]).tokenizer())
    assert data.train.usable.dropped == 1 and "1 dropped with no target" in data.describe()


def test_the_reference_gpt_refuses_chats_and_trains_its_bpe_on_pairs(sources):
    with pytest.raises(ConfigError, match="chat template"):
        prepare_data(data_config(sources, "messages", vocab_size=400), OneRank, seed=SEED)
    data = prepare_data(data_config(sources, "prompt_completion", vocab_size=400), OneRank, seed=SEED)
    x, y = data.train_batch(1)
    assert x.shape == (2, 96) and (y != -100).any() and (y == -100).any()


def test_show_prints_and_writes_the_rows_in_training_order(sources, tmp_path):
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "bigdense.data", "show", "data=records", *sources["messages"], "model=hf",
           f"model.path={sources['model']}", f"data.cache_dir={sources['cache']}", "data.seq_len=96",
           "data.micro_batch_size=2", "--rows", "3", "--json", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[[" in run.stdout and "train row 2" in run.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    data = prepare_data(data_config(sources, "messages"), OneRank, seed=SEED,
                        tokenizer=HFDirectory.open(sources["model"]).tokenizer())
    x, y = data.train_batch(1)  # step 1: rows 0 and 1
    assert [r["x"] for r in rows[:2]] == x.tolist() and [r["y"] for r in rows[:2]] == y.tolist()


def _loss_and_gradients_against_plain(model_dir: str, x: torch.Tensor, y: torch.Tensor, tp: int):
    import bigdense as bd
    from transformers import AutoModelForCausalLM
    from bigdense.models import CausalLM
    from bigdense.testing.check import compare_fused_loss

    bd.init_parallel(tp=tp)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = CausalLM(bd.parallelize(lm) if tp > 1 else lm)
    assert model.prepare_loss().fused
    return compare_fused_loss(reference, model, x, y)


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "unpacked"])
def test_first_step_loss_and_gradients_equal_plain_transformers(sources, pack):
    """One batch of chats through bigdense's fused loss (tp=2) and plain transformers' logits with
    F.cross_entropy: the loss and every gradient within 1e-5 (fp32; TP reorders the sums only)."""
    from bigdense.testing import run_ranks
    from bigdense.testing.check import beyond

    data = prepare_data(data_config(sources, "messages", pack=pack, micro_batch_size=4), OneRank, seed=SEED,
                        tokenizer=HFDirectory.open(sources["model"]).tokenizer())
    x, y = data.train_batch(1)
    assert (y == -100).float().mean() > 0.3  # prompts and padding masked
    for diffs in run_ranks(_loss_and_gradients_against_plain, 2, str(sources["model"]), x, y, 2, timeout=300):
        assert len(diffs) > 5 and not beyond(diffs, 1e-5), beyond(diffs, 1e-5)


# ---- the job, in fresh processes ----

STEPS = 3
LR = 1e-3
JOB = [f"trainer.max_steps={STEPS}", "optim=finetune", f"optim.lr={LR}", "optim.warmup_steps=1",
       "optim.schedule=constant", "trainer.log_interval=1", "trainer.eval_interval=0", "trainer.eval_batches=1",
       "trainer.progress_bar=false", "trainer.plot=false"]


def launch(nproc: int, sources, shape: str, run_dir: Path, *extra, check: bool = True, timeout: float = 300):
    cmd = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", TRAIN, "model=hf",
           f"model.path={sources['model']}", "data=records", *sources[shape], f"data.cache_dir={sources['cache']}",
           "data.seq_len=96", "data.micro_batch_size=2", f"trainer.run_dir={run_dir}", *JOB, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def job_losses(run_dir: Path) -> dict[int, float]:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in lines if r["kind"] == "train"}


def reference_losses(sources, shape: str, dp: int, grad_accum: int, **options) -> dict[int, float]:
    """Plain transformers on the job's global batches: one cross-entropy over every counted target."""
    from transformers import AutoModelForCausalLM

    cfg = data_config(sources, shape, grad_accum=grad_accum, **options)
    data = prepare_data(cfg, OneRank, seed=SEED, tokenizer=HFDirectory.open(sources["model"]).tokenizer())
    model = AutoModelForCausalLM.from_pretrained(sources["model"], dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    out = {}
    for step in range(1, STEPS + 1):
        rows = [data.train_batch(step, m, r, dp) for m in range(grad_accum) for r in range(dp)]
        x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        loss = F.cross_entropy(model(input_ids=x, use_cache=False).logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        out[step] = loss.item()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("shape, pack, grad_accum", [("messages", True, 1), ("messages", False, 2),
                                                      ("prompt_completion", True, 1), ("text", True, 1)],
                         ids=["chats-jsonl-packed", "chats-jsonl-unpacked-accum2", "pairs-parquet", "texts-saved"])
def test_fine_tune_at_tp2_equals_plain_transformers(sources, tmp_path, shape, pack, grad_accum):
    launch(2, sources, shape, tmp_path / "run", f"data.pack={str(pack).lower()}", f"data.grad_accum={grad_accum}")
    got = job_losses(tmp_path / "run")
    want = reference_losses(sources, shape, 1, grad_accum, pack=pack)
    assert sorted(got) == sorted(want)
    for step in got:
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (step, got, want)


@pytest.mark.slow
def test_resumed_at_another_layout_it_trains_on_the_next_examples(sources, tmp_path):
    """Interrupted at step 2 of a tp=2 run and resumed at tp=1: steps 3.. see the uninterrupted run's
    rows, so their losses agree up to the order of TP's sums (the pure-function order itself is
    `test_rows_follow_the_global_batch_at_any_layout`'s)."""
    launch(2, sources, "prompt_completion", tmp_path / "whole")
    launch(2, sources, "prompt_completion", tmp_path / "cut", "trainer.max_steps=2")
    launch(1, sources, "prompt_completion", tmp_path / "cut")
    whole, cut = job_losses(tmp_path / "whole"), job_losses(tmp_path / "cut")
    assert sorted(cut) == [1, 2, 3]
    for step in whole:
        assert abs(cut[step] - whole[step]) <= 1e-5 * abs(whole[step]), (step, cut, whole)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["unknown role", "not JSON", "missing field"])
def test_a_bad_record_stops_every_rank_before_the_run_directory(sources, tmp_path, kind):
    path = write_bad(tmp_path, kind)
    out = launch(2, sources, "text", tmp_path / "run", f"data.path={path}", "data.val_fraction=0.5", check=False,
                 timeout=60)  # the deadline for a bad record's launch
    assert out.returncode != 0
    message = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("bigdense: bad config")]
    assert message and all(words in message[0] for words in BAD[kind][2]), out.stderr[-3000:]
    assert not (tmp_path / "run").exists()
