"""Phase 5 fused decode launch: q/k norm + rotary + K/V store inside the paged decode attention.

`paged_decode_attention_qkv_triton` must equal its composition, `qk_norm_rope_store` then
`paged_decode_attention`: the cache it writes bit for bit against the Triton q/k kernel (the
same rounding code) and within the reference's tolerance against the torch composition; the
output against the torch composition, checked on its own against a float64 softmax. The slot of
the new token is poisoned with NaN beforehand (the kernel must take that row from registers), and
every other cache slot must come back unchanged.
"""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels import TRITON_OPS, build_cos_sin_cache, qk_norm_rope_store_triton, select_ops
from metainfer.kernels.attention import (
    paged_decode_attention_qkv_composed,
    paged_decode_attention_qkv_ref,
    paged_decode_attention_qkv_triton,
    paged_decode_attention_triton,
)
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES, ON_GPU
from tests.test_phase05_attention_kernels import _close, make_paged_batch, naive_attention

triton = pytest.importorskip("triton")

EPS = 1e-6


def _case(contexts, group, hk, head_dim, rot_dim, norm, block_size, dtype, seed=0, unstored=()):
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
                q_norm_w=to(q_w), k_norm_w=to(k_w), eps=EPS, k_cache=to(batch.k_cache), v_cache=to(batch.v_cache),
                slot_mapping=to(torch.tensor(slots, dtype=torch.int32)), block_tables=to(batch.block_tables),
                context_lens=to(lens), scale=head_dim ** -0.5, num_q_heads=hq, num_kv_heads=hk, head_dim=head_dim)


def _clone(args):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _composed_with_triton_prep(a, **kw):
    """qk_norm_rope_store_triton, then the plain decode kernel: the two launches the fused one replaces."""
    q, _, _ = qk_norm_rope_store_triton(a["qkv"], a["positions"], a["cos_sin"], a["q_norm_w"], a["k_norm_w"],
                                        a["eps"], a["k_cache"], a["v_cache"], a["slot_mapping"], a["num_q_heads"],
                                        a["num_kv_heads"], a["head_dim"])
    return paged_decode_attention_triton(q, a["k_cache"], a["v_cache"], a["block_tables"], a["context_lens"],
                                         a["scale"], **kw)


CASES = [  # (contexts, group, hk, head_dim, rot_dim, norm, block_size)
    ([1, 17, 33, 70], 4, 2, 64, 64, True, 16),     # block boundaries, GQA 4
    ([5, 0, 48, 16], 1, 2, 128, 128, False, 16),   # GQA 1 (no dot), no q/k norm, a padded row
    ([200, 0, 48, 129], 1, 2, 64, 64, True, 16),   # GQA 1 with splits and a padded row inside them
    ([40, 3, 96], 8, 1, 128, 64, True, 32),       # GQA 8, partial rotary
    ([300, 7], 4, 2, 64, 64, True, 16),           # many splits (up to 19 at 16-token tiles)
    ([65, 2], 4, 2, 64, 32, True, 1),             # block size 1
]
# (max_num_splits, block_n): one pass; a few splits at the default tiles; as many splits as 16-token tiles allow
LAUNCHES = [(1, None), (3, None), (32, 16)]


def _case_id(case):
    contexts, group, hk, d, rot, norm, block = case
    return f"ctx{'-'.join(map(str, contexts))}-g{group}-hk{hk}-d{d}-rot{rot}-{'norm' if norm else 'nonorm'}-S{block}"


