# Two commands do everything (see README):  make lab   |   make test
# A virtual environment in .venv holds the course; torch is installed first so that
# CI gets the CPU build, while learners' pip picks the build that fits their machine.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup lab test bench train clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip show torch >/dev/null 2>&1 || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name prefill-decode-lab --display-name "Prefill & Decode Lab"
	touch $(STAMP)

setup: $(STAMP)

lab: setup
	$(BIN)/jupyter lab notebooks/

# One pytest run: unit tests, then nbval re-executes every lesson and compares its stored outputs.
test: setup
	$(BIN)/python -m pytest tests notebooks --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600

bench: setup
	$(BIN)/python -m labutils.bench

train: setup
	$(BIN)/python -m labutils.train

clean:
	rm -rf $(VENV)
