# The two set-up commands of the README. Each one installs what it needs into .venv.
#   make app   - launch the Gradio app on the bundled MNIST model (http://127.0.0.1:7860)
#   make test  - run the whole test suite (installs Debian chromium for the browser test)

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: app test test-fast install install-dev browser screenshots

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: requirements.txt pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $@

# The Node example's pinned packages (tests/test_node_example.py runs it), without the CUDA
# libraries onnxruntime-node would otherwise download; onnxruntime-web's npm tarball, which
# tests/test_static_space.py vendors into a static Space (vit_hub.hub.static_space.ORT_WEB_VERSION).
$(VENV)/.installed-dev: requirements-dev.txt examples/node/package-lock.json $(VENV)/.installed
	$(BIN)/pip install -q -r requirements-dev.txt
	cd examples/node && ONNXRUNTIME_NODE_INSTALL_CUDA=skip npm ci --no-audit --no-fund --loglevel=error
	mkdir -p $(VENV)/cache && cd $(VENV)/cache && npm pack onnxruntime-web@1.30.0 --silent >/dev/null
	touch $@

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

# Debian's chromium drives the browser test (never `playwright install`: it downloads a browser).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

app: install
	$(BIN)/python app.py

# The README's pictures of the app (docs/app_screenshot.png, docs/app_inside.png), taken from the live app.
screenshots: install-dev browser
	OMP_NUM_THREADS=1 $(BIN)/python docs/screenshots.py
	OMP_NUM_THREADS=1 $(BIN)/python docs/static_screenshot.py --onnxruntime-web $(VENV)/cache/onnxruntime-web-1.30.0.tgz

# One intra-op thread per process: on a 2-core machine running servers and subprocesses
# beside pytest, OpenMP threads waiting on each other cost more than they give.
test: install-dev browser
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q

# The inner loop while editing: everything but the tests marked slow or browser (CI runs all).
test-fast: install-dev
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow and not browser"
