#!/usr/bin/env bash
# The GPU paths checked in one command on a CUDA machine with torch and transformers only
# (no Ray, no vLLM): bench.gpu_check --quick (learner 8 vs 1 adapter, mixed decode eager and
# as CUDA graphs, the DeepSpeed strategy against the torch strategy where deepspeed imports).
#   make device-wheels            # here: deepspeed and what it needs, into .whl/
#   bash bench/device_check.sh    # there, with .whl/ carried beside the tree
# Writes gpu_check.json and the log under $OUT (default bench/results).
set -uo pipefail
out="${OUT:-bench/results}"
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$out/device.txt"
POPULORA_BENCH_RESULTS="$out" PYTHONUNBUFFERED=1 timeout "${CHECK_TIMEOUT:-480}" python3 -m bench.gpu_check --quick \
  2>&1 | tee "$out/gpu_check.log"
