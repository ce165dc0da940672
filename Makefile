# Two commands do everything (see README):  make lab   |   make test
# A virtual environment in .venv holds the course; torch is installed first so that
# CI gets the CPU build, while learners' pip picks the build that fits their machine.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup lab test notebooks bench train gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip show torch >/dev/null 2>&1 || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name prefill-decode-lab --display-name "Prefill & Decode Lab"
	touch $(STAMP)

setup: $(STAMP)

# Containers and cloud images often run as root, which Jupyter refuses unless told.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: setup
	$(BIN)/jupyter lab $(ALLOW_ROOT) notebooks/

# One pytest run: unit tests, then nbval re-executes every lesson and compares its stored outputs.
test: setup
	$(BIN)/python -m pytest tests notebooks --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600

# Re-execute every lesson and store its outputs (after changing labutils). Widget state is not
# stored: each plotly FigureWidget would otherwise embed all of plotly.js (about 5 MB) in the file.
notebooks: setup
	for nb in notebooks/*.ipynb; do \
		$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
			--ExecutePreprocessor.kernel_name=prefill-decode-lab \
			--ExecutePreprocessor.store_widget_state=False "$$nb" || exit 1; \
	done

bench: setup
	$(BIN)/python -m labutils.bench

# Everything that needs a CUDA GPU, in one short run (under 8 minutes on one GPU): the gpu-marked tests,
# every bench row on cuda, and the GPU lessons re-executed by nbval on cuda.
GPU_LESSONS := $(wildcard notebooks/05_*.ipynb notebooks/07_*.ipynb notebooks/08_*.ipynb)
gpu-check: setup
	@$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else \
		'gpu-check needs a CUDA GPU, and torch.cuda.is_available() is False here')"
	$(BIN)/python -m pytest -q -m gpu tests
	$(BIN)/python -m labutils.bench --device cuda --json gpu-bench.json
	$(BIN)/python -m pytest -q $(GPU_LESSONS) --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=300

train: setup
	$(BIN)/python -m labutils.train

clean:
	rm -rf $(VENV)
