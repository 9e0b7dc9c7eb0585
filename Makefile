# One-command set-up: `make demo` and `make test` each create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
STDLIB := $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')

DEMO_DATA := data/stdlib-bpe/manifest.json

.PHONY: install install-test constraints demo test test-fast lint docs bench clean prometheus-tools image

# cluster/install.sh: torch (CPU) first, DeepSpeed, Kiln (editable here, with MLflow's server for
# `mlflow ui`), then DeepSpeed's CPU ops;
# the container image (cluster/Dockerfile) runs the same script. Versions: constraints.txt.
$(STAMP): pyproject.toml constraints.txt cluster/install.sh
	PY=$(PY) EXTRAS=server sh cluster/install.sh $(VENV) editable
	touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $@

install: $(STAMP)
install-test: $(TEST_STAMP)

# After a dependency changes in pyproject.toml: `make install-test constraints` pins what that
# environment now runs (torch without its +cpu label, so that a CUDA build satisfies it too).
constraints: $(TEST_STAMP)
	{ grep '^#' constraints.txt; $(BIN)/pip freeze --exclude-editable | sed 's/+cpu$$//'; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

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

# Two phases. The unit tests run two files at a time (pytest-xdist; loadfile keeps each module's
# fixtures in one process): one at a time, their start-ups (imports, engines, stores) left a core
# idle. The integration tests then run one at a time, as before: their Ray clusters, ASHA's race
# to a rung, PBT's decision and the elastic two-node run are timed against the 2 cores' load.
# A phase that fails (pytest's exit 5, no tests, included) fails make, and a failed unit phase
# skips the integration one.
test: $(TEST_STAMP) prometheus-tools lint docs
	$(BIN)/python -m pytest tests -m "not integration" -n 2 --dist loadfile --durations=20
	$(BIN)/python -m pytest tests -m integration --durations=20

# The inner loop: everything but the integration tests (a Ray cluster) and the `slow` ones
# (whole training jobs and engines), which `make test` runs.
test-fast: $(TEST_STAMP) prometheus-tools
	$(BIN)/python -m pytest tests -m "not integration and not slow" -q

# The linters alone, in an environment of their own (seconds to make): linting installs no torch,
# DeepSpeed or Ray. Their versions are the test extra's, read from pyproject.toml.
LINT_VENV := .venv-lint
LINT_STAMP := $(LINT_VENV)/.installed
LINT_TOOLS = $(shell $(PY) -c 'import re, tomllib; test = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]; print(" ".join(chr(39) + s + chr(39) for s in test if re.match(r"(ruff|import-linter|mypy|mkdocs)\b", s)))')

$(LINT_STAMP): pyproject.toml
	test -x $(LINT_VENV)/bin/python || $(PY) -m venv $(LINT_VENV)
	$(LINT_VENV)/bin/pip install -q $(LINT_TOOLS)
	touch $@

# ruff's lints and its formatting, the types ([tool.mypy]), then the architecture contracts of
# pyproject.toml's [tool.importlinter] (ARCHITECTURE.md), read from the source tree
# (import-linter parses the imports; it imports nothing it checks). .pre-commit-config.yaml
# runs the same tools on each commit.
lint: $(LINT_STAMP)
	$(LINT_VENV)/bin/ruff check .
	$(LINT_VENV)/bin/ruff format --check .
	$(LINT_VENV)/bin/mypy
	PYTHONPATH=platform $(LINT_VENV)/bin/lint-imports --no-logo

# The reference (docs/, mkdocs.yml) built strictly: a broken link or anchor between pages fails.
# The site goes to $(LINT_VENV)/site; `$(LINT_VENV)/bin/mkdocs serve` shows it locally.
docs: $(LINT_STAMP)
	$(LINT_VENV)/bin/mkdocs build --strict --quiet --site-dir $(LINT_VENV)/site

bench: $(DEMO_DATA)
	$(BIN)/python -m bench.throughput
	$(BIN)/python -m bench.throughput --launcher local --zero-stages 0
	$(BIN)/python -m bench.step_ab
	$(BIN)/python -m bench.host_overhead
	$(BIN)/python -m bench.host_syncs
	$(BIN)/python -m bench.optimizer_step
	$(BIN)/python -m bench.tensor_parallel
	$(BIN)/python -m bench.checkpoint_overhead
	$(BIN)/python -m bench.lora
	$(BIN)/python -m bench.document_mask
	$(BIN)/python -m bench.grad_compression
	$(BIN)/python -m bench.sync
	$(BIN)/python -m bench.resize
	$(BIN)/python -m bench.startup_cpu
	$(BIN)/python -m bench.background_cost
	$(BIN)/python -m bench.generate
	$(BIN)/python -m bench.generate --compile
	$(BIN)/python -m bench.prepare
	# The example sweep with ASHA and with every trial to the end (~30 min on 2 cores).
	$(BIN)/python -m bench.sweep_asha

# Kiln's image for clusters (cluster/Dockerfile), both variants, tagged as cluster/*.yaml and
# cluster/kuberay/ name them (tests/unit/cluster/test_cluster_files.py checks that they agree);
# then the CPU image's smoke run (cluster/image_smoke.sh: the version and a 5-step training run).
IMAGE := ghcr.io/kiln-llm/kiln
VERSION = $(shell $(PY) -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
CUDA_BASE := nvidia/cuda:12.8.1-cudnn-devel-ubuntu24.04
image:
	docker build -f cluster/Dockerfile -t $(IMAGE):$(VERSION)-cpu --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu .
	docker build -f cluster/Dockerfile -t $(IMAGE):$(VERSION)-cuda --build-arg BASE=$(CUDA_BASE) \
		--build-arg APT_PYTHON="python3 python3-dev python3-venv" --build-arg EXTRAS=server,gpu .
	docker run --rm -v "$$PWD/cluster/image_smoke.sh:/smoke.sh:ro" $(IMAGE):$(VERSION)-cpu sh /smoke.sh

clean:
	rm -rf $(VENV) $(LINT_VENV) data runs mlflow.db mlruns mlartifacts
