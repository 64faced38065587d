"""Skinny GEMM on tensor cores for decode batches of a few to ~64 rows: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).

Why: between the Triton GEMV (M <= 2) and the compute-bound batches, every decode step streams all
weights once, yet cuBLAS ran the Qwen3-8B decode set at 4.26-4.40 ms for M = 4..64 on the H200
against 3.745 ms for the GEMV at M = 1 (docs/PERFORMANCE.md, run 17, `gemm_rows`): ~0.5-0.9 ms a
step above the weight-streaming floor. The engine takes it for the (shape, row bucket) entries of
its GPU's tuned table (the `skinny` section of kernels/configs/<gpu>.json, chosen by
`tools.tune_skinny.sweep`; EngineConfig.enable_skinny_gemm=False turns it off), cuBLAS elsewhere.

Contract: `skinny_gemm_triton(x[M, K], weight[N, K], bias[N] or None, config=None, *, pdl=False)
-> y[M, N]` in x's dtype, unit last strides, any M >= 1 (M <= MAX_ROWS: the padded batch is one
MMA operand); fp32 accumulation, the bias added in fp32, one rounding at the end (as F.linear).

Kernel design (`_skinny_gemm_kernel`, "swap AB"): a program owns BLOCK_N weight rows and one K
range; each step multiplies a [BLOCK_N, BLOCK_K] weight tile by the [BLOCK_K, BLOCK_M] transposed
x tile (the batch padded to BLOCK_M >= 16 is the MMA's narrow side), so the weight stream, the
only large operand, feeds tensor cores through Triton's software-pipelined loads (num_stages).
Grids of few programs (the 4096-row shapes: 64 at BLOCK_N 64) split K so that ~2 programs run on
each of ~132 SMs; the fp32 partials are summed by the GEMV's reduce kernel (gemv._splitk_reduce, deterministic).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from ._triton import (
    LaunchConfig,
    cdiv,
    next_pow2,
    pdl_args,
    pdl_enter,
    require_triton,
    tl,
    triton,
)
from .gemv import ENGINE_MAX_ROWS, _splitk_reduce, parse_shape_key

MAX_ROWS = 64
# Programs a launch aims for when its config leaves split_k to the shape (split_k=0): two per SM
# of an H200. A shape choice only: no CUDA call, so the launch stays graph-capturable.
_TARGET_PROGRAMS = 264


@dataclass(frozen=True)
class SkinnyConfig(LaunchConfig):
    """Launch parameters of one weight shape; split_k 0 picks the split from the grid size."""

    BOUNDS: ClassVar[dict] = {"block_n": (16, 256, True), "block_k": (16, 1024, True), "num_warps": (1, 16, True),
                              "num_stages": (1, 8, False), "split_k": (0, 64, False)}

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 0


DEFAULT_CONFIG = SkinnyConfig()


def skinny_block_m(m: int) -> int:
    """The padded row count a launch compiles for (the MMA's narrow side: at least 16)."""
    return max(16, next_pow2(m))


def skinny_table_key(n: int, k: int, block_m: int) -> str:
    return f"{n}x{k}/m{block_m}"


def _parse_skinny_key(key) -> tuple[int, int, int]:
    """(N, K, BLOCK_M) from 'NxK/mB' (any case, spaces allowed, as the GEMV's keys) or an (N, K, B)
    triple of ints; B is a padded row count: 16, 32 or 64."""
    shape = block_m = None
    if isinstance(key, str):
        shape, sep, bucket = key.lower().partition("/m")
        block_m = int(bucket) if sep and bucket.strip().isdigit() else None
    elif isinstance(key, tuple | list) and len(key) == 3 and isinstance(key[2], int) and not isinstance(key[2], bool):
        shape, block_m = tuple(key[:2]), key[2]
    if block_m not in (16, 32, 64):
        raise ValueError(f"a skinny GEMM table key must be 'NxK/mB' or (N, K, B) with B in 16/32/64, got {key!r}")
    try:
        return (*parse_shape_key(shape), block_m)
    except ValueError as exc:
        raise ValueError(f"bad skinny GEMM table key {key!r}: {exc}") from None


def parse_skinny_table(table: Mapping) -> dict[tuple[int, int, int], SkinnyConfig]:
    """A per-(shape, row bucket) table ("NxK/mBLOCK_M" or (N, K, BLOCK_M) -> config or its dict, as
    tools.tune_skinny.sweep gives it), validated: bad keys or configs raise ValueError."""
    if not isinstance(table, Mapping):
        raise ValueError(f"a skinny GEMM table must be a mapping, got {type(table).__name__}")
    return {_parse_skinny_key(key): SkinnyConfig.from_any(value) for key, value in table.items()}


def skinny_split_k(n: int, k: int, config: SkinnyConfig = DEFAULT_CONFIG) -> int:
    """K splits of a launch: the config's, or (split_k 0) enough to bring the grid near
    _TARGET_PROGRAMS, keeping at least 4 K-steps a split."""
    if config.split_k:
        return config.split_k
    programs = cdiv(n, config.block_n)
    wanted = cdiv(_TARGET_PROGRAMS, programs)
    return max(1, min(wanted, k // (4 * config.block_k)))


@triton.jit(do_not_specialize=["M"])  # one compile for every row count of a BLOCK_M (no M % 16 variants)
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, k_per_split,
                        stride_xm, stride_wn, stride_om, stride_os,
                        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """acc[n, m] = sum_k W[n, k] x[m, k] over this program's rows and K range; stored as out[m, n]
    (the output itself, or with SPLIT_K > 1 an fp32 partial at out + pid_k * stride_os)."""
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ms = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    row_mask = rows < N
    m_mask = ms < M
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_begin + offs_k)[None, :]
    x_ptrs = x_ptr + ms[None, :] * stride_xm + (k_begin + offs_k)[:, None]  # the x^T tile [BLOCK_K, BLOCK_M]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        k_mask = (k0 + offs_k) < k_end
        w = tl.load(w_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
        xt = tl.load(x_ptrs, mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out_ptrs = out_ptr + pid_k * stride_os + ms[None, :] * stride_om + rows[:, None]
    mask = row_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc, mask=mask)


def skinny_gemm_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                       config: SkinnyConfig | None = None, *, pdl: bool = False) -> torch.Tensor:
    """y = x @ weight^T (+ bias) for x[1..MAX_ROWS, K], weight[N, K] (unit last strides), in x's
    dtype. `pdl`: launched under programmatic dependent launch (sm_90+)."""
    require_triton()
    k = weight.shape[1] if weight.dim() == 2 else -1
    if not (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.shape[1] == k and k > 0 and weight.shape[0] > 0
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype
            and (bias is None or (bias.shape == (weight.shape[0],) and bias.stride(0) == 1))):
        raise ValueError(f"skinny_gemm_triton needs x[1..{MAX_ROWS}, K] and weight[N, K] of one dtype with unit "
                         f"last strides (bias [N]), got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
                         f"{weight.dtype}, bias {None if bias is None else tuple(bias.shape)}")
    cfg = config or DEFAULT_CONFIG
    m, (n, k) = x.shape[0], weight.shape
    split = min(skinny_split_k(n, k, cfg), cdiv(k, cfg.block_k))
    k_per_split = cdiv(cdiv(k, split), cfg.block_k) * cfg.block_k
    split = cdiv(k, k_per_split)  # every split non-empty
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    out = y if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else weight
    _skinny_gemm_kernel[(cdiv(n, cfg.block_n), split)](
        x, weight, b, out, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), out.stride(-2), out.stride(0) if split > 1 else 0,
        HAS_BIAS=bias is not None, SPLIT_K=split, BLOCK_M=skinny_block_m(m), BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(pdl),
    )
    if split > 1:
        _splitk_reduce(out, b, y, bias is not None, pdl)
    return y


def linear_with_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, base, pdl: bool,
                       table: Mapping[tuple[int, int, int], SkinnyConfig] | None = None,
                       min_rows: int = ENGINE_MAX_ROWS + 1) -> torch.Tensor:
    """The engine's linear with the skinny GEMM for min_rows..MAX_ROWS rows (by shape: under a CUDA
    graph the choice is made once per bucket) and `base` (the tuned GEMV / cuBLAS linear) otherwise.
    `table` ((N, K, BLOCK_M) -> config): only its entries take the skinny GEMM; None: DEFAULT_CONFIG
    for every shape (the untuned A/B)."""
    if (x.dim() == 2 and min_rows <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1
            and x.dtype == weight.dtype and (bias is None or bias.stride(0) == 1)):
        if table is None:
            return skinny_gemm_triton(x, weight, bias, pdl=pdl)
        config = table.get((weight.shape[0], weight.shape[1], skinny_block_m(x.shape[0])))
        if config is not None:
            return skinny_gemm_triton(x, weight, bias, config, pdl=pdl)
    return base(x, weight, bias)


__all__ = ["DEFAULT_CONFIG", "MAX_ROWS", "SkinnyConfig", "linear_with_skinny", "parse_skinny_table",
           "skinny_block_m", "skinny_gemm_triton", "skinny_split_k", "skinny_table_key"]
