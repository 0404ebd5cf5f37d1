# Fathom: two entry points. `make serve` runs the app (tiny model, CPU); `make test` is CI.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch is installed first, pinned, so nothing resolves an unpinned torch to a CUDA build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check "torch==2.13.0" "numpy<2.4"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

# Ray writes an auth token unless told not to; a background `serve run` stops on SIGTERM.
serve: $(STAMP)
	RAY_AUTH_MODE=disabled $(BIN)/serve run serve_config.yaml

test: $(STAMP)
	$(BIN)/ruff check app kernels tests bench
	RAY_AUTH_MODE=disabled TRITON_INTERPRET=1 $(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check app kernels tests bench

clean:
	rm -rf $(VENV)
