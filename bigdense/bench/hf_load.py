"""Memory at load of the fine-tune job: peak resident memory per rank while a Hugging Face
checkpoint of M bytes is read into a model converted at tp=t, against M/t and the largest tensor.

    python -m bigdense.bench.hf_load                       # Llama-style, d=1024, 8 layers, 32k vocab: ~670 MB fp32
    python -m bigdense.bench.hf_load --d 256 --layers 2 --json out.json    # a quick look

A checkpoint is written with ``save_pretrained`` (random weights; files of at most 200 MB, as
big checkpoints come, with their index). Then, in fresh processes, each rank does what
`launch/train.py model=hf` does: the model on the meta device, `bd.parallelize` by its plan,
`allocate_empty`, `load_hf_weights`. What is measured is the rise of the resident set's peak
(``VmHWM``, reset through ``/proc/self/clear_refs`` just before) over the resident set before
the build: the rank's shards, the file pages its slices touched while mapped, and any temporary.
The bound the job promises is M/t plus the largest single tensor. Baseline: one process loading
the same directory with transformers' ``from_pretrained`` (the whole model, as every rank of a
plain data-parallel job would). Every parameter is read once before the peak is taken, since
``from_pretrained`` may leave parameters over the file mapping until they are used.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

LINUX_PEAK_RESET = "5"  # proc(5): writing 5 to clear_refs resets the peak RSS (VmHWM)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure(load) -> float:
    """Bytes the peak resident set rose by while ``load()`` ran and every parameter was read once
    (a loader may return parameters over a file mapping whose pages are read only when used)."""
    Path("/proc/self/clear_refs").write_text(LINUX_PEAK_RESET)
    before = _status_kb("VmRSS")
    model = load()
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    peak = _status_kb("VmHWM")
    del model
    return (peak - before) * 1024.0


def _bigdense_rank(model_dir: str, tp: int) -> float:
    import bigdense as bd
    from bigdense.checkpoint.hf_import import load_hf_weights
    from bigdense.layers.base import allocate_empty

    from bigdense.models.hf_dir import HFDirectory

    bd.init_parallel(tp=tp)
    source = HFDirectory.open(model_dir)

    def load():
        lm = source.meta_model()  # as the job builds it (bigdense.jobs.build_hf)
        if tp > 1:
            lm = bd.parallelize(lm, tp_group=bd.get_default_context().tp_group)
        allocate_empty(lm, "cpu")
        load_hf_weights(lm, model_dir)
        return lm

    return _measure(load)


def _transformers_process(model_dir: str) -> float:
    from transformers import AutoModelForCausalLM

    return _measure(lambda: AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))


def sizes(model_dir: Path) -> tuple[int, int]:
    """(bytes of every stored tensor, bytes of the largest one), read from the files' headers."""
    from ..checkpoint.format import SafetensorsReader

    stored = []
    for file in model_dir.glob("*.safetensors"):
        with SafetensorsReader(file) as reader:
            stored += [reader.nbytes(name) for name in reader.header]
    return sum(stored), max(stored)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    from transformers import LlamaConfig, LlamaForCausalLM

    from ..testing.ranks import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "llama"
        config = LlamaConfig(hidden_size=args.d, intermediate_size=int(args.d * 2.75), num_hidden_layers=args.layers,
                             num_attention_heads=max(1, args.d // 128), vocab_size=args.vocab)
        LlamaForCausalLM(config).save_pretrained(model_dir, max_shard_size="200MB")
        total, largest = sizes(model_dir)
        rows = [{"loader": "transformers from_pretrained (1 process)", "tp": 1,
                 "peak_rise_bytes": run_ranks(_transformers_process, 1, str(model_dir), init_process_group=False)[0]}]
        for tp in args.tp:
            per_rank = run_ranks(_bigdense_rank, tp, str(model_dir), tp)
            rows.append({"loader": "bigdense load_hf_weights", "tp": tp, "peak_rise_bytes": max(per_rank)})
    print(f"checkpoint M = {total / 2**20:.0f} MiB, largest tensor "
          f"{largest / 2**20:.0f} MiB; peak resident-set rise per rank while loading:")
    print(f"{'loader':<44} {'tp':>3} {'peak rise':>10} {'/ M':>6} {'/ (M/t + largest)':>18}")
    for row in rows:
        bound = total / row["tp"] + largest
        row.update(checkpoint_bytes=total, largest_tensor_bytes=largest, ratio_to_m=row["peak_rise_bytes"] / total,
                   ratio_to_bound=row["peak_rise_bytes"] / bound)
        print(f"{row['loader']:<44} {row['tp']:>3} {row['peak_rise_bytes'] / 2**20:>7.0f} MiB {row['ratio_to_m']:>6.2f} "
              f"{row['ratio_to_bound']:>18.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"d": args.d, "layers": args.layers, "vocab": args.vocab, "rows": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
