"""Text from a fine-tuned Hugging Face model (a `launch/train.py model=hf` run), as docs/training.md
shows it: `python -m bigdense.export_hf` writes the run back as a directory transformers loads, and
transformers' own `generate` writes the text (`python -m bigdense.sample` is for bigdense's GPT).

    .venv/bin/python examples/generate_hf.py outputs/llama-ft-hf

The argument is the exported directory. A path that holds no model yet gets a small random one
first (`python -m bigdense.testing.pretrained`'s), so the example runs without a fine-tuned run;
its text is then random tokens.
"""
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

exported = Path(sys.argv[1] if len(sys.argv) > 1 else "outputs/llama-ft-hf")
if not (exported / "config.json").exists():
    from bigdense.testing.pretrained import write_pretrained

    write_pretrained(exported)

tokenizer = AutoTokenizer.from_pretrained(exported)
model = AutoModelForCausalLM.from_pretrained(exported)
ids = tokenizer("def main(", return_tensors="pt").input_ids
torch.manual_seed(1337)
out = model.generate(ids, max_new_tokens=40, do_sample=True, temperature=0.8, top_k=200)
print(tokenizer.decode(out[0]))
