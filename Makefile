# Each target does all set-up on a fresh machine: .venv, torch first (never a CUDA swap), then areal.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   := torch==2.13.0
STAMP   := $(VENV)/.installed

.PHONY: demo test install clean

$(VPY):
	$(PY) -m venv $(VENV)

$(STAMP): $(VPY) pyproject.toml
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -e '.[test]'
	$(VPY) -c "import torch, sys; v = torch.__version__; sys.exit(0 if v.startswith('2.13.0') else 'torch was replaced: ' + v)"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VPY) -m pytest -q -ra

demo: $(STAMP)
	$(VENV)/bin/areal quickstart --out runs/quickstart

clean:
	rm -rf $(VENV) runs
