# Fathom: two entry points. `make serve` runs the app (tiny model, CPU); `make test` is CI.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
DEV_STAMP := $(VENV)/.installed-dev
# torch is pinned in every install command, so nothing resolves an unpinned torch to a CUDA
# build; --no-compile skips byte-compiling ray & co. at install time (Python does it lazily).
PIP := $(BIN)/pip install -q --disable-pip-version-check --no-compile "torch==2.13.0" "numpy<2.4"

.PHONY: serve test lint gpu-check gpu-test gpu-bench gpu-cache-pack clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(PIP) -e .
	touch $@

$(DEV_STAMP): $(RUN_STAMP)
	$(PIP) -e ".[dev]"
	touch $@

# Ray writes an auth token unless told not to. app.run = `serve run` plus a "ready" line with
# the URLs and a clean shutdown on SIGTERM / Ctrl-C.
serve: $(RUN_STAMP)
	RAY_AUTH_MODE=disabled $(BIN)/python -m app.run serve_config.yaml

# lint-imports: the layering and no-cycle contracts of pyproject.toml ([tool.importlinter])
test: $(DEV_STAMP)
	$(BIN)/ruff check app kernels tests bench tools
	$(BIN)/lint-imports
	RAY_AUTH_MODE=disabled TRITON_INTERPRET=1 $(BIN)/python -m tools.run_tests

# On a CUDA machine with torch + triton already there (the lent H200 has no network, so no
# venv): the GPU tests (251 tests; with GPU_ARGS="-n 8" (pytest-xdist) 6.3 minutes on an
# H200 with the Triton cache of .gpu-cache, most of it compiles and the engine tests' CPU
# references; shard them with GPU_TESTS, e.g. GPU_TESTS=tests/gpu/test_moe_kernels.py),
# then the quick kernel benchmarks (~3 min; JSON into
# bench/results/). Every test id is printed as it ends (the ini's -q is dropped), so a call
# cut by its limit still says what passed and failed; --timeout fails a hung test with its
# traceback (pytest-timeout, on the device image).
GPU_TESTS ?= tests/gpu
GPU_ARGS ?=
gpu-check: gpu-test gpu-bench

# Triton's kernel cache of the GPU runs, inside the checkout: a GPU machine that starts bare is
# handed the last run's compiled kernels as one tarball (`make gpu-cache-pack`: the cubins and
# their metadata, ~1/10 of the cache; the IRs stay out, so bench.compile_report needs its own
# cache). Triton records absolute paths: the checkout must sit at the same path on every
# machine (elsewhere the cache only misses).
GPU_CACHE := $(CURDIR)/.gpu-cache
gpu-test gpu-bench: export TRITON_CACHE_DIR := $(GPU_CACHE)/triton
UNPACK_GPU_CACHE = @if [ -f $(GPU_CACHE)/triton.tgz ] && [ ! -d $(GPU_CACHE)/triton ]; then \
	tar xzf $(GPU_CACHE)/triton.tgz -C $(GPU_CACHE); fi

gpu-test:
	$(UNPACK_GPU_CACHE)
	PYTHONPATH=. $(PY) -m pytest $(GPU_TESTS) -o addopts="" -p no:cacheprovider -v -rfE \
		--durations=30 --timeout 240 $(GPU_ARGS)

gpu-cache-pack:
	@test -d $(GPU_CACHE)/triton || { echo "no $(GPU_CACHE)/triton to pack"; exit 1; }
	cd $(GPU_CACHE) && tar czf triton.tgz --exclude='*.source' --exclude='*.ttir' \
		--exclude='*.ttgir' --exclude='*.llir' --exclude='*.ptx' triton

gpu-bench:
	$(UNPACK_GPU_CACHE)
	PYTHONPATH=. $(PY) -m bench.kernels_moe --quick
	PYTHONPATH=. $(PY) -m bench.kernels_attention --quick

lint: $(DEV_STAMP)
	$(BIN)/ruff check app kernels tests bench tools
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV)

# An air-gapped GPU host: the locked wheels of the serving runtime, cut into parts of 30 MiB
# (docs/deployment.md, "Installing on a host without network").
WHEELHOUSE ?= ../wheelhouse-cp312
.PHONY: wheelhouse
wheelhouse:
	$(PY) -m tools.wheelhouse download --dest $(WHEELHOUSE)
	$(PY) -m tools.wheelhouse split --src $(WHEELHOUSE) --dest $(WHEELHOUSE)-parts --part-mib 30