def _tight(actual, expected, dtype, min_exact=0.9):
    """Fused against the two Triton launches: the same q/K/V bits, fp32 sums in another order (and
    no fp contraction), so fp32 agrees to ~1e-6 and half precision is bit-equal but for rare 1-2 ulp
    roundings of the output (run 19 on the H200, bf16: 1% of the outputs 1 ulp off); a wrong rounding
    point of q leaves only ~55% of the elements bit-equal."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=2e-6, rtol=2e-6)
        return
    two_ulps = 2 * torch.finfo(dtype).eps  # relative: 2e-3 for fp16, 1.6e-2 for bf16
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=two_ulps, rtol=two_ulps)
    exact = (actual.cpu() == expected.cpu()).float().mean().item()
    assert exact >= min_exact, f"only {exact:.4f} of the elements are bit-equal to the two-launch composition"


@pytest.mark.parametrize("launch", LAUNCHES, ids=["one-pass", "split3", "split32-tiles16"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fused_decode_equals_composition(case, dtype, launch):
    max_num_splits, block_n = launch
    a = _case(*case, dtype)
    _check_composition(a, dtype, dict(max_num_splits=max_num_splits, block_n=block_n, min_split_tokens=16))


@pytest.mark.parametrize("launch", LAUNCHES, ids=["one-pass", "split3", "split32-tiles16"])
def test_fused_decode_row_not_stored_reads_the_cache(launch):
    """slot -1 with a context: nothing is stored, and attention reads position ctx-1 from the cache."""
    max_num_splits, block_n = launch
    a = _case([40, 77, 9], 4, 2, 64, 64, True, 16, torch.float32, seed=3, unstored=(1, 2))
    _check_composition(a, torch.float32, dict(max_num_splits=max_num_splits, block_n=block_n, min_split_tokens=16))


def _check_composition(a, dtype, launch_kw):
    before_k, before_v = a["k_cache"].clone(), a["v_cache"].clone()
    fused_args, ref_args, prep_args = _clone(a), _clone(a), _clone(a)
    qkv_in = a["qkv"].clone()
    out = paged_decode_attention_qkv_triton(**fused_args, **launch_kw)
    ref_args = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in ref_args.items()}
    ref = paged_decode_attention_qkv_ref(**ref_args)  # on the CPU: the torch composition updates these
    composed = _composed_with_triton_prep(prep_args, **launch_kw)

    assert torch.equal(fused_args["qkv"], qkv_in), "the fused launch must leave qkv as projected"
    # the cache: the Triton q/k kernel's store (bit-equal in the interpreter; compiled, the per-head
    # sum of squares may add in another order and flip a rounding), close to the torch composition's
    for name in ("k_cache", "v_cache"):
        _tight(fused_args[name].nan_to_num(7.0), prep_args[name].nan_to_num(7.0), dtype, min_exact=0.999)
        if not ON_GPU:
            assert torch.equal(fused_args[name], prep_args[name]), name
        _close(fused_args[name].float().nan_to_num(7.0), ref_args[name].float().nan_to_num(7.0), dtype)
    # every slot but the new tokens' is unchanged
    new = a["slot_mapping"][a["slot_mapping"] >= 0].long().cpu()
    hk, d = a["num_kv_heads"], a["head_dim"]
    for name, before in (("k_cache", before_k), ("v_cache", before_v)):
        keep = torch.ones(before.numel() // (hk * d), dtype=torch.bool)
        keep[new] = False
        assert torch.equal(fused_args[name].view(-1, hk, d).cpu()[keep], before.view(-1, hk, d).cpu()[keep])
    assert not torch.isnan(out).any()
    _close(out, ref, dtype)
    _tight(out, composed, dtype)
    ctx = a["context_lens"].cpu()
    assert (out[ctx == 0] == 0).all(), "a padded row (context 0) gives zeros"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_fused_decode_reference_matches_naive_softmax(dtype):
    """The composition itself against a float64 softmax over the cache it leaves behind."""
    a = _case([9, 20], 4, 2, 64, 64, True, 16, dtype, seed=4)
    a = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    out = paged_decode_attention_qkv_ref(**a)
    d, hq, hk = a["head_dim"], a["num_q_heads"], a["num_kv_heads"]
    q = a["qkv"][:, : hq * d].view(-1, hq, d)  # normed and rotated in place by the composition
    for b, ctx in enumerate(a["context_lens"].tolist()):
        rows = [int(a["block_tables"][b, t // 16]) * 16 + t % 16 for t in range(ctx)]
        k = a["k_cache"].view(-1, hk, d)[rows]
        v = a["v_cache"].view(-1, hk, d)[rows]
        expected = naive_attention(q[b : b + 1], k, v, a["scale"], ctx - 1)
        _close(out[b : b + 1], expected, dtype)


def test_fused_decode_rejects_bad_inputs():
    a = _case([4, 9], 4, 2, 64, 64, True, 16, torch.float32)
    bad = _clone(a)
    bad["slot_mapping"] = bad["slot_mapping"][:1]
    with pytest.raises(ValueError, match="slot_mapping"):
        paged_decode_attention_qkv_triton(**bad)
    bad = _clone(a)
    bad["k_cache"], bad["v_cache"] = bad["k_cache"].half(), bad["v_cache"].half()
    with pytest.raises(ValueError, match="dtype"):
        paged_decode_attention_qkv_triton(**bad)
    bad = _clone(a)
    bad["num_kv_heads"] = 3
    with pytest.raises(ValueError, match="qkv"):
        paged_decode_attention_qkv_triton(**bad)


def test_select_ops_binds_the_fused_decode_or_the_composition():
    fused = select_ops("cpu", use_triton=True, fuse_decode_prep=True)
    assert fused.paged_decode_attention_qkv is paged_decode_attention_qkv_triton
    two = select_ops("cpu", use_triton=True).paged_decode_attention_qkv  # the default
    assert two.func is paged_decode_attention_qkv_composed
    assert two.keywords == {"prep": TRITON_OPS.qk_norm_rope_store, "decode": TRITON_OPS.paged_decode_attention}
    assert select_ops("cpu").paged_decode_attention_qkv is paged_decode_attention_qkv_ref
