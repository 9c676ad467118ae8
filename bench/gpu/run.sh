#!/usr/bin/env bash
# The GPU measurements, from the repository root, in one script:
#
#     bash bench/gpu/run.sh [OUT_DIR]            # on a CUDA machine; default OUT_DIR: bench/results/gpu-<date>
#     bash bench/gpu/run.sh --smoke [OUT_DIR]    # on CPU with a tiny model: checks this script end to end
#
# 1. Set-up (not timed): .venv-vllm with the CUDA `vllm` wheel (VLLM_VERSION in the Makefile) and
#    grpokit, plus trl (TRL_VERSION) for its colocated-vLLM side.
# 2. bench/layouts.py (the timed part, a few minutes on one GPU): the same GRPO work (16 prompts x 8
#    completions of 256 tokens a step, 6 steps) on a model built offline with Qwen2.5-0.5B's layer
#    shapes (0.36 B parameters, bfloat16) in four layouts: one process (`hf`), colocated vLLM,
#    a rollout server on the same GPU, and TRL's GRPOTrainer with vLLM colocated; trajectories/s
#    and tokens/s, the step split into generation, training and weight sync.
# 3. `make test-vllm` (tests/rollout/vllm on the GPU) and bench/rollout.py (HF engine vs vLLM
#    tokens/s), when RUN_TESTS=1 (the default; RUN_TESTS=0 skips them).
# Results: OUT_DIR/layouts.json and .log, OUT_DIR/test-vllm.log, OUT_DIR/rollout-*.json.
set -euo pipefail
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT=${1:-bench/results/gpu-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$OUT"

if [ "$SMOKE" = 1 ]; then
    make -s .venv/.grpokit-installed .venv-bench/.bench-installed
    .venv/bin/python bench/layouts.py --smoke --trl-python .venv-bench/bin/python --out "$OUT/layouts-smoke.json" \
        2>&1 | tee "$OUT/layouts-smoke.log"
    echo "results in $OUT"
    exit 0
fi

command -v nvidia-smi >/dev/null || { echo "bench/gpu/run.sh: no nvidia-smi here: this script is for a CUDA machine (--smoke runs on CPU)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
TRL_VERSION=$(sed -n 's/^TRL_VERSION *?= *//p' Makefile)
make -s .venv-vllm/.vllm-installed
PY=.venv-vllm/bin/python
"$PY" -m pip install -q "trl==$TRL_VERSION" "transformers==5.18.0" "$("$PY" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])')" \
    || echo "note: trl could not be installed into .venv-vllm; the trl layout will fail and be reported"

start=$(date +%s)
"$PY" bench/layouts.py --size qwen05b --steps 6 --prompts 16 --group-size 8 --max-new-tokens 256 --device cuda \
    --trl-python "$PY" --out "$OUT/layouts.json" 2>&1 | tee "$OUT/layouts.log"
echo "layouts: $(( $(date +%s) - start )) s" | tee -a "$OUT/layouts.log"

if [ "${RUN_TESTS:-1}" = 1 ]; then
    make test-vllm 2>&1 | tee "$OUT/test-vllm.log"
    "$PY" bench/rollout.py --size qwen05b --dtype bfloat16 --prompts 64 --n 8 --max-new-tokens 256 \
        --rounds 3 --kv-cache-mb 8192 --out "$OUT/rollout-qwen05b.json" 2>&1 | tee "$OUT/rollout-qwen05b.log"
fi
echo "results in $OUT"
