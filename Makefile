# `make test` and `make demo` work on a fresh clone: they create .venv and install what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# the native CPU kernels (salabatch/engine/native), rebuilt when their sources change or MLX
# does (they are built against the installed MLX and not used under another: an upgrade writes
# a new dist-info folder, newer than the stamp)
NATIVE := $(VENV)/.native
NATIVE_SRC := $(wildcard salabatch/engine/native/*.cpp salabatch/engine/native/*.h salabatch/engine/native/CMakeLists.txt)
MLX_INSTALLED := $(wildcard $(VENV)/lib/python*/site-packages/mlx-*.dist-info/METADATA)

.PHONY: install test lint demo clean

install: $(STAMP) $(NATIVE)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	@sh scripts/install-system-blas.sh || echo "note: no system BLAS installed; salabatch falls back to scipy-openblas32"
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,bench,ray,serve]"
	@touch $(STAMP)

# A failed build is not fatal: salabatch then runs the same steps as MLX-op graphs (slower on
# the CPU) and the native kernels' tests skip, saying why.
$(NATIVE): $(STAMP) $(NATIVE_SRC) $(MLX_INSTALLED) scripts/build-native.sh
	@sh scripts/build-native.sh $(BIN)/python || echo "note: native CPU kernels not built; salabatch uses its MLX-op forms"
	@touch $(NATIVE)

lint: $(STAMP)
	$(BIN)/ruff check salabatch tests jobs benchmarks scripts
	$(BIN)/ruff format --check salabatch tests jobs

test: lint $(NATIVE)
	$(BIN)/python -m pytest -q --durations=15

# The demo job on builtin:tiny (a small model trained on synthetic contracts, shipped in the
# package), then the results table and each answer beside the expected one, with the count.
demo: $(STAMP) $(NATIVE)
	$(BIN)/salabatch run jobs/demo.yaml
	$(BIN)/salabatch inspect results/demo.parquet --expected jobs/demo/answers.yaml

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build salabatch/engine/kernels/_native*.so
