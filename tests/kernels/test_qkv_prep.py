"""The fused attention-input op: q/k per-head RMSNorm -> neox rotary -> paged K/V store.

`qk_norm_rope_store_ref` is checked for exact equality against the explicit chain of the three
un-fused references (as the dense attention block used to call them); the Triton kernel
(interpreted on CPU, fp32/fp16) against the fused reference and against an independent formula
with HF transformers' rounding points. Caches are poisoned beforehand: slots not in
slot_mapping (or marked -1) must come back bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import (
    REF_OPS,
    TRITON_OPS,
    build_cos_sin_cache,
    qk_norm_rope_store_ref,
    qk_norm_rope_store_triton,
    rms_norm_ref,
    rotary_neox_ref,
    select_ops,
    store_kv_ref,
)
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES, REF_DTYPES

triton = pytest.importorskip("triton")

# Triton vs the fused reference: both round where HF does (norm, then weight; cos/sin; each rotary
# product; the sum), so fp16/bf16 results are bit-equal except where the fp32 sum order or rsqrt
# flips a rounding (1 ulp, which the rotation may carry into a cancelling difference).
KERNEL_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
MIN_EXACT = 0.99  # fraction of bit-equal elements in fp16/bf16
POISON = -999.0
MAX_POS = 96
EPS = 1e-6


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _close(actual, expected, dtype):
    atol, rtol = KERNEL_TOL[dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), atol=atol, rtol=rtol)


def _mostly_exact(actual, expected, dtype):
    if dtype == torch.float32:  # no rounding points to pin down: fp32 differs in the last bit with sum order
        return
    exact = (actual.cpu() == expected.cpu()).float().mean().item()
    assert exact >= MIN_EXACT, f"only {exact:.4f} of the elements are bit-equal"


def _slots(num_tokens, num_blocks, block_size, seed):
    """Distinct slots that include the first/last slot of blocks, with some tokens marked -1."""
    gen = _gen(seed)
    total = num_blocks * block_size
    boundary = [block_size - 1, block_size, 0, total - 1, 2 * block_size - 1]
    rest = [s for s in torch.randperm(total, generator=gen).tolist() if s not in boundary]
    slots = (boundary + rest)[:num_tokens]
    slots = [slots[i] for i in torch.randperm(num_tokens, generator=gen).tolist()]
    if num_tokens > 2:
        slots[1] = slots[-1] = -1
    return torch.tensor(slots, dtype=torch.int32)


def _case(num_tokens, hq, hk, head_dim, rot_dim, norm, dtype, seed=0, block_size=4, num_blocks=None):
    """Inputs of one call (on DEVICE): qkv, positions, cos_sin, weights, poisoned caches, slots."""
    gen = _gen(seed)
    width = (hq + 2 * hk) * head_dim
    qkv = (torch.randn(num_tokens, width, generator=gen) * 2).to(dtype)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=gen, dtype=torch.int64)
    cos_sin = build_cos_sin_cache(rot_dim, MAX_POS, 10000.0)
    q_w = k_w = None
    if norm:  # random weights, not ones: a wrong weight index shows
        q_w = (torch.rand(head_dim, generator=gen) * 1.5 + 0.25).to(dtype)
        k_w = (torch.rand(head_dim, generator=gen) * 1.5 + 0.25).to(dtype)
    num_blocks = num_blocks or -(-num_tokens // block_size) + 2
    k_cache = torch.full((num_blocks, block_size, hk, head_dim), POISON, dtype=dtype)
    v_cache = torch.full_like(k_cache, POISON)
    slots = _slots(num_tokens, num_blocks, block_size, seed)
    to = lambda t: t if t is None else t.to(DEVICE)  # noqa: E731
    return dict(qkv=to(qkv), positions=to(positions), cos_sin=to(cos_sin), q_norm_w=to(q_w), k_norm_w=to(k_w),
                eps=EPS, k_cache=to(k_cache), v_cache=to(v_cache), slot_mapping=to(slots),
                num_q_heads=hq, num_kv_heads=hk, head_dim=head_dim)


def _clone(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _explicit_chain(a):
    """The un-fused dense attention block: norms on contiguous copies, rotary, store_kv."""
    hq, hk, d = a["num_q_heads"], a["num_kv_heads"], a["head_dim"]
    q, k, v = a["qkv"].split([hq * d, hk * d, hk * d], dim=-1)
    if a["q_norm_w"] is not None:
        q = rms_norm_ref(q.reshape(-1, d), a["q_norm_w"], a["eps"]).view(-1, hq * d)
    else:
        q = q.contiguous()
    if a["k_norm_w"] is not None:
        k = rms_norm_ref(k.reshape(-1, d), a["k_norm_w"], a["eps"]).view(-1, hk * d)
    else:
        k = k.contiguous()
    q, k = rotary_neox_ref(a["positions"], q, k, a["cos_sin"], d)
    t = q.shape[0]
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.contiguous().view(t, hk, d)
    store_kv_ref(k, v, a["k_cache"], a["v_cache"], a["slot_mapping"])
    return q, k, v


def _hf_rounding_formula(a):
    """Independent torch formula with HF's bf16 rounding points (the Triton kernel's convention)."""
    hq, hk, d = a["num_q_heads"], a["num_kv_heads"], a["head_dim"]
    qkv, dt = a["qkv"], a["qkv"].dtype
    t = qkv.shape[0]
    rot = a["cos_sin"].shape[-1]
    half = rot // 2
    cs = a["cos_sin"][a["positions"]].to(dt).float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def r(x):
        return x.to(dt).float()

    def prep(x, w):
        x = x.float()
        if w is not None:
            x = r(r(x * torch.rsqrt(x.square().mean(-1, keepdim=True) + a["eps"])) * w.float())
        x1, x2 = x[..., :half], x[..., half:rot]
        return torch.cat([r(x1 * cos) - r(x2 * sin), r(x2 * cos) + r(x1 * sin), x[..., rot:]], dim=-1).to(dt)

    q = prep(qkv[:, : hq * d].reshape(t, hq, d), a["q_norm_w"])
    k = prep(qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d), a["k_norm_w"])
    return q, k


def _written_mask(a):
    """[N, S] True where slot_mapping writes."""
    n, s = a["k_cache"].shape[:2]
    mask = torch.zeros(n * s, dtype=torch.bool)
    valid = a["slot_mapping"].cpu().long()
    mask[valid[valid >= 0]] = True
    return mask.view(n, s).to(a["k_cache"].device)


# (tokens, Hq, Hk, D, rot_dim, norm, heads_per_program): GQA 1, 4, 8; D 64/128 (and 96, not a
# power of two); partial and full rotary; with and without q/k norm; several head groups a token.
CASES = [
    (7, 4, 4, 64, 64, True, None),
    (13, 8, 2, 64, 32, True, None),
    (5, 8, 1, 128, 128, True, None),
    (7, 8, 1, 128, 64, False, None),
    (3, 16, 2, 128, 128, False, 2),
    (6, 6, 2, 64, 64, True, 4),
    (3, 4, 1, 96, 64, True, None),
    (1, 2, 2, 128, 32, True, 1),
]


# ----------------------------------------------------------------------------------------------
# the fused reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", REF_DTYPES)
@pytest.mark.parametrize("case", CASES[:4] + CASES[6:7])
def test_ref_equals_explicit_chain(dtype, case):
    tokens, hq, hk, d, rot, norm, _ = case
    args = _case(tokens, hq, hk, d, rot, norm, dtype)
    args = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    chain_args = _clone(args)
    qkv_in = args["qkv"].clone()
    q, k, v = qk_norm_rope_store_ref(**args)
    q_e, k_e, v_e = _explicit_chain(chain_args)
    assert torch.equal(q, q_e) and torch.equal(k, k_e) and torch.equal(v, v_e)
    assert torch.equal(args["k_cache"], chain_args["k_cache"])
    assert torch.equal(args["v_cache"], chain_args["v_cache"])
    # in place: q and k written back into qkv; the returned tensors are views of it; v untouched
    qkv = args["qkv"]
    assert q.data_ptr() == qkv.data_ptr() and k.data_ptr() == qkv[:, hq * d :].data_ptr()
    assert torch.equal(qkv[:, : hq * d], q_e.reshape(tokens, -1))
    assert torch.equal(qkv[:, (hq + hk) * d :], qkv_in[:, (hq + hk) * d :])


def test_ref_skips_norm_per_weight():
    """q norm without k norm (and vice versa) follows the chain too."""
    args = _case(5, 4, 2, 64, 64, True, torch.float32)
    for drop in ("q_norm_w", "k_norm_w"):
        a = _clone(args)
        a[drop] = None
        b = _clone(a)
        q, k, _ = qk_norm_rope_store_ref(**a)
        q_e, k_e, _ = _explicit_chain(b)
        assert torch.equal(q.cpu(), q_e.cpu()) and torch.equal(k.cpu(), k_e.cpu())


# ----------------------------------------------------------------------------------------------
# Triton vs the fused reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-h{c[1]}x{c[2]}-d{c[3]}-r{c[4]}-n{int(c[5])}" for c in CASES])
def test_triton_matches_ref(dtype, case):
    tokens, hq, hk, d, rot, norm, per_prog = case
    args = _case(tokens, hq, hk, d, rot, norm, dtype, seed=tokens + hq)
    ref_args = _clone(args)
    qkv_in = args["qkv"].clone()
    q, k, v = qk_norm_rope_store_triton(**args, heads_per_program=per_prog)
    q_r, k_r, v_r = qk_norm_rope_store_ref(**ref_args)
    _close(q, q_r, dtype)
    _close(k, k_r, dtype)
    _mostly_exact(q, q_r, dtype)
    _mostly_exact(k, k_r, dtype)
    assert torch.equal(v, v_r) and torch.equal(args["qkv"][:, (hq + hk) * d :], qkv_in[:, (hq + hk) * d :])
    # returned q/k are views of qkv, which holds the results
    assert q.data_ptr() == args["qkv"].data_ptr()
    assert torch.equal(args["qkv"][:, : hq * d], q.reshape(tokens, -1))
    # cache: written slots hold exactly the returned k and v; every other slot is untouched
    written = _written_mask(args)
    for cache, ref_cache in ((args["k_cache"], ref_args["k_cache"]), (args["v_cache"], ref_args["v_cache"])):
        assert (cache[~written] == POISON).all()
        _close(cache[written], ref_cache[written], dtype)
    valid = args["slot_mapping"].long() >= 0
    slots = args["slot_mapping"].long()[valid]
    s = args["k_cache"].shape[1]
    assert torch.equal(args["k_cache"][slots // s, slots % s], k[valid])
    assert torch.equal(args["v_cache"][slots // s, slots % s], v[valid])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]])
def test_triton_rounds_like_hf(dtype, case):
    """Against the independent HF-rounding formula: close in fp32, (almost) bit-exact in fp16/bf16,
    where the rounding points dominate (fp32 results differ in the last bit with the sum order)."""
    tokens, hq, hk, d, rot, norm, per_prog = case
    args = _case(tokens, hq, hk, d, rot, norm, dtype, seed=3)
    cpu_args = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    q_f, k_f = _hf_rounding_formula(cpu_args)
    q, k, _ = qk_norm_rope_store_triton(**args, heads_per_program=per_prog)
    for got, want in ((q.cpu(), q_f), (k.cpu(), k_f)):
        _mostly_exact(got, want, dtype)
        _close(got, want, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_triton_strided_qkv_without_copy(dtype):
    """qkv rows with a stride larger than (Hq+2Hk)*D (a slice of a wider buffer) work in place."""
    tokens, hq, hk, d, rot = 5, 4, 2, 64, 32
    args = _case(tokens, hq, hk, d, rot, True, dtype, seed=7)
    width = (hq + 2 * hk) * d
    buf = torch.randn(tokens, width + 48, generator=_gen(9)).to(dtype).to(DEVICE)
    buf[:, 16 : 16 + width] = args["qkv"]
    before = buf.clone()
    ref_args = _clone(args)
    args["qkv"] = buf[:, 16 : 16 + width]
    assert args["qkv"].stride(0) == width + 48
    q, k, v = qk_norm_rope_store_triton(**args)
    q_r, k_r, _ = qk_norm_rope_store_ref(**ref_args)
    _close(q, q_r, dtype)
    _close(k, k_r, dtype)
    assert q.stride(0) == width + 48 and q.data_ptr() == buf[:, 16:].data_ptr()
    assert torch.equal(buf[:, :16], before[:, :16]) and torch.equal(buf[:, 16 + width :], before[:, 16 + width :])
    _close(args["k_cache"], ref_args["k_cache"], dtype)
    assert torch.equal(args["v_cache"], ref_args["v_cache"])


def test_triton_cache_views_of_one_allocation():
    """The runner's caches are kv[0, layer] / kv[1, layer] views; other layers stay untouched."""
    tokens, hq, hk, d = 6, 4, 2, 64
    args = _case(tokens, hq, hk, d, d, True, torch.float32, seed=11, num_blocks=4)
    kv = torch.full((2, 3, *args["k_cache"].shape), POISON, device=DEVICE)
    ref_args = _clone(args)
    args["k_cache"], args["v_cache"] = kv[0, 1], kv[1, 1]
    qk_norm_rope_store_triton(**args)
    qk_norm_rope_store_ref(**ref_args)
    _close(kv[0, 1], ref_args["k_cache"], torch.float32)
    assert torch.equal(kv[1, 1], ref_args["v_cache"])
    assert (kv[:, 0] == POISON).all() and (kv[:, 2] == POISON).all()


