#!/usr/bin/env bash
# The test suite (CPU): ruff, then pytest over tests/ (Triton kernels run interpreted).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff check metainfer tests
python -m pytest tests -p no:cacheprovider "$@"
