"""Skinny GEMM (decode with very few rows): y[M, N] = x[M, K] @ W[N, K]^T (+ bias).

Why own it: at batch 1 a decode step is a stream of weight reads, and a plain Triton GEMV
(a few weight rows by a long K slice a program, fp32 accumulate) measured faster than
cuBLAS on the H200 here (the team's design notes, performance protocol). `linear_triton` uses the kernel
for M <= MAX_ROWS and cuBLAS otherwise; M is a shape, so under a CUDA graph the choice is
made once per captured batch size.

Kernel design (`_gemv_kernel`): a program owns BLOCK_N weight rows and one K range (all of K,
or 1/SPLIT_K of it). Each K-step loads a [BLOCK_N, BLOCK_K] weight tile (BLOCK_K contiguous
elements a row, so each thread issues 16-byte loads; `evict_first`, the weights are streamed
once) and does an elementwise fp32 FMA into a [BLOCK_N, BLOCK_K] accumulator per row of x; the
cross-lane reduction (`tl.sum(axis=1)`) runs once after the loop. x is loaded in w's register
layout (through 2-D pointers where the 1-D layout would differ, see `_fma_row`), so a K-step has
no shared-memory traffic and no barrier (checked in the sm_90 PTX). M = 2..4 keeps one such
accumulator per row (BLOCK_K is divided by the padded row count to hold registers level).
With SPLIT_K > 1 each program writes an fp32 partial row to a [SPLIT_K, M, N] buffer and a
second small kernel sums the partials, adds the bias and casts (two launches, deterministic,
no memset).

Configs are chosen per weight shape once, never in the hot path: `gemv_config(n, k)` looks
(N, K) up in a small table (`set_gemv_configs` installs a benchmark-chosen one, e.g.
`tools.tune_gemv.sweep()["table"]`) and falls back to `DEFAULT_CONFIG`. The engine's tuned tables are
per-device JSON (kernels/configs/, `tuned_linear`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F

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

MAX_ROWS = 4
_REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class GemvConfig(LaunchConfig):
    """Launch parameters of one weight shape (for M = 1; see `gemv_plan` for M > 1).

    num_stages is passed through, but Triton 3.6 software-pipelines only loads that feed a dot:
    for this loop the sm_90 code is the same for every num_stages (latency is hidden by the
    programs resident on an SM and the BLOCK_N * BLOCK_K / threads loads in flight per thread)."""

    BOUNDS: ClassVar[dict] = {"block_n": (1, 128, True), "block_k": (16, 8192, True), "num_warps": (1, 16, True),
                              "num_stages": (1, 8, False), "split_k": (1, 64, False)}

    block_n: int = 8
    block_k: int = 1024
    num_warps: int = 8
    num_stages: int = 1
    split_k: int = 1
    preload: bool = False  # the first weight tile loaded before the PDL wait (see _gemv_kernel)

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.preload, bool):
            raise ValueError(f"GemvConfig.preload must be a bool, got {self.preload!r}")


# The first untuned kernel of the team's design notes (8 rows x 1,024 columns, 8 warps): 3.91 TB/s overall.
DEFAULT_CONFIG = GemvConfig(block_n=8, block_k=1024, num_warps=8, num_stages=1, split_k=1)

# The process-wide table `gemv_triton` / `linear_triton` read without a config: empty (DEFAULT_CONFIG for every
# shape) until a tool installs a sweep's table. The engine never reads it: its linear carries the GPU's tuned
# table from kernels/configs/ (`tuned_linear`).
_configs: dict[tuple[int, int], GemvConfig] = {}

# Rows up to which the engine's linear uses the Triton GEMV. Measured on the H200 (docs/
# PERFORMANCE.md, run 3, 4096x4096): Triton wins at M=1 (11.3 vs 13.9 us) and M=2 (11.8 vs 13.7),
# cuBLAS at M=3 (13.6 vs 14.2) and M=4 (14.0 vs 15.0).
ENGINE_MAX_ROWS = 2

def parse_shape_key(key) -> tuple[int, int]:
    """(N, K) from a table key: 'NxK' (any case, spaces allowed) or an (N, K) pair of positive ints."""
    dims = None
    if isinstance(key, str):
        parts = key.lower().split("x")
        if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
            dims = int(parts[0]), int(parts[1])
    elif isinstance(key, tuple | list) and len(key) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in key):
        dims = int(key[0]), int(key[1])
    if dims is None or dims[0] <= 0 or dims[1] <= 0:
        raise ValueError(f"a table key's shape must be (N, K) or 'NxK' with positive ints, got {key!r}")
    return dims


def parse_gemv_table(table: Mapping) -> dict[tuple[int, int], GemvConfig]:
    """A per-shape table ((N, K) or "NxK" -> GemvConfig or its dict, as the sweep's JSON gives it),
    validated (bad entries raise ValueError)."""
    if not isinstance(table, Mapping):
        raise ValueError(f"a GEMV table must be a mapping, got {type(table).__name__}")
    return {parse_shape_key(key): GemvConfig.from_any(value) for key, value in table.items()}


def set_gemv_configs(table: Mapping | None) -> dict[tuple[int, int], GemvConfig]:
    """Install the process-wide table that `gemv_triton` and `linear_triton` read when no config is
    given, replacing the current one; None empties it. Everything is validated before
    anything is installed. Returns the previous table. (The engine does not read it: its linear
    carries its own table, see `tuned_linear`.) A CUDA graph keeps the launches it recorded."""
    global _configs
    new = {} if table is None else parse_gemv_table(table)
    previous, _configs = _configs, new
    return previous


def get_gemv_configs() -> dict[tuple[int, int], GemvConfig]:
    return dict(_configs)


def gemv_config(n: int, k: int) -> GemvConfig:
    """The config for a weight of shape [n, k]: the table's entry or DEFAULT_CONFIG."""
    return _configs.get((int(n), int(k)), DEFAULT_CONFIG)


@dataclass(frozen=True)
class GemvPlan:
    """Everything one launch needs; a pure function of (M, N, K, config)."""

    rows: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int          # effective: splits that own at least one column
    k_per_split: int      # multiple of block_k
    even_n: bool
    even_k: bool
    x_2d: bool            # load x with w's 2-D layout (see _fma_row)
    grid: tuple[int, int]
    preload: bool = False


def gemv_plan(m: int, n: int, k: int, config: GemvConfig | None = None, elem_bytes: int = 2) -> GemvPlan:
    """`elem_bytes`: the weight's element size (a thread loads 16 bytes of a row at a time)."""
    cfg = config if config is not None else gemv_config(n, k)
    rows_pad = next_pow2(m)
    # keep the per-thread accumulator size of the M = 1 config; never tile wider than K needs
    block_k = max(16, min(cfg.block_k // rows_pad, next_pow2(k)))
    k_per_split = cdiv(cdiv(k, cfg.split_k), block_k) * block_k
    split_k = cdiv(k, k_per_split)
    even_k = k % block_k == 0 and k_per_split * split_k == k
    # Triton spreads the warps over K first (16-byte vectors a thread); if they cannot all sit on K,
    # a 1-D x would need a layout change in every K-step
    x_2d = block_k < (16 // elem_bytes) * 32 * cfg.num_warps
    return GemvPlan(rows=m, block_n=cfg.block_n, block_k=block_k, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages, split_k=split_k, k_per_split=k_per_split,
                    even_n=n % cfg.block_n == 0, even_k=even_k, x_2d=x_2d, grid=(cdiv(n, cfg.block_n), split_k),
                    preload=cfg.preload)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@triton.jit
def _load_w(w_ptrs, row_mask, col_mask, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_N:
        if EVEN_K:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=col_mask[None, :], other=0.0, eviction_policy="evict_first")
    else:
        if EVEN_K:
            w = tl.load(w_ptrs, mask=row_mask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=row_mask[:, None] & col_mask[None, :], other=0.0,
                        eviction_policy="evict_first")
    return w.to(tl.float32)


@triton.jit
def _load_x(ptrs, col_mask, EVEN_K: tl.constexpr, X_2D: tl.constexpr):
    """fp32 x values at `ptrs` ([BLOCK_N, BLOCK_K] when X_2D, else [BLOCK_K])."""
    if EVEN_K:
        x = tl.load(ptrs)
    elif X_2D:
        x = tl.load(ptrs, mask=col_mask[None, :], other=0.0)
    else:
        x = tl.load(ptrs, mask=col_mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _x_operand(x_ptr, koffs, K, col_mask, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, X_2D: tl.constexpr):
    """The GEMV's x at columns `koffs` of one row; SILU_MUL: round(round(silu(gate)) * up) with
    gate = x[k], up = x[K + k] (the unfused silu_and_mul's rounding), folded into the x loads."""
    x = _load_x(x_ptr + koffs, col_mask, EVEN_K, X_2D)
    if SILU_MUL:
        dt = x_ptr.dtype.element_ty
        up = _load_x(x_ptr + K + koffs, col_mask, EVEN_K, X_2D)
        act = (x / (1.0 + tl.exp(-x))).to(dt).to(tl.float32)
        x = (act * up).to(dt).to(tl.float32)
    return x


@triton.jit
def _fma_row(acc, w, x_ptr, koffs, K, col_mask, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, X_2D: tl.constexpr):
    """acc + w * x, x broadcast over the rows. X_2D loads x through [BLOCK_N, BLOCK_K] pointers, so it
    gets w's register layout (L1-hit duplicates instead of a shared-memory layout change and two
    barriers every K-step); the 1-D load is used where its layout already matches."""
    x = _x_operand(x_ptr, koffs, K, col_mask, SILU_MUL, EVEN_K, X_2D)
    if X_2D:
        return acc + w * x
    else:
        return acc + w * x[None, :]


@triton.jit
def _store_row(y, y_ptr, b_ptr, rows, row_mask, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    if SPLIT_K == 1:
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_mask)
    else:  # fp32 partial; bias and cast in _splitk_reduce_kernel
        tl.store(y_ptr + rows, y, mask=row_mask)


@triton.jit
def _gemv_k_step(w, acc0, acc1, acc2, acc3, x_ptr, koffs, K, col_mask, stride_xm,
                 ROWS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr, X_2D: tl.constexpr):
    """One K-step of every row of x against the weight tile w (one body for the loop and the
    peeled first step of PRELOAD)."""
    acc0 = _fma_row(acc0, w, x_ptr, koffs, K, col_mask, SILU_MUL, EVEN_K, X_2D)
    if ROWS > 1:
        acc1 = _fma_row(acc1, w, x_ptr + stride_xm, koffs, K, col_mask, SILU_MUL, EVEN_K, X_2D)
    if ROWS > 2:
        acc2 = _fma_row(acc2, w, x_ptr + 2 * stride_xm, koffs, K, col_mask, SILU_MUL, EVEN_K, X_2D)
    if ROWS > 3:
        acc3 = _fma_row(acc3, w, x_ptr + 3 * stride_xm, koffs, K, col_mask, SILU_MUL, EVEN_K, X_2D)
    return acc0, acc1, acc2, acc3


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr,
                 N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_ym, stride_ys,
                 ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                 EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, X_2D: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr, PRELOAD: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """y_ptr is y[M, N] (SPLIT_K == 1) or the fp32 partials [SPLIT_K, M, N] (stride_ys a split).
    SILU_MUL folds the MLP's activation into the x loads (x is gate | up, 2K columns). Under PDL the
    programs' launch and address setup overlap the previous kernel's tail. PRELOAD loads the first
    weight tile before pdl_enter (weights are never written) and runs that step peeled off the loop,
    whose code stays that of the plain kernel (session 3's version changed the loop itself,
    `if k0 > 0: load`, and the tuned table ran 0.10 ms slower over the decode set)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    offs_k = tl.arange(0, BLOCK_K)
    k_begin = pid_k * K_PER_SPLIT
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + (k_begin + offs_k)[None, :]
    if X_2D:
        koffs = k_begin + tl.zeros_like(rows)[:, None] + offs_k[None, :]
    else:
        koffs = k_begin + offs_k
    acc0 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    if PRELOAD:
        col_mask = (k_begin + offs_k) < K
        w = _load_w(w_ptrs, row_mask, col_mask, EVEN_N, EVEN_K)
        pdl_enter(USE_PDL)
        acc0, acc1, acc2, acc3 = _gemv_k_step(w, acc0, acc1, acc2, acc3, x_ptr, koffs, K, col_mask, stride_xm,
                                              ROWS, SILU_MUL, EVEN_K, X_2D)
        w_ptrs += BLOCK_K
        koffs += BLOCK_K
        k_first = BLOCK_K
    else:
        pdl_enter(USE_PDL)
        k_first = 0
    for k0 in range(k_first, K_PER_SPLIT, BLOCK_K):
        col_mask = (k_begin + k0 + offs_k) < K
        w = _load_w(w_ptrs, row_mask, col_mask, EVEN_N, EVEN_K)
        acc0, acc1, acc2, acc3 = _gemv_k_step(w, acc0, acc1, acc2, acc3, x_ptr, koffs, K, col_mask, stride_xm,
                                              ROWS, SILU_MUL, EVEN_K, X_2D)
        w_ptrs += BLOCK_K
        koffs += BLOCK_K
    y_row = y_ptr + pid_k * stride_ys
    _store_row(tl.sum(acc0, axis=1), y_row, b_ptr, rows, row_mask, SPLIT_K, HAS_BIAS)
    if ROWS > 1:
        _store_row(tl.sum(acc1, axis=1), y_row + stride_ym, b_ptr, rows, row_mask, SPLIT_K, HAS_BIAS)
    if ROWS > 2:
        _store_row(tl.sum(acc2, axis=1), y_row + 2 * stride_ym, b_ptr, rows, row_mask, SPLIT_K, HAS_BIAS)
    if ROWS > 3:
        _store_row(tl.sum(acc3, axis=1), y_row + 3 * stride_ym, b_ptr, rows, row_mask, SPLIT_K, HAS_BIAS)


@triton.jit
def _splitk_reduce_kernel(p_ptr, b_ptr, y_ptr, N, stride_ps, stride_pm, stride_ym,
                          HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    row = tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    p_ptrs = p_ptr + row * stride_pm + offs
    acc = tl.load(p_ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(p_ptrs + s * stride_ps, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def _splitk_reduce(partials: torch.Tensor, b: torch.Tensor, y: torch.Tensor, has_bias: bool, pdl: bool) -> None:
    """y[M, N] = sum of the fp32 partials[SPLIT_K, M, N] (+ b[N] where has_bias), one rounding: the second launch
    of a split-K GEMV or skinny GEMM (one reduce for both, deterministic). Without a bias `b` is any tensor of the
    launch's (the GEMMs pass their weight), never read."""
    m, n = y.shape
    _splitk_reduce_kernel[(cdiv(n, _REDUCE_BLOCK), m)](
        partials, b, y, n, partials.stride(0), partials.stride(1), y.stride(0),
        HAS_BIAS=has_bias, SPLIT_K=partials.shape[0], BLOCK=_REDUCE_BLOCK, num_warps=4, **pdl_args(pdl),
    )


def _check_args(x, weight, bias, x_cols: int | None = None, fn: str = "gemv_triton"):
    k = weight.shape[1] if weight.dim() == 2 else -1
    ok = (x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and weight.dim() == 2 and x.shape[1] == (x_cols or k)
          and k > 0 and weight.shape[0] > 0 and weight.stride(1) == 1 and x.stride(1) == 1
          and (bias is None or (bias.shape == (weight.shape[0],) and bias.stride(0) == 1)))
    if not ok:
        want = "K" if x_cols is None else "2K"
        raise ValueError(f"{fn} needs x[1..{MAX_ROWS}, {want}] and weight[N, K] with unit last strides "
                         f"(bias [N]), got x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")


def _launch_gemv(x, weight, bias, config, pdl, silu_mul=False):
    require_triton()
    m = x.shape[0]
    n, k = weight.shape
    plan = gemv_plan(m, n, k, config, weight.element_size())
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    b = bias if bias is not None else weight
    if plan.split_k == 1:
        out, stride_ys = y, 0
    else:
        out = torch.empty(plan.split_k, m, n, dtype=torch.float32, device=x.device)
        stride_ys = out.stride(0)
    _gemv_kernel[plan.grid](
        x, weight, b, out,
        n, k, plan.k_per_split, x.stride(0), weight.stride(0), out.stride(-2), stride_ys,
        ROWS=m, HAS_BIAS=bias is not None, SPLIT_K=plan.split_k, EVEN_N=plan.even_n, EVEN_K=plan.even_k, X_2D=plan.x_2d,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, SILU_MUL=silu_mul, PRELOAD=plan.preload,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_args(pdl),
    )
    if plan.split_k > 1:
        _splitk_reduce(out, b, y, bias is not None, pdl)
    return y


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: GemvConfig | None = None, *, pdl: bool = False) -> torch.Tensor:
    """y = x @ weight^T (+ bias) in x's dtype, for x[M <= MAX_ROWS, K] and weight[N, K] rows
    (unit last strides). `config` overrides the table (`gemv_config(N, K)`); `pdl`: launch with
    programmatic dependent launch (kernels/_triton.py: pdl_enter). A config with `preload` reads its
    first weight tile before the PDL wait: under `pdl` the weight must not be written by the kernels
    still running before it in the stream (true of model weights)."""
    _check_args(x, weight, bias)
    return _launch_gemv(x, weight, bias, config, pdl)


def silu_mul_gemv_triton(gate_up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: GemvConfig | None = None, *, pdl: bool = False) -> torch.Tensor:
    """linear(silu_and_mul(gate_up)) in one launch, for gate_up[M <= MAX_ROWS, 2K] (gate | up) and
    weight[N, K]; the activation is rounded as the unfused `silu_and_mul` (bit-equal x operand)."""
    _check_args(gate_up, weight, bias, x_cols=2 * weight.shape[1] if weight.dim() == 2 else None,
                fn="silu_mul_gemv_triton")
    return _launch_gemv(gate_up, weight, bias, config, pdl, silu_mul=True)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Triton GEMV for a handful of rows, cuBLAS for the rest (decided by shape only)."""
    if x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1:
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_engine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  table: Mapping[tuple[int, int], GemvConfig] | None = None, pdl: bool = False) -> torch.Tensor:
    """The engine's GEMM on a tuned GPU: Triton GEMV where it measured faster (M <= ENGINE_MAX_ROWS),
    cuBLAS otherwise. M is a shape: under a CUDA graph the choice is made once per bucket. `table`
    ((N, K) -> GemvConfig; None: the process-wide table) picks the launch. A shape the table lacks
    goes to cuBLAS: only measured shapes take the Triton GEMV (the untuned DEFAULT_CONFIG lost to
    cuBLAS over the Qwen3-8B decode set, 5.12 vs 4.21 ms, run 10). `pdl`: the GEMV is launched under
    programmatic dependent launch (sm_90+)."""
    if x.dim() == 2 and 1 <= x.shape[0] <= ENGINE_MAX_ROWS and x.stride(1) == 1 and weight.stride(1) == 1:
        if table is None:
            return gemv_triton(x, weight, bias, pdl=pdl)
        config = table.get(weight.shape)
        if config is not None:
            return gemv_triton(x, weight, bias, config=config, pdl=pdl)
    return F.linear(x, weight, bias)


def tuned_linear(table: Mapping | None, pdl: bool = False):
    """Pick the engine's linear once: linear_engine bound to a tuned per-shape table ("NxK" -> config, a
    GPU's `gemv` or `gemv_no_pdl` section of kernels/configs/*.json, or a sweep's), or cuBLAS (linear_ref)
    without one. Nothing process-wide changes: two engines on different GPUs each keep their own table.
    Without `pdl` any `preload` is dropped: there is no wait to hide a load behind, and the peeled kernel
    measured slower there (run 25: 228.6 against 234.0 tok/s)."""
    if not table:  # no table, or an empty one: cuBLAS everywhere
        return linear_ref
    configs = parse_gemv_table(table)
    if not pdl:
        configs = {shape: replace(cfg, preload=False) for shape, cfg in configs.items()}
    return functools.partial(linear_engine, table=configs, pdl=pdl)


__all__ = [
    "DEFAULT_CONFIG", "ENGINE_MAX_ROWS", "MAX_ROWS",
    "GemvConfig", "GemvPlan",
    "gemv_config", "gemv_plan", "gemv_triton", "get_gemv_configs", "linear_engine", "linear_ref", "linear_triton",
    "parse_gemv_table", "parse_shape_key", "set_gemv_configs", "tuned_linear",
]
