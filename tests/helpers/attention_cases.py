"""Paged attention test cases shared by the kernel and backend tests: a paged batch with its dense K/V, the
naive attention oracle, tolerances, and the decode / prefill case lists."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metainfer.kernels import build_cos_sin_cache
from tests.helpers.kernel_devices import DEVICE
from tests.helpers.tensors import randn

# Triton vs reference: fp16/bf16 add the rounding of softmax probabilities before P@V.
ATTN_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def close(actual, expected, dtype):
    atol, rtol = ATTN_TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


@dataclass
class PagedBatch:
    k_cache: torch.Tensor  # [N, S, Hk, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, M], padded with -1
    context_lens: torch.Tensor  # int32 [B]
    dense_k: list  # per sequence [L, Hk, D]
    dense_v: list


def make_paged_batch(context_lens, block_size, num_kv_heads, head_dim, dtype, seed=0, device=DEVICE):
    """Random per-sequence K/V scattered (by a plain Python loop) into shuffled blocks of a cache
    whose other slots hold garbage; block tables padded with -1 past each sequence's blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-length // block_size) for length in context_lens]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    v_cache = (torch.randn(shape, generator=gen) * 100).to(dtype)
    block_tables = torch.full((len(context_lens), max(blocks_needed) + 1), -1, dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, length in enumerate(context_lens):
        k = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        blocks = [order.pop() for _ in range(blocks_needed[b])]
        block_tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        for pos in range(length):
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
        dense_k.append(k)
        dense_v.append(v)
    to = dict(device=device)
    return PagedBatch(k_cache.to(**to), v_cache.to(**to), block_tables.to(**to),
                      torch.tensor(context_lens, dtype=torch.int32, device=device), dense_k, dense_v)


def naive_attention(q, k, v, scale, first_pos):
    """float64 softmax(q k^T * scale + causal mask) v with an explicit mask matrix; query i sits at
    position first_pos + i. q [Lq, Hq, D], k/v [L, Hk, D]."""
    num_q, num_heads, _ = q.shape
    length, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(num_q, num_heads, v.shape[-1], dtype=torch.float64)
    mask = torch.zeros(num_q, length, dtype=torch.bool)
    for i in range(num_q):
        mask[i, : first_pos + i + 1] = True
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = (q[:, h].double() @ kh.T) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out[:, h] = weights @ vh
    return out


# ----------------------------------------------------------------------------------------------
# store_kv
# ----------------------------------------------------------------------------------------------


def store_kv_inputs(dtype, block_size, device, num_tokens=7, hk=2, head_dim=64):
    """k/v as strided views into a fused qkv tensor, slots spread over blocks, two -1 pads."""
    hq = 2 * hk
    qkv = randn(num_tokens, (hq + 2 * hk) * head_dim, dtype=dtype, device=device)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(num_tokens, hk, head_dim)
    v = qkv[:, (hq + hk) * head_dim :].view(num_tokens, hk, head_dim)
    num_blocks = max(4, -(-num_tokens * 3 // block_size))
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1))[:num_tokens]
    slots[1] = slots[4] = -1
    kv = randn(2, num_blocks, block_size, hk, head_dim, dtype=dtype, seed=2, device=device)
    return k, v, kv[0], kv[1], slots.to(torch.int32).to(device)


def decode_step_case(contexts, group, hk, head_dim, rot_dim, norm, block_size, dtype, seed=0, unstored=()):
    """Decode inputs: the cache holds contexts[b] - 1 tokens of sequence b (the slot of the last,
    this step's, token poisoned); qkv the step's raw projection; a context of 0 is a padded row
    (slot -1). Rows in `unstored` keep their context but get slot -1 (their cache holds a token at
    ctx-1, which the composition reads: nothing is stored)."""
    hq = group * hk
    batch = make_paged_batch([max(c, 1) for c in contexts], block_size, hk, head_dim, dtype, seed=seed,
                             device="cpu")
    gen = torch.Generator().manual_seed(seed + 1)
    slots = []
    for b, ctx in enumerate(contexts):
        if ctx == 0:
            slots.append(-1)
            continue
        pos = ctx - 1
        slot = int(batch.block_tables[b, pos // block_size]) * block_size + pos % block_size
        if b in unstored:
            slots.append(-1)
            continue
        batch.k_cache.view(-1, hk, head_dim)[slot] = float("nan")
        batch.v_cache.view(-1, hk, head_dim)[slot] = float("nan")
        slots.append(slot)
    qkv = (torch.randn(len(contexts), (hq + 2 * hk) * head_dim, generator=gen) * 2).to(dtype)
    max_pos = max(contexts) + 1
    positions = torch.tensor([max(c - 1, 0) for c in contexts], dtype=torch.int64)
    q_w = k_w = None
    if norm:  # random weights: a wrong weight index shows
        q_w = (torch.rand(head_dim, generator=gen) * 1.5 + 0.25).to(dtype)
        k_w = (torch.rand(head_dim, generator=gen) * 1.5 + 0.25).to(dtype)
    lens = torch.tensor(contexts, dtype=torch.int32)
    to = lambda t: t if t is None else t.to(DEVICE)  # noqa: E731
    return dict(qkv=to(qkv), positions=to(positions), cos_sin=to(build_cos_sin_cache(rot_dim, max_pos, 10000.0)),
                q_norm_w=to(q_w), k_norm_w=to(k_w), eps=1e-6, k_cache=to(batch.k_cache), v_cache=to(batch.v_cache),
                slot_mapping=to(torch.tensor(slots, dtype=torch.int32)), block_tables=to(batch.block_tables),
                context_lens=to(lens), scale=head_dim ** -0.5, num_q_heads=hq, num_kv_heads=hk, head_dim=head_dim)


def clone_args(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


DECODE_CONTEXTS = [0, 1, 17, 33, 70]  # empty row, single token, crossing 16/32-token blocks


# (q_len, context_len) per sequence: plain prefill, prefix-cache hit / chunked prefill
# (q_len < context_len, crossing block boundaries), a one-token extend.
PREFILL_SEQS = [(17, 17), (5, 37), (1, 16), (20, 50)]


def prefill_inputs(seqs, group, hk, head_dim, block_size, dtype, device=DEVICE, seed=0):
    batch = make_paged_batch([c for _, c in seqs], block_size, hk, head_dim, dtype, seed=seed, device=device)
    q_lens = [q for q, _ in seqs]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    q = randn(sum(q_lens), group * hk, head_dim, dtype=dtype, seed=seed + 7, device=device)
    return batch, q, cu, max(q_lens)


def assert_relaunchable(plan) -> None:
    """A PlannedLaunch whose compiled kernel can be relaunched directly on a GPU (kernels/_triton.py): after the
    four varying tensors and the plan's fixed arguments, every parameter of the kernel's signature is a constexpr the
    plan's keywords or the signature's defaults fill, and none of the positional ones is also a keyword (else the
    GPU path would silently stay on Triton's JITFunction, or pass an argument twice). Read from the kernel's Python
    signature, so it holds on the CPU's interpreter too."""
    import inspect

    function = getattr(plan.kernel, "fn", plan.kernel)
    params = list(inspect.signature(function).parameters.values())
    num_given = 4 + len(plan.before_out) + len(plan.after_out)
    assert len(params) >= num_given
    assert not {p.name for p in params[:num_given]} & set(plan.kwargs)
    unfilled = [p.name for p in params[num_given:] if p.name not in plan.kwargs and p.default is p.empty]
    assert not unfilled, f"constexprs neither planned nor defaulted: {unfilled}"
