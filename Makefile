# Two commands do all set-up on a fresh machine:
#   make train    the main job: train the reference GPT on 2 CPU processes (tp=2)
#   make classify the classifier job: which stdlib file a window of tokens comes from (tp=2)
#   make test     the test suite
# Both create .venv on first use. With no torch in it, torch $(TORCH_VERSION) is installed first,
# so pip never resolves an unpinned torch for bigdense's `torch>=2.4` itself. Which build that pin
# brings is pip's business: this project's machines hold a local CPU wheel of 2.13.0; elsewhere PyPI
# serves its default build for the platform. To choose, run `make TORCH_VERSION=...` on a fresh
# .venv (an existing torch there is kept), or install bigdense into an environment that already
# has the torch you want: `pip install -e .[dev,test]`.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 2
# pytest workers: the test process runs on one thread, so one worker per core keeps both busy.
TEST_WORKERS ?= 2
ARGS ?=
# A run directory to resume or extend (trainer.run_dir); empty: a new one per launch.
RUN ?=

.PHONY: setup train classify test test-quick clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev,test]"
	touch $@

setup: $(VENV)/.installed

train: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) launch/train.py $(if $(RUN),trainer.run_dir=$(RUN)) $(ARGS)

classify: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) launch/classify.py $(ARGS)

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal $(ARGS)

test-quick: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal -m "not slow" $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
