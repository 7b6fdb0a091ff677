# `make demo` and `make test` each set up .venv on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test mutation-check lint bench release-check clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/spillmerge demo

test: setup
	$(PY) -m pytest -q

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
