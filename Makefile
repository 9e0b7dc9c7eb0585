# One-command set-up: `make demo` and `make test` each create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
STDLIB := $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

DEMO_DATA := data/stdlib-bpe/manifest.json

.PHONY: install install-test demo test test-fast lint bench clean prometheus-tools

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip setuptools wheel
	# torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	# DeepSpeed's sdist imports torch while building; build no CUDA ops (JIT on demand instead).
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation "deepspeed>=0.19,<0.20"
	$(BIN)/pip install -q -e .
	# Build DeepSpeed's shared-memory allreduce and CPU Adam ops now (~3 min once), into this
	# environment's own cache (kiln.parallel.ops), rather than inside the first training run.
	$(BIN)/python -m kiln.parallel.ops
	touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(STAMP)
install-test: $(TEST_STAMP)

# A real corpus that ships with Python (the stdlib's own sources), tokenized with a 2048-token BPE.
$(DEMO_DATA): $(STAMP)
	$(BIN)/kiln data prepare --input '$(STDLIB)/*.py' --output data/stdlib-bpe \
		--tokenizer bpe --vocab-size 2048 --seq-len 128 --shard-tokens 131072 --if-exists reuse

# Train the `debug` GPT with DeepSpeed ZeRO-2 on 2 Ray Train workers on an embedded local Ray,
# then sample from the checkpoint it ended with (its path is in the run summary).
demo: $(DEMO_DATA)
	@mkdir -p runs  # --summary-json needs its directory; a fresh clone has no runs/ yet
	$(BIN)/kiln train --config jobs/configs/debug.yaml --summary-json runs/demo-summary.json
	$(BIN)/kiln generate --model "$$($(BIN)/python -c 'import json; print(json.load(open("runs/demo-summary.json"))["checkpoint"])')" \
		--prompt 'def ' --prompt 'import ' --max-new-tokens 40 --temperature 0.8 --top-k 50

# Debian's Prometheus (prometheus + promtool) for the dashboard and alert tests.
prometheus-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
		|| { $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq --no-install-recommends prometheus; }; }

test: $(TEST_STAMP) prometheus-tools lint
	$(BIN)/python -m pytest tests --durations=40

# The inner loop: everything but the integration tests (a Ray cluster) and the `slow` ones
# (whole training jobs and engines), which `make test` runs.
test-fast: $(TEST_STAMP) prometheus-tools
	$(BIN)/python -m pytest tests -m "not integration and not slow" -q

# The linters alone, in an environment of their own (seconds to make): linting installs no torch,
# DeepSpeed or Ray. Their versions are the test extra's, read from pyproject.toml.
LINT_VENV := .venv-lint
LINT_STAMP := $(LINT_VENV)/.installed
LINT_TOOLS = $(shell $(PY) -c 'import re, tomllib; test = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]; print(" ".join(chr(39) + s + chr(39) for s in test if re.match(r"(ruff|import-linter)\b", s)))')

$(LINT_STAMP): pyproject.toml
	test -x $(LINT_VENV)/bin/python || $(PY) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install -q $(LINT_TOOLS)
	touch $@

# ruff, then the architecture contracts of pyproject.toml's [tool.importlinter] (ARCHITECTURE.md),
# read from the source tree (import-linter parses the imports; it imports nothing it checks).
lint: $(LINT_STAMP)
	$(LINT_VENV)/bin/ruff check .
	PYTHONPATH=platform $(LINT_VENV)/bin/lint-imports --no-logo

bench: $(DEMO_DATA)
	$(BIN)/python -m bench.throughput
	$(BIN)/python -m bench.throughput --launcher local --zero-stages 0
	$(BIN)/python -m bench.step_ab
	$(BIN)/python -m bench.tensor_parallel
	$(BIN)/python -m bench.checkpoint_overhead
	$(BIN)/python -m bench.resize
	$(BIN)/python -m bench.startup_cpu
	$(BIN)/python -m bench.background_cost
	$(BIN)/python -m bench.generate
	$(BIN)/python -m bench.prepare
	# The example sweep with ASHA and with every trial to the end (~30 min on 2 cores).
	$(BIN)/python -m bench.sweep_asha

clean:
	rm -rf $(VENV) $(LINT_VENV) data runs mlflow.db mlruns mlartifacts
