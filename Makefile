# One command each on a fresh machine: `make sweep`, `make test`. The virtualenv is created and
# the project installed on first use (a stamp file records it; pyproject.toml changes re-install).
# Two stamps: what running sweeps needs (torch, the project, the model libraries), and what
# developing it needs on top (tests, lints, the cluster launchers' packages: ~0.5 GB more).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
SPEC   ?= experiments/default.yaml
# torch/torchvision pinned here (not in pyproject) to the releases this machine serves from disk,
# the only ones tested. Another torch (a GPU's CUDA build) installs instead, untested: where it
# lacks a private MemTracker part the fast tracker uses, tensor accounting falls back to PyTorch's
# own MemTracker, slower, same numbers (harness/compat/memtracker.py, docs/measuring.md).
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1
# Where torch comes from. Unset: on a machine without an NVIDIA driver, PyTorch's CPU index first
# (the same pins, CPU build: ~1 GB of torch instead of ~5 GB), PyPI where that index cannot be
# reached (a mirror-only network, as on this project's machines) or where a driver is present.
# Set: that index only (`TORCH_INDEX=https://pypi.org/simple` takes PyPI's CUDA build anyway).
TORCH_INDEX ?=
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

FORMAT ?= table
# `make test` runs the suite in this many pytest processes (pytest-xdist), a test file each at
# a time (its module fixtures, e.g. a shared sweep, are built once): most of a test's time is
# a trial process starting and stores answering, so two overlap well even on two cores.
TEST_WORKERS ?= 2

.PHONY: install install-dev browser sweep base-model finetune results test test-fast bench gpu-check lint ui clean

install: $(STAMP)

install-dev: $(DEV_STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@if [ -n "$(TORCH_INDEX)" ]; then \
		$(BIN)/python -m pip install --quiet --index-url $(TORCH_INDEX) $(TORCH_PINS); \
	elif ! command -v nvidia-smi >/dev/null && $(BIN)/python -m pip install --quiet --retries 0 \
			--timeout 20 --index-url $(TORCH_CPU_INDEX) $(TORCH_PINS) 2>/dev/null; then \
		echo "install: no NVIDIA driver here: $(TORCH_PINS) from PyTorch's CPU index"; \
	else \
		command -v nvidia-smi >/dev/null || echo "install: no NVIDIA driver here, but PyTorch's CPU" \
			"index cannot be reached: PyPI's torch, its CUDA build (~5 GB more in .venv)"; \
		$(BIN)/python -m pip install --quiet $(TORCH_PINS); \
	fi
	$(BIN)/python -m pip install --quiet -e '.[models]'
	touch $(STAMP)

# Tests, lints, benchmarks: the dev tools and both cluster launchers' packages too.
$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev,models,slurm,ray]'
	touch $(DEV_STAMP)

sweep: $(STAMP)
	$(BIN)/harness sweep $(SPEC)

# The pre-trained model experiments/finetune_quality.yaml fine-tunes (scripts/pretrain_base.py).
base-model: results/base-model/model.safetensors

results/base-model/model.safetensors: $(STAMP) scripts/pretrain_base.py
	$(BIN)/python scripts/pretrain_base.py results/base-model

finetune: base-model
	$(BIN)/harness sweep experiments/finetune_quality.yaml

results: $(STAMP)
	$(BIN)/harness results --format $(FORMAT)

# The report's real-browser test needs Debian's Chromium and ChromeDriver; installed when
# missing and possible (root + apt), else that one test is skipped (outside CI) with the reason.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium + chromium-driver (Debian packages) for the browser test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			chromium chromium-driver >/dev/null; \
	else echo "note: no chromium/chromedriver and no root apt-get: the browser test will skip"; fi

test: $(DEV_STAMP) browser
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: $(DEV_STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(DEV_STAMP)
	$(BIN)/python -m benchmarks

# Trials through the trial layer on this machine's GPU (a reduced CPU set where there is none);
# one JSON per trial and summary.json into results/gpu-check/, a table last.
gpu-check: $(STAMP)
	PYTHON=$(abspath $(BIN))/python bash scripts/gpu_check.sh results/gpu-check

lint: $(DEV_STAMP)
	$(BIN)/ruff check harness tests benchmarks scripts
	$(BIN)/ruff format --check harness tests benchmarks scripts
	$(BIN)/lint-imports
	$(BIN)/pyright

ui: $(STAMP)
	@mkdir -p results
	@$(BIN)/python -c "from harness.record.tracking import ui_links; \
	print(''.join(f'trials of {n}: {u}\n' for n, u in ui_links('sqlite:///results/mlflow.db')), end='')" || true
	$(BIN)/mlflow ui --backend-store-uri sqlite:///results/mlflow.db --host 127.0.0.1 --port 5000

clean:
	rm -rf results .pytest_cache .ruff_cache build *.egg-info
