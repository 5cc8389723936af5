import os

import pytest
import torch

# Two cores: the parent process must not compete with its own ranks for threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_default_context():
    """No test may leak a default parallel context into the next one."""
    import bigdense as bd

    bd.set_default_context(None)
    yield
    bd.set_default_context(None)
