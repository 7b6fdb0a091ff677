# `make demo` and `make test` each set up .venv on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.base
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast mutation-check lint bench release-check clean

$(BASE): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: on PyPI under Linux, torch is a multi-GB CUDA build. PyTorch's CPU
	# index is asked first; --retries 0 so a machine that cannot reach it falls back at once to PyPI.
	$(PY) -m pip install -q --retries 0 --extra-index-url https://download.pytorch.org/whl/cpu torch==2.13.0
	# What the demo needs and nothing more: spillmerge, its own dependencies and its torch extra.
	$(PY) -m pip install -q -e '.[torch]'
	touch $(BASE)

# The tests' tools (pytest, moto, lightning, ruff, mypy ...) come with `make test` only.
$(STAMP): $(BASE)
	$(PY) -m pip install -q -e '.[test]'
	# torchvision for tests/e2e/test_model_outputs.py: the release built for the torch above, in a folder
	# off the venv's path (--target). PyPI's Linux wheel is built against CUDA torch: with the CPU
	# torch its compiled ops do not load and `import torchvision` fails, which would break every
	# package that imports it when installed (torchmetrics, lightning). Only the model test puts
	# the folder on its path, with a workaround for the ops (tests/_torchvision_cpu.py).
	$(PY) -m pip install -q --no-deps --upgrade --retries 0 --extra-index-url https://download.pytorch.org/whl/cpu \
		--target $(VENV)/torchvision-cpu torchvision==0.28.0
	touch $(STAMP)

setup: $(STAMP)

demo: $(BASE)
	$(VENV)/bin/spillmerge demo

# Four workers on 2 cores: the multi-rank tests spend much of their time waiting on their processes
# (a quiet 2-core VM: 6:00 with 3, 5:24 and 5:26 with 4, 5:09 with 5, 6:10 with 6). Whole files go
# to a worker (a module's fixtures are built once) except tests/conftest.py's SPREAD files, whose
# tests go one by one; in collection order, the longest files first (conftest FIRST).
test: setup
	$(PY) -m pytest -q -n 4 --dist loadfile --no-loadscope-reorder --durations=20

# The tier for iteration: no rank processes, S3 server, framework or model tests (tests/conftest.py).
test-fast: setup
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder -m "not (multiprocess or s3 or framework or model or slow)"

mutation-check: setup
	$(PY) tests/mutation_check.py

lint: setup
	$(VENV)/bin/ruff check spillmerge tests benchmarks examples
	$(VENV)/bin/mypy spillmerge

release-check: setup
	bash .ci/release-check

bench: setup
	$(PY) benchmarks/suite.py --flat

clean:
	rm -rf spillmerge-demo .pytest_cache
