#!/usr/bin/env bash
# The GPU checks, in one run of under ten minutes on a machine with a CUDA GPU: the Triton kernel tests and the
# CUDA-graph tests, benchmarks/kernels.py, and decode speed with CUDA graphs ("ours") against the eager forward
# ("eager"). It uses the machine's own torch, Triton and Transformers (the device image's Transformers 5.17 imports
# hf_paged and passes these tests; a newer wheel would need a newer huggingface-hub than the image has).
#
# The machine needs no weights: the model is SmolLM2-135M's architecture with random weights, built there from its
# config and tokenizer files (speed does not depend on the weights' values). Prepare them here first:
#   mkdir -p .device && cp ~/.cache/hf_paged/SmolLM2-135M-Instruct/{config.json,tokenizer*} .device/
#   echo /.device/ >> .git/info/exclude; echo /device-out/ >> .git/info/exclude
# then call the device tool with carry [".device"], timeout_s 560 and the command `bash benchmarks/device_check.sh`.
# Results land in $OUT (default: ./device-out): gpu.txt, tests.log, kernels.json, kernels.log, decode.json and
# decode.log, six files.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_PAGED_CACHE=/tmp/hf-paged-cache
{
  nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  python3 -c "import hf_paged" && echo "hf_paged imports"
} 2>&1 | tee "$OUT/gpu.txt" || { echo "preflight failed: see gpu.txt"; exit 1; }
grep -q "hf_paged imports" "$OUT/gpu.txt" || exit 1

workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 8" || echo "")
timeout 300 python3 -m pytest -q -p no:cacheprovider $workers --durations=15 \
  tests/test_triton_kernels.py tests/test_cuda_graphs.py 2>&1 | tee "$OUT/tests.log"
timeout 120 python3 benchmarks/kernels.py --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
if [ -f .device/config.json ]; then
  python3 benchmarks/random_heads_model.py /tmp/smollm2-random --model .device --heads 9 --kv-heads 3 &&
  timeout 150 python3 benchmarks/decode.py --device cuda --model /tmp/smollm2-random --batch-sizes 1,32 \
    --dtypes bfloat16 --rounds 1 --variants ours,eager --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log"
fi
