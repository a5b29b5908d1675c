# imagegen build file. Every target installs what it needs into $(VENV) first.
#   make main     the main job (see README)
#   make test     everything CI checks: notebooks clean + in sync, imports, pytest, nbdev_test
#   make export   notebooks -> imagegen/ + scripts/ (nbdev_clean, nbdev_export, script export, stale removal)
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
PIP := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt
# no GPU here: run accelerate's multi-process launches as CPU (gloo) ranks
ifeq ($(shell command -v nvidia-smi 2>/dev/null),)
export ACCELERATE_USE_CPU := 1
endif

.PHONY: install export check test test-fast main clean-runs
install: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	touch $@

export: install
	$(BIN)/imagegen-export

check: install
	$(BIN)/imagegen-export --check

test: check
	$(PY) -m pytest tests -q -p no:cacheprovider
	$(BIN)/nbdev_test --timing
	@untracked=$$(git ls-files --others --exclude-standard imagegen scripts nbs 2>/dev/null); \
	if [ -n "$$untracked" ]; then echo "generated or new files not added to git: $$untracked (git add them)"; exit 1; fi
	@if [ -n "$${CI:-}" ] && [ -n "$$(git status --porcelain 2>/dev/null)" ]; then \
	  echo "the tests left the tree dirty:"; git status --porcelain; exit 1; fi

main: install
	$(BIN)/imagegen-diagnose
	$(BIN)/accelerate launch $(if $(ACCELERATE_USE_CPU),--multi_gpu --num_processes 2,) scripts/diagnose_distributed.py
