import os

import pytest
import torch

# Two cores: the parent process must not compete with its own ranks for threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton kernels run on CPU tensors through Triton's interpreter, which Triton chooses when a kernel
# is defined: set before anything imports one (tests/test_head_kernels.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_default_context():
    """No test may leak a default parallel context into the next one."""
    import bigdense as bd

    bd.set_default_context(None)
    yield
    bd.set_default_context(None)


@pytest.fixture(scope="session")
def small(tmp_path_factory):
    """Hydra overrides for launch tests: half a megabyte of the standard library, a 512-entry
    vocabulary (its cache built once per session), a one-block model."""
    cache = tmp_path_factory.mktemp("cache")
    return [
        "data.max_corpus_mb=0.5", "data.vocab_size=512", f"data.cache_dir={cache}", "data.seq_len=32",
        "data.micro_batch_size=4", "model.d_model=64", "model.n_layers=1", "model.n_heads=2",
        "model.head_chunk_size=64", "trainer.log_interval=2", "trainer.eval_batches=2",
        "trainer.progress_bar=false", "optim.warmup_steps=2", "data.val_fraction=0.2",
    ]