def test_triton_empty_batch_and_bad_shapes():
    args = _case(3, 4, 2, 64, 64, True, torch.float32)
    empty = _clone(args)
    empty.update(qkv=args["qkv"][:0], positions=args["positions"][:0], slot_mapping=args["slot_mapping"][:0])
    q, k, v = qk_norm_rope_store_triton(**empty)
    assert q.shape == (0, 4, 64) and k.shape == (0, 2, 64) and v.shape == (0, 2, 64)
    bad = _clone(args)
    bad["num_kv_heads"] = 1
    with pytest.raises(ValueError, match="qkv"):
        qk_norm_rope_store_triton(**bad)
    bad = _clone(args)
    bad["cos_sin"] = build_cos_sin_cache(128, MAX_POS, 10000.0).to(DEVICE)
    with pytest.raises(ValueError, match="rot_dim"):
        qk_norm_rope_store_triton(**bad)


# ----------------------------------------------------------------------------------------------
# wiring: kernel set and the dense attention block
# ----------------------------------------------------------------------------------------------


def test_kernel_ops_field():
    assert REF_OPS.qk_norm_rope_store is qk_norm_rope_store_ref
    assert TRITON_OPS.qk_norm_rope_store is qk_norm_rope_store_triton
    assert select_ops("cuda").qk_norm_rope_store is qk_norm_rope_store_triton
