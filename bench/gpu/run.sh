#!/usr/bin/env bash
# The vLLM tier and the rollout benchmark on a CUDA machine, from the repository root:
#
#     bash bench/gpu/run.sh [OUT_DIR]          # default OUT_DIR: bench/results/gpu-<date>
#
# 1. `make test-vllm`: .venv-vllm with the CUDA `vllm` wheel (VLLM_VERSION in the Makefile) and
#    grpokit; tests/rollout/vllm on the GPU (tiny Llama / Qwen2 built on the spot, float32).
# 2. bench/rollout.py on a model built offline with Qwen2.5-0.5B's layer shapes (hidden 896 x 24
#    layers, 14 query / 2 key-value heads, MLP 4864; a character vocabulary, so about 0.36 B
#    parameters, the non-embedding size of Qwen2.5-0.5B), in bfloat16: HF engine vs vLLM
#    tokens/s on the same prompts, as a ratio. A second run uses a real model when MODEL=DIR
#    (a local Hugging Face directory; nothing is downloaded).
# Results: OUT_DIR/test-vllm.log, OUT_DIR/rollout-*.json and .log.
set -euo pipefail
command -v nvidia-smi >/dev/null || { echo "bench/gpu/run.sh: no nvidia-smi here: this script is for a CUDA machine" >&2; exit 2; }
OUT=${1:-bench/results/gpu-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"

make test-vllm 2>&1 | tee "$OUT/test-vllm.log"

PY=.venv-vllm/bin/python
"$PY" bench/rollout.py --size qwen05b --dtype bfloat16 --prompts 64 --n 8 --max-new-tokens 256 \
    --rounds 3 --kv-cache-mb 8192 --out "$OUT/rollout-qwen05b.json" 2>&1 | tee "$OUT/rollout-qwen05b.log"
if [ -n "${MODEL:-}" ]; then
    "$PY" bench/rollout.py --model "$MODEL" --dtype bfloat16 --prompts 64 --n 8 --max-new-tokens 256 \
        --rounds 3 --kv-cache-mb 8192 --out "$OUT/rollout-model.json" 2>&1 | tee "$OUT/rollout-model.log"
fi
echo "results in $OUT"
