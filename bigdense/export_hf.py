"""Export a fine-tuned Hugging Face model's checkpoint back to a directory transformers (or PEFT) loads.

    python -m bigdense.export_hf RUN_DIR_OR_CHECKPOINT OUT [--max-shard-size 5GB] [--dtype bf16|fp16|fp32] [--merge]

RUN_DIR_OR_CHECKPOINT is a run of ``launch/train.py model=hf`` (its latest checkpoint), its
``checkpoints/`` or ``latest``, or one checkpoint directory. OUT, a new directory, receives what
``save_pretrained`` writes: the safetensors files (several, with ``model.safetensors.index.json``,
when the tensors pass ``--max-shard-size``), config.json, the generation config and the tokenizer
files; ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it. ``--dtype`` casts the floating-point
tensors (the default keeps the stored dtype, fp32). One process, no GPU, memory of one tensor at a
time (`bigdense.checkpoint.hf_export`).

A run with low-rank adapters (``lora.r=16``) saved the adapters only: OUT becomes a PEFT adapter
directory (``adapter_config.json``, whose ``base_model_name_or_path`` is the base the run trained on,
``adapter_model.safetensors`` with the full factors, and the tokenizer files), which
``PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT)`` loads. ``--merge``
writes the base with the adapters folded in instead (``W + scaling * B @ A``), a plain directory
``AutoModelForCausalLM.from_pretrained(OUT)`` loads; the base is read from the directory the
checkpoint names, checked against the digest it recorded.
"""
from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

from .checkpoint.format import CheckpointError, SafetensorsReader
from .checkpoint.hf_export import export_hf
from .train.precision import DTYPES


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m bigdense.export_hf", description=__doc__.split("\n\n")[0])
    parser.add_argument("source", help="a run directory, its checkpoints/ or latest, or a checkpoint directory")
    parser.add_argument("out", type=Path, help="the Hugging Face directory to write (new, or empty)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="most bytes of tensors per safetensors file, e.g. 500MB, 5GB (default 5GB)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="cast floating-point tensors (default: the stored dtype)")
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA run: write its base with the adapters folded in (a plain Hugging Face "
                             "directory) instead of a PEFT adapter directory")
    return parser.parse_args(argv)


def describe(out: Path) -> str:
    """What ``out`` holds: each file with its size, and the tensors' count, bytes and dtypes."""
    lines, tensors, tensor_bytes, dtypes = [], 0, 0, set()
    for path in sorted(p for p in out.iterdir() if p.is_file()):
        lines.append(f"  {path.name:<40} {_human(path.stat().st_size):>10}")
        if path.suffix == ".safetensors":
            with SafetensorsReader(path) as reader:
                tensors += len(reader.header)
                tensor_bytes += sum(reader.nbytes(n) for n in reader.header)
                dtypes |= {str(reader.describe(n)[0]).removeprefix("torch.") for n in reader.header}
    head = (f"wrote {out}: {tensors} tensors, {_human(tensor_bytes)} ({', '.join(sorted(dtypes))}), "
            f"{len(lines)} files")
    return "\n".join([head, *lines])


def _human(n: int) -> str:
    """Bytes in decimal units, as --max-shard-size reads them."""
    if n < 1000:
        return f"{n} B"
    for unit in ("KB", "MB", "GB", "TB"):
        n /= 1000
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        out = export_hf(args.source, args.out, max_shard_size=args.max_shard_size,
                        dtype=DTYPES[args.dtype] if args.dtype else None, merge=args.merge)
    except (ValueError, CheckpointError) as err:
        print(f"bigdense: {err}", file=sys.stderr)
        return 2
    print(describe(out))
    return 0


class _CallableModule(types.ModuleType):
    """Importing this module (``from bigdense.export_hf import main``) makes it the package's attribute
    ``bigdense.export_hf``, where ``bd.export_hf`` is the function: calling the module calls it, so
    ``bd.export_hf(source, out)`` works either way."""

    def __call__(self, *args, **kwargs):
        return export_hf(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
