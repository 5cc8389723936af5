"""Reading and tokenising records (``data=records``) against ``datasets.map`` with the same tokenizer.

    python -m bigdense.bench.records                  # 100,000 prompt/completion records, 5,000 chats
    python -m bigdense.bench.records --quick          # 5,000 and 500 (seconds)
    python -m bigdense.bench.records --json out.jsonl # also append the rows as JSON lines

The records are written here (a JSON Lines file of short prompt/completion pairs, one of two-turn
chats), and the tokenizer is `bigdense.testing.pretrained`'s (a byte-level BPE of 8,192 entries with
a chat template), so nothing is downloaded. Each side starts from the file with an empty cache:

* ``datasets.map`` (the baseline): the transformers tokenizer loaded, ``load_dataset("json")``, then ``map(batched=True)`` calling the
  transformers tokenizer on the prompts and the completions (for chats, ``apply_chat_template`` with
  ``return_assistant_tokens_mask=True``): what TRL and axolotl run before training;
* ``bigdense``: `bigdense.data.records.find_or_build`, the whole build: the tokenizer loaded, ``load_dataset``, every
  record checked, tokenised, targets marked, the cache written.

Printed: the median of ``--repeats`` alternating runs of each and bigdense / baseline.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from . import append_json_lines

FULL = dict(pairs=100_000, chats=5_000)
QUICK = dict(pairs=5_000, chats=500)


def write_records(root: Path, pairs: int, chats: int) -> tuple[Path, Path]:
    pair_file, chat_file = root / "pairs.jsonl", root / "chats.jsonl"
    with pair_file.open("w") as f:
        for i in range(pairs):
            f.write(json.dumps({"prompt": f"Question {i}: what is {i % 97} times {i % 13}?",
                                "completion": f" It is {(i % 97) * (i % 13)}."}) + "\n")
    with chat_file.open("w") as f:
        for i in range(chats):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i % 97} plus {i % 13}?"},
                                             {"role": "assistant", "content": f"{i % 97 + i % 13}."}]}) + "\n")
    return pair_file, chat_file


def baseline(path: Path, model_dir: Path, cache: Path, chats: bool) -> float:
    import datasets
    from transformers import AutoTokenizer

    t0 = time.perf_counter()  # loading the tokenizer counts on both sides
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    table = datasets.load_dataset("json", data_files=[str(path)], split="train", cache_dir=str(cache))
    if chats:
        def encode(batch):
            out = [tok.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                   for m in batch["messages"]]
            return {"input_ids": [o["input_ids"] for o in out], "assistant_masks": [o["assistant_masks"] for o in out]}
    else:
        def encode(batch):
            return {"prompt_ids": tok(batch["prompt"])["input_ids"],
                    "completion_ids": tok(batch["completion"], add_special_tokens=False)["input_ids"]}
    table.map(encode, batched=True, remove_columns=table.column_names)
    return time.perf_counter() - t0


def bigdense_build(path: Path, model_dir: Path, cache: Path) -> float:
    from ..config.schema import DataConfig
    from ..data.records import find_or_build
    from ..models.hf_dir import HFDirectory

    cfg = DataConfig(source="records", path=str(path), cache_dir=str(cache))
    tokenizer = HFDirectory.open(model_dir).tokenizer()
    t0 = time.perf_counter()
    _, _, built = find_or_build(cfg, tokenizer)
    assert built
    return time.perf_counter() - t0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bigdense.bench.records", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    import datasets

    from ..testing.pretrained import write_pretrained

    datasets.disable_progress_bars()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = write_pretrained(root / "model", vocab_size=8192)
        pair_file, chat_file = write_records(root, sizes["pairs"], sizes["chats"])
        for name, path, n in (("prompt/completion", pair_file, sizes["pairs"]), ("chats", chat_file, sizes["chats"])):
            times = {"datasets.map": [], "bigdense": []}
            for r in range(args.repeats):
                times["datasets.map"].append(baseline(path, model_dir, root / f"hf-{name[:4]}-{r}", name == "chats"))
                times["bigdense"].append(bigdense_build(path, model_dir, root / f"bd-{name[:4]}-{r}"))
            med = {k: statistics.median(v) for k, v in times.items()}
            row = {"records": name, "n": n, "datasets_map_s": med["datasets.map"], "bigdense_s": med["bigdense"],
                   "ratio": med["bigdense"] / med["datasets.map"], "repeats": args.repeats}
            rows.append(row)
            print(f"{name:>18} x {n:>7,}: datasets.map {med['datasets.map']:7.2f} s | bigdense build "
                  f"{med['bigdense']:7.2f} s | bigdense / datasets.map {row['ratio']:.2f}x")
    if args.json:
        append_json_lines(args.json, rows)
        print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
