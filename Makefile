# The two documented commands: `make run` (set up from a fresh clone, then `kvsp demo`: a
# local cluster plays the protocol and prints a report) and `make test` (set up, then run the
# whole test suite). Everything else is a step of those.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test setup lint clean

$(STAMP): pyproject.toml setup.py kvsp/_sha256x2.c moqt/_objscan.c moqt/_frozen.c moqt/_tlsrecords.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[engine,redis,quic-fast,sim,transformers,test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/kvsp demo

# Two workers (pytest-xdist), each test file on one of them so that a module's servers start
# once: most tests wait on real processes and sockets, so two halve the suite on 2 cores.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
