# `make test` and `make demo` work on a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test lint demo clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@sh scripts/install-system-blas.sh || echo "note: no system BLAS installed; salabatch falls back to scipy-openblas32"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[test,bench,ray]"
	@touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check salabatch tests
	$(BIN)/ruff format --check salabatch tests

test: lint
	$(BIN)/python -m pytest -q

# The demo job on builtin:tiny, an UNTRAINED demo model: it shows the pipeline, its answers are
# meaningless text. Then the results table and a few answers.
demo: $(STAMP)
	$(BIN)/salabatch run jobs/demo.yaml
	$(BIN)/salabatch inspect results/demo.parquet --show 3

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
