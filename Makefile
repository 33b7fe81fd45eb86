# The two set-up commands of the README. Each one installs what it needs into .venv.
#   make app   - launch the Gradio app on the bundled MNIST model (http://127.0.0.1:7860)
#   make test  - run the whole test suite (installs Debian chromium for the browser test)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: app test test-fast install install-dev browser

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: requirements.txt pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

$(VENV)/.installed-dev: requirements-dev.txt $(VENV)/.installed
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# Debian's chromium drives the browser test (never `playwright install`: it downloads a browser).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

app: install
	$(BIN)/python app.py

# One intra-op thread per process: on a 2-core machine running servers and subprocesses
# beside pytest, OpenMP threads waiting on each other cost more than they give.
test: install-dev browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

# The inner loop while editing: everything but the tests marked slow or browser (CI runs all).
test-fast: install-dev
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow and not browser"
