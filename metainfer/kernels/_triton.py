"""Guarded Triton import shared by the kernel modules.

`import metainfer.kernels` must work on machines without Triton (the CPU path only needs the
torch references) and must never touch CUDA. Importing triton does neither, but it may be absent:
then `triton.jit` becomes a stub that keeps the kernel definitions importable and raises when a
Triton launcher is actually used.
"""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError("triton is not installed: use the *_ref kernels (select_ops('cpu'))")

    def _missing_jit(fn=None, **_kwargs):
        return _MissingKernel(fn) if fn is not None else _MissingKernel

    triton = types.SimpleNamespace(jit=_missing_jit, cdiv=lambda a, b: -(-a // b))
    # Only what kernel *signatures* evaluate at definition time is needed here.
    tl = types.SimpleNamespace(constexpr=object)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton tile sizes must be powers of two)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: use the *_ref kernels (select_ops('cpu'))")


__all__ = ["HAS_TRITON", "cdiv", "next_pow2", "require_triton", "tl", "triton"]
