#!/usr/bin/env bash
# CPU figures of the embedded default (SmolLM2-135M GGUF, fp32): ours vs HF transformers
# eager in the same run, batch 1 and batch 8. JSON into ${OUT:-docs/results}.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-docs/results}"
mkdir -p "$out"
for bs in 1 8; do
  python -m metainfer.entrypoints.cli bench latency --device cpu --batch-size "$bs" --input-len 32 \
    --output-len 64 --iters 2 --output-json "$out/cpu_latency_bs$bs.json"
  python -m metainfer.entrypoints.cli bench baseline --device cpu --batch-size "$bs" --input-len 32 \
    --output-len 64 --iters 2 --modes eager --output-json "$out/cpu_hf_eager_bs$bs.json"
done
