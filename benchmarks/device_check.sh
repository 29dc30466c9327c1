#!/usr/bin/env bash
# The GPU checks, in one run on a machine with a CUDA GPU: the Triton kernel tests, the CUDA-graph tests,
# benchmarks/kernels.py, and decode speed with CUDA graphs ("ours") against the eager forward ("eager").
#
# The machine needs no weights: the model is SmolLM2-135M's architecture with random weights, built there from
# its config and tokenizer files (speed does not depend on the weights' values). Prepare them here first:
#   mkdir -p .device && cp ~/.cache/hf_paged/SmolLM2-135M-Instruct/{config.json,tokenizer*,special_tokens_map.json} .device/
# and, where the GPU machine's Transformers is older than ours, its wheel: pip download --no-deps -d .device
# transformers==<ours>. The device tool carries .device (carry: [".device"]; .git/info/exclude ignores it).
# Results land in $OUT (default: ./device-out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
if ls .device/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"

python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py tests/test_cuda_graphs.py 2>&1 | tee "$OUT/tests.log"
python3 benchmarks/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
if [ -f .device/config.json ]; then
  python3 benchmarks/random_heads_model.py /tmp/smollm2-random --model .device --heads 9 --kv-heads 3
  python3 benchmarks/decode.py --device cuda --model /tmp/smollm2-random --batch-sizes 1,8,32 \
    --dtypes bfloat16 --rounds 2 --variants ours,eager --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log"
fi
