"""Fused mixture-of-experts in Triton (DeepSeek-V2-Lite, Qwen3-30B-A3B): routing-sorted grouped GEMMs.

Why: a MoE layer is E small MLPs of which each token uses K. Looping over experts in torch
(kernels/moe_ref.py) costs a host sync and ~3 launches per expert; at batch 1 the layer should
cost what reading the K selected experts' weights costs (DeepSeek-V2-Lite: 6 of 64 experts, ~104 MB
a layer in bf16). Here the (token, slot) pairs are grouped by expert on the device and two grouped
GEMMs run over the groups, so only the selected experts' weights are read, with no host sync
(the whole layer is CUDA-graph capturable).

Contracts (the math and rounding of kernels/moe_ref.py, docs/CONTRACTS.md "MoE"):
- `moe_align(topk_ids i32[T,K], num_experts, block_m) -> (sorted_ids i32[P_max], expert_of_block
  i32[P_max // block_m], num_tokens_post_padded i32[1])`: pair p = t*K + k listed by expert, each
  expert's run padded to a multiple of block_m with the sentinel T*K; experts without pairs get no
  block; P_max = round_up(T*K + min(E, T*K)*(block_m - 1), block_m) is known on the host (at most
  min(E, T*K) experts hold pairs, each wasting at most block_m - 1 rows: at T = 1, K = 6 the grids
  hold exactly the 6 possible blocks, not the ~E of the looser T*K + E*(block_m - 1)). Entries of
  expert_of_block past num_tokens_post_padded // block_m are -1. The order of pairs inside an
  expert's run is unspecified (atomics); nothing downstream depends on it. Ids outside [0, E) are
  left out (they contribute nothing).
- `fused_moe_triton(x[T,H], w13[E,2N,H], w2[E,H,N], topk_weights f32[T,K], topk_ids i32[T,K], *,
  table=None, pdl=False, config=None) -> y[T,H]` in x's dtype: fused_moe_ref's math. The gate/up
  GEMM output is rounded to x's dtype, SiLU(gate)*up computed in fp32 and rounded; the down GEMM
  output rounded, times the routing weight in fp32, the product rounded to x's dtype; the K terms summed
  in fp32, rounded once.
- `fused_moe_slots_triton(...same...) -> ExpertSlots` (kernels/moe_ref.py): kernels 1-4 below, the [T*K, H]
  slot terms before the sum, in x's dtype (why, and how HF transformers rounds them: moe_ref's docstring);
  `moe_sum_triton(slots, dtype)` is kernel 5. The engine's MoE block
  at tp = 1 hands the slots to the next RMSNorm, which sums them in fp32 in its own launch
  (kernels/rms_norm.py).
Routing (route_topk_triton, router_topk_triton) lives in kernels/moe_routing.py.
Kernels (each launched with pdl_enter first, so `pdl=True` chains them under programmatic
dependent launch):
1. `_moe_align_count_kernel` (one program): per-expert histogram, padded prefix sum, the block ->
   expert map, the padded total, a write cursor per expert, sentinel fill of sorted_ids.
2. `_moe_align_scatter_kernel`: each pair takes its slot with an atomic add on its expert's cursor.
3. `_moe_gate_up_kernel`: grouped GEMM over the sorted blocks, x rows gathered by token; one program
   holds matching gate and up tiles ([BLOCK_M, BLOCK_N] each) so SiLU(gate)*up is applied in
   registers; writes inter[T*K, N] (x's dtype) in pair order.
4. `_moe_down_kernel`: inter @ w2[e]^T rounded to x's dtype, epilogue times the routing weight (fp32),
   stored as out[T*K, H] in x's dtype (at prefill sizes T*K*H elements written and read once: in bf16 half
   the bytes of the fp32 slots this replaced, which the norm that sums them read K of a token).
5. `_moe_sum_kernel`: y[t] = sum over the K slots with a valid id, each loaded as fp32 (fp32 sum), one
   rounding.
The down half stays a grouped GEMM plus the sum kernel at decode sizes too: a per-token down GEMV that
summed the K experts in registers (no [T*K, H] round trip, one launch fewer) lost its H200 A/B
(run 62: DeepSeek-V2-Lite bs1 2.38 -> 2.63 ms, Qwen3-30B-A3B 2.84 -> 3.25 ms) and was deleted.
Grids are sized from P_max (host-known); programs whose block starts at or past
num_tokens_post_padded return at once. GROUP_M swizzles the (m, n) program order so blocks of one
expert reuse weight tiles from the L2 at large T.

Configs: `MoeConfig` (block_m, block_n, block_k, group_m, num_warps, num_stages), one for both GEMMs
(block_m is also moe_align's padding). `default_moe_config(T)` guesses by T; the tuned table is the
`moe` section of kernels/configs/<gpu>.json: "E{E}_N{N}_H{H}" -> {"<max tokens bucket>": config},
the smallest bucket >= T taken (the largest beyond), written by tools/tune_moe.py.
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
from .moe_ref import ExpertSlots

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_COUNT_BLOCK = 4096  # pairs a step of the one-program count kernel (few serial steps at prefill sizes)
_ALIGN_BLOCK = 1024  # pairs a program of the scatter kernel
_SUM_BLOCK = 1024  # hidden columns per program of the K-slot sum


@dataclass(frozen=True)
class MoeConfig(LaunchConfig):
    """Launch parameters of both grouped GEMMs (block_m is also the per-expert padding)."""

    BOUNDS: ClassVar[dict] = {"block_m": (16, 256, True), "block_n": (16, 256, True), "block_k": (16, 256, True),
                              "group_m": (1, 64, False), "num_warps": (1, 16, True), "num_stages": (1, 8, False)}

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


def default_moe_config(num_tokens: int) -> MoeConfig:
    """Untuned guess by T: 16-row blocks for decode-sized batches (most experts see 0-2 pairs),
    larger blocks and L2 grouping once experts see tens of rows."""
    if num_tokens <= 32:
        return MoeConfig(16, 64, 128, 1, 4, 3)
    if num_tokens <= 256:
        return MoeConfig(32, 64, 128, 4, 4, 3)
    return MoeConfig(64, 128, 64, 8, 8, 3)


def moe_table_key(num_experts: int, n: int, hidden: int) -> str:
    return f"E{num_experts}_N{n}_H{hidden}"


def _parse_moe_key(key) -> tuple[int, int, int]:
    if isinstance(key, tuple | list) and len(key) == 3 and all(isinstance(v, int) and not isinstance(v, bool)
                                                              for v in key):
        dims = tuple(key)
    else:
        parts = key.upper().split("_") if isinstance(key, str) else []
        dims = None
        if len(parts) == 3 and [p[:1] for p in parts] == ["E", "N", "H"] and all(p[1:].isdigit() for p in parts):
            dims = tuple(int(p[1:]) for p in parts)
    if dims is None or min(dims) <= 0:
        raise ValueError(f"a MoE table key must be 'E{{E}}_N{{N}}_H{{H}}' or (E, N, H) with positive ints, got {key!r}")
    return dims


def _parse_bucket(bucket) -> int:
    value = int(bucket) if isinstance(bucket, str) and bucket.strip().isdigit() else bucket
    if isinstance(value, bool) or value not in TOKEN_BUCKETS:
        raise ValueError(f"a MoE token bucket must be one of {TOKEN_BUCKETS}, got {bucket!r}")
    return value


def parse_moe_table(table: Mapping) -> dict[tuple[int, int, int], dict[int, MoeConfig]]:
    """The `moe` section ("E{E}_N{N}_H{H}" -> {"<bucket>": config dict}) validated into
    {(E, N, H): {bucket: MoeConfig}} sorted by bucket; bad keys or configs raise ValueError."""
    if not isinstance(table, Mapping):
        raise ValueError(f"a MoE table must be a mapping, got {type(table).__name__}")
    out = {}
    for key, buckets in table.items():
        if not isinstance(buckets, Mapping) or not buckets:
            raise ValueError(f"MoE table entry {key!r} must be a non-empty mapping of token bucket -> config")
        parsed = {_parse_bucket(b): MoeConfig.from_any(c) for b, c in buckets.items()}
        out[_parse_moe_key(key)] = dict(sorted(parsed.items()))
    return out


def pick_bucket(num_tokens: int, buckets) -> int:
    """The smallest bucket >= num_tokens, the largest where none is."""
    ordered = sorted(buckets)
    return next((b for b in ordered if b >= num_tokens), ordered[-1])


def moe_config(table: Mapping | None, num_experts: int, n: int, hidden: int, num_tokens: int) -> MoeConfig:
    """The tuned config of (E, N, H) at T tokens from `table` (parsed by parse_moe_table, or the raw
    JSON section), `default_moe_config(T)` where the table has no entry for the shape."""
    if table:
        entry = table.get((num_experts, n, hidden))
        if entry is None:
            entry = table.get(moe_table_key(num_experts, n, hidden))
            if entry is not None:
                entry = {_parse_bucket(b): c for b, c in entry.items()}
        if entry:
            return MoeConfig.from_any(entry[pick_bucket(max(num_tokens, 1), entry)])
    return default_moe_config(num_tokens)


def moe_max_padded(num_pairs: int, num_experts: int, block_m: int) -> int:
    """P_max: the host-known bound on the padded pair count (each of the at most min(E, T*K) non-empty
    experts' runs rounded up)."""
    return cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


# ----------------------------------------------------------------------------- moe_align


@triton.jit(do_not_specialize=["num_pairs", "max_padded"])  # one compile for every batch size
def _moe_align_count_kernel(ids_ptr, sorted_ids_ptr, expert_of_block_ptr, num_post_ptr, cursor_ptr,
                            num_pairs, num_experts, max_padded,
                            BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr):
    """One program: counts per expert, their padded prefix sum, expert_of_block, the padded total,
    each expert's write cursor (its run's start) and the sentinel fill of sorted_ids."""
    pdl_enter(USE_PDL)
    offs = tl.arange(0, BLOCK)
    counts = tl.zeros([E_PAD], tl.int32)
    for start in range(0, num_pairs, BLOCK):
        in_range = start + offs < num_pairs
        ids = tl.load(ids_ptr + start + offs, mask=in_range, other=-1)
        valid = in_range & (ids >= 0) & (ids < num_experts)
        counts += tl.histogram(tl.where(valid, ids, 0), E_PAD, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    total = tl.sum(padded, 0)
    experts = tl.arange(0, E_PAD)
    tl.store(cursor_ptr + experts, ends - padded, mask=experts < num_experts)
    tl.store(num_post_ptr, total)
    blocks = tl.arange(0, BLOCK_B)
    for b0 in range(0, max_padded // BLOCK_M, BLOCK_B):
        pos = (b0 + blocks) * BLOCK_M
        owner = tl.sum((ends[None, :] <= pos[:, None]).to(tl.int32), axis=1)
        tl.store(expert_of_block_ptr + b0 + blocks, tl.where(pos < total, owner, -1),
                 mask=pos < max_padded)
    sentinel = tl.full([BLOCK], 0, tl.int32) + num_pairs
    for p0 in range(0, max_padded, BLOCK):
        tl.store(sorted_ids_ptr + p0 + offs, sentinel, mask=p0 + offs < max_padded)


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_align_scatter_kernel(ids_ptr, sorted_ids_ptr, cursor_ptr, num_pairs, num_experts,
                              BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """sorted_ids[cursor[e]++] = p for each valid pair p (e = ids[p])."""
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    slot = tl.atomic_add(cursor_ptr + tl.where(valid, ids, 0), 1, mask=valid)
    tl.store(sorted_ids_ptr + slot, offs, mask=valid)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, *, pdl: bool = False):
    """(sorted_ids i32[P_max], expert_of_block i32[P_max // block_m], num_tokens_post_padded i32[1]);
    see the module docstring. No host sync: two launches, shapes from T, K, E and block_m only."""
    require_triton()
    if topk_ids.dim() != 2 or topk_ids.dtype.is_floating_point or num_experts <= 0:
        raise ValueError(f"moe_align needs integer topk_ids[T, K] and num_experts > 0, got "
                         f"{tuple(topk_ids.shape)} {topk_ids.dtype}, {num_experts}")
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    ids = topk_ids.to(torch.int32).contiguous()
    num_pairs = ids.numel()
    max_padded = moe_max_padded(num_pairs, num_experts, block_m)
    device = ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_of_block = torch.empty(max_padded // block_m, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    e_pad = max(16, next_pow2(num_experts))
    _moe_align_count_kernel[(1,)](
        ids, sorted_ids, expert_of_block, num_post, cursor, num_pairs, num_experts, max_padded,
        BLOCK_M=block_m, E_PAD=e_pad, BLOCK=_COUNT_BLOCK, BLOCK_B=max(16, 4096 // e_pad), num_warps=8,
        **pdl_args(pdl))
    if num_pairs:
        _moe_align_scatter_kernel[(cdiv(num_pairs, _ALIGN_BLOCK),)](
            ids, sorted_ids, cursor, num_pairs, num_experts, BLOCK=_ALIGN_BLOCK, num_warps=4, **pdl_args(pdl))
    return sorted_ids, expert_of_block, num_post


# at most this many (token, slot) pairs run as one block each (pair_blocks), without moe_align
PAIR_BLOCKS_MAX_PAIRS = 16
_PAIR_BLOCKS: dict = {}


def pair_blocks(topk_ids: torch.Tensor, block_m: int):
    """moe_align's outputs with one block per pair, in pair order, for a decode-sized batch: at
    T*K <= PAIR_BLOCKS_MAX_PAIRS nearly every pair has an expert of its own anyway (T=1: always), so
    grouping saves no weight reads, and this costs no launch: expert_of_block is the ids themselves
    (blocks of an out-of-range id are skipped by the GEMMs); sorted_ids and the padded total are
    constants of (T*K, block_m, device), made once (before a CUDA graph's capture, by its warm-up)."""
    ids = topk_ids.view(-1)
    num_pairs = ids.numel()
    key = (num_pairs, block_m, ids.device)
    if key not in _PAIR_BLOCKS:
        sorted_ids = torch.full((num_pairs * block_m,), num_pairs, dtype=torch.int32, device=ids.device)
        sorted_ids[::block_m] = torch.arange(num_pairs, dtype=torch.int32, device=ids.device)
        _PAIR_BLOCKS[key] = (sorted_ids, torch.full((1,), num_pairs * block_m, dtype=torch.int32, device=ids.device))
    sorted_ids, num_post = _PAIR_BLOCKS[key]
    return sorted_ids, ids, num_post


# ----------------------------------------------------------------------------- grouped GEMMs


@triton.jit
def _block_of(pid, num_m_blocks, num_n_blocks, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a program: GROUP_M m-blocks share a run of n-blocks (L2 reuse of weight tiles)."""
    per_group = GROUP_M * num_n_blocks
    first_m = (pid // per_group) * GROUP_M
    group_size = tl.minimum(num_m_blocks - first_m, GROUP_M)
    local = pid % per_group
    return first_m + local % group_size, local // group_size


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _moe_gate_up_kernel(x_ptr, w13_ptr, inter_ptr, sorted_ids_ptr, expert_of_block_ptr, num_post_ptr,
                        num_pairs, num_m_blocks, num_experts, N, H, stride_xt, stride_we, stride_wn, stride_it,
                        TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """inter[p, n] = silu(x[t] . w13[e, n]) * (x[t] . w13[e, N + n]) for the pairs p = t*K + k of one
    sorted block (expert e) and BLOCK_N columns n."""
    pdl_enter(USE_PDL)
    pid_m, pid_n = _block_of(tl.program_id(0), num_m_blocks, tl.cdiv(N, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_of_block_ptr + pid_m).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):  # a pair block of an out-of-range id (pair_blocks)
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + offs_k[None, :]
    # [BLOCK_K, BLOCK_N] tiles of w13[e]^T: gate rows n, up rows N + n
    g_ptrs = w13_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = offs_k < H - k0
        a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        bg = tl.load(g_ptrs, mask=w_mask, other=0.0)
        bu = tl.load(u_ptrs, mask=w_mask, other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    dtype = inter_ptr.dtype.element_ty
    gate = acc_g.to(dtype).to(tl.float32)  # the GEMM's output rounding (moe_ref)
    up = acc_u.to(dtype).to(tl.float32)
    hidden = gate * tl.sigmoid(gate) * up
    out_ptrs = inter_ptr + pairs.to(tl.int64)[:, None] * stride_it + offs_n[None, :]
    tl.store(out_ptrs, hidden.to(dtype), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _moe_down_kernel(inter_ptr, w2_ptr, out_ptr, weights_ptr, sorted_ids_ptr, expert_of_block_ptr, num_post_ptr,
                     num_pairs, num_m_blocks, num_experts, H, N, stride_it, stride_we, stride_wh, stride_ot,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """out[p, h] = weights[p] * (inter[p] . w2[e, h]) (the dot rounded to inter's dtype first, the fp32 product
    rounded to out's dtype) for the pairs p of one sorted block (expert e) and BLOCK_N hidden columns h."""
    pdl_enter(USE_PDL)
    pid_m, pid_n = _block_of(tl.program_id(0), num_m_blocks, tl.cdiv(H, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    expert = tl.load(expert_of_block_ptr + pid_m).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pairs < num_pairs
    offs_h = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_mask = offs_h < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + pairs.to(tl.int64)[:, None] * stride_it + offs_k[None, :]
    b_ptrs = w2_ptr + expert * stride_we + offs_h.to(tl.int64)[None, :] * stride_wh + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, N, BLOCK_K):
        k_mask = offs_k < N - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & h_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    routed = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    y = acc.to(inter_ptr.dtype.element_ty).to(tl.float32) * routed[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_ot + offs_h[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & h_mask[None, :])


@triton.jit
def _moe_sum_kernel(out_ptr, ids_ptr, y_ptr, H, num_experts, stride_ot, stride_yt,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """y[t, h] = sum over the slots k with a valid id of out[t*K + k, h] (any float dtype, summed in fp32),
    rounded once."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + t * TOP_K + k)
        valid = (expert >= 0) & (expert < num_experts)
        acc += tl.load(out_ptr + (t * TOP_K + k) * stride_ot + offs, mask=mask & valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_yt + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, table: Mapping | None = None, pdl: bool = False,
                     config: MoeConfig | None = None) -> torch.Tensor:
    """fused_moe_ref's y[T, H] in x's dtype (see the module docstring). `config` forces a launch
    config; otherwise `table` (the `moe` section, raw or parsed) by (E, N, H) and T, else
    default_moe_config(T). `pdl`: every launch under programmatic dependent launch (sm_90+)."""
    slots = fused_moe_slots_triton(x, w13, w2, topk_weights, topk_ids, table=table, pdl=pdl, config=config)
    return moe_sum_triton(slots, x.dtype, pdl=pdl)


def moe_sum_triton(slots: ExpertSlots, dtype: torch.dtype, *, pdl: bool = False) -> torch.Tensor:
    """moe_sum_ref's y[T, H]: each token's valid slots summed in fp32, rounded once to `dtype`."""
    num_tokens, top_k = slots.ids.shape
    hidden = slots.out.shape[1]
    y = torch.empty(num_tokens, hidden, dtype=dtype, device=slots.out.device)
    if num_tokens == 0 or top_k == 0:
        return y.zero_()
    block = min(_SUM_BLOCK, next_pow2(hidden))
    _moe_sum_kernel[(num_tokens, cdiv(hidden, block))](
        slots.out, slots.ids, y, hidden, slots.num_experts, slots.out.stride(0), y.stride(0), TOP_K=top_k,
        BLOCK=block, num_warps=4, **pdl_args(pdl))
    return y


def fused_moe_slots_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor, *, table: Mapping | None = None, pdl: bool = False,
                           config: MoeConfig | None = None) -> ExpertSlots:
    """fused_moe_slots_ref's ExpertSlots: the grouped GEMMs without the sum (arguments: fused_moe_triton's);
    the slots in x's dtype."""
    require_triton()
    num_experts, n2, hidden = w13.shape if w13.dim() == 3 else (0, 0, 0)
    n = n2 // 2
    if not (x.dim() == 2 and x.shape[1] == hidden and hidden > 0 and n > 0 and n2 == 2 * n
            and w2.shape == (num_experts, hidden, n) and x.dtype == w13.dtype == w2.dtype
            and x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
            and topk_ids.dim() == 2 and topk_ids.shape[0] == x.shape[0]
            and topk_weights.shape == topk_ids.shape):
        raise ValueError(f"fused_moe_triton needs x[T, H], w13[E, 2N, H], w2[E, H, N] (contiguous, one dtype) and "
                         f"topk weights/ids [T, K]; got x {tuple(x.shape)} {x.dtype}, w13 {tuple(w13.shape)} "
                         f"{w13.dtype}, w2 {tuple(w2.shape)} {w2.dtype}, weights {tuple(topk_weights.shape)}, "
                         f"ids {tuple(topk_ids.shape)}")
    num_tokens, top_k = topk_ids.shape
    ids = topk_ids.to(torch.int32).contiguous()
    if num_tokens == 0 or top_k == 0:
        return ExpertSlots(torch.zeros(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device), ids,
                           num_experts)
    cfg = config or moe_config(table, num_experts, n, hidden, num_tokens)
    routed = topk_weights.to(torch.float32).contiguous()
    num_pairs = ids.numel()
    if num_pairs <= PAIR_BLOCKS_MAX_PAIRS:
        sorted_ids, expert_of_block, num_post = pair_blocks(ids, cfg.block_m)
    else:
        sorted_ids, expert_of_block, num_post = moe_align(ids, num_experts, cfg.block_m, pdl=pdl)
    num_m_blocks = expert_of_block.numel()
    inter = torch.empty(num_pairs, n, dtype=x.dtype, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    launch = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  DOT_PRECISION=precision, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(pdl))
    _moe_gate_up_kernel[(num_m_blocks * cdiv(n, cfg.block_n),)](
        x, w13, inter, sorted_ids, expert_of_block, num_post, num_pairs, num_m_blocks, num_experts, n, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0), TOP_K=top_k, **launch)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _moe_down_kernel[(num_m_blocks * cdiv(hidden, cfg.block_n),)](
        inter, w2, out, routed, sorted_ids, expert_of_block, num_post, num_pairs, num_m_blocks, num_experts, hidden,
        n, inter.stride(0), w2.stride(0), w2.stride(1), out.stride(0), **launch)
    return ExpertSlots(out, ids, num_experts)


__all__ = ["MoeConfig", "TOKEN_BUCKETS", "default_moe_config",
           "fused_moe_slots_triton", "fused_moe_triton", "moe_align", "moe_config", "moe_sum_triton",
           "moe_max_padded", "moe_table_key", "parse_moe_table", "pick_bucket"]
