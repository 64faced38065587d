#!/usr/bin/env bash
# The test suite on the CPU (Triton kernels run in the interpreter): ruff, then pytest.
#   bash scripts/test.sh           the full suite (what .ci/run runs), over 2 pytest-xdist workers
#   bash scripts/test.sh --quick   the fast tier: every component, without the tests marked slow, tp or gpu
# Further arguments go to pytest after ours (-x, -k NAME, a path, -n 0 for one process, -m "...").
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [[ "${1:-}" == "--quick" ]]; then
    quick=1
    shift
fi
lint=(metainfer tests)
[[ -d tools ]] && lint+=(tools)
ruff check "${lint[@]}"
# loadscope: a module's tests stay on one worker, so a module-scoped fixture (a tiny checkpoint and
# its HF reference) is built once, not once per worker
workers=(-n 2 --dist loadscope)
# a test path among the arguments replaces the default `tests` (else pytest would run both)
where=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        where=()
        break
    fi
done
if ((quick)); then
    python -m pytest "${where[@]}" -p no:cacheprovider "${workers[@]}" -m "not slow and not tp and not gpu" "$@"
else
    python -m pytest "${where[@]}" -p no:cacheprovider "${workers[@]}" "$@"
fi
