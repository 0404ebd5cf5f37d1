# Fathom: two entry points. `make test` (CI) and, with the serving issue, `make serve`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is installed first, pinned, so nothing resolves an unpinned torch to a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check "torch==2.13.0" "numpy<2.4"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check app kernels tests bench
	TRITON_INTERPRET=1 $(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check app kernels tests bench

clean:
	rm -rf $(VENV)
