"""Fused MoE (kernels/fused_moe.py) against the torch references (kernels/moe_ref.py), and the references
against brute force.

Interpreted on the CPU (fp32, fp16, small shapes: tile edges off the block sizes, T = 0, skewed and
repeated routing, ids outside [0, E)), compiled on the GPU (METAINFER_TEST_GPU=1) with bf16 and the
real DeepSeek-V2-Lite / Qwen3-30B-A3B shapes, where the launch must also run with no host sync and
replay from a CUDA graph. moe_align is checked against a naive Python grouping; the AOT check compiles
every kernel for sm_90 at the real shapes.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from metainfer.kernels.fused_moe import (
    TOKEN_BUCKETS,
    MoeConfig,
    default_moe_config,
    fused_moe_triton,
    moe_align,
    moe_config,
    moe_max_padded,
    moe_table_key,
    parse_moe_table,
    pick_bucket,
)
from metainfer.kernels.moe_ref import fused_moe_ref, route_topk_ref
from metainfer.kernels.moe_routing import route_topk_triton
from metainfer.kernels.tuned_configs import CONFIG_DIR, SECTIONS
from tests.helpers.aot import aot_main, run_aot_main
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES, ON_GPU, REF_DTYPES

triton = pytest.importorskip("triton")

TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
SMALL = MoeConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


# ----------------------------------------------------------------------------- moe_align


def _naive_groups(ids: torch.Tensor, num_experts: int) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for p, e in enumerate(ids.flatten().tolist()):
        if 0 <= e < num_experts:
            groups.setdefault(e, []).append(p)
    return groups


def _check_align(ids: torch.Tensor, num_experts: int, block_m: int):
    sorted_ids, expert_of_block, num_post = (t.cpu() for t in moe_align(ids.to(DEVICE), num_experts, block_m))
    pairs = ids.numel()
    p_max = moe_max_padded(pairs, num_experts, block_m)
    assert p_max % block_m == 0 and p_max >= pairs + min(num_experts, pairs) * (block_m - 1)
    assert p_max < pairs + min(num_experts, pairs) * (block_m - 1) + block_m
    assert sorted_ids.shape == (p_max,) and expert_of_block.shape == (p_max // block_m,)
    assert sorted_ids.dtype == expert_of_block.dtype == num_post.dtype == torch.int32
    groups = _naive_groups(ids, num_experts)
    total = sum(math.ceil(len(g) / block_m) * block_m for g in groups.values())
    assert num_post.tolist() == [total]
    s, eob = sorted_ids.tolist(), expert_of_block.tolist()
    # the padded runs, experts in increasing order, each run only its expert's pairs then the sentinel
    pos = 0
    for e in sorted(groups):
        run = math.ceil(len(groups[e]) / block_m) * block_m
        assert eob[pos // block_m: (pos + run) // block_m] == [e] * (run // block_m)
        got = s[pos: pos + run]
        assert sorted(got[: len(groups[e])]) == groups[e]
        assert got[len(groups[e]):] == [pairs] * (run - len(groups[e]))
        pos += run
    assert pos == total
    assert s[total:] == [pairs] * (p_max - total)  # nothing written past the padded total
    assert eob[total // block_m:] == [-1] * (p_max // block_m - total // block_m)  # experts without pairs: no block


ALIGN_CASES = {  # name: (ids, E, block_m)
    "random": (torch.randint(0, 8, (17, 2), generator=torch.Generator().manual_seed(0)), 8, 16),
    "one_token": (torch.tensor([[5, 1, 7]]), 8, 16),
    "no_tokens": (torch.zeros(0, 2, dtype=torch.int64), 8, 16),
    "skewed": (torch.full((40, 1), 3), 8, 16),  # 40 pairs on one expert: 3 blocks
    "repeated": (torch.tensor([[1, 2]] * 5), 8, 32),
    "exact_multiple": (torch.arange(32).remainder(2).view(16, 2), 4, 16),
    "many_experts": (torch.randint(0, 256, (70, 8), generator=torch.Generator().manual_seed(1)), 256, 16),
    "large_blocks": (torch.randint(0, 64, (300, 6), generator=torch.Generator().manual_seed(2)), 64, 64),
    "out_of_range_ids": (torch.tensor([[0, -1], [8, 3], [3, 3]]), 8, 16),
}


@pytest.mark.parametrize("name", list(ALIGN_CASES))
def test_moe_align_matches_naive_grouping(name):
    ids, num_experts, block_m = ALIGN_CASES[name]
    _check_align(ids.to(torch.int32), num_experts, block_m)


def test_moe_align_rejects_bad_arguments():
    with pytest.raises(ValueError, match="topk_ids"):
        moe_align(torch.zeros(3, dtype=torch.int32), 8, 16)
    with pytest.raises(ValueError, match="power of two"):
        moe_align(torch.zeros(3, 2, dtype=torch.int32), 8, 24)


# ----------------------------------------------------------------------------- fused_moe_triton


def _moe_inputs(num_tokens, num_experts, n, hidden, top_k, dtype, ids=None, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)  # on the device: the real shapes hold ~1 GB of experts
    x = torch.randn(num_tokens, hidden, generator=g, device=DEVICE).to(dtype)
    w13 = (torch.randn(num_experts, 2 * n, hidden, generator=g, device=DEVICE) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, n, generator=g, device=DEVICE) / n ** 0.5).to(dtype)
    if ids is None:
        logits = torch.randn(num_tokens, num_experts, generator=g, device=DEVICE)
        weights, ids = route_topk_ref(logits, top_k, renormalize=True)
    else:
        weights = torch.rand(num_tokens, top_k, generator=g, device=DEVICE)
    return [x, w13, w2, weights, ids.to(device=DEVICE, dtype=torch.int32)]


def _check_moe(args, dtype, **kwargs):
    y = fused_moe_triton(*args, **kwargs)
    ref = fused_moe_ref(*args)
    assert y.dtype == dtype and y.shape == ref.shape
    if ref.numel():
        err = (y.double() - ref.double()).abs().max().item() / max(ref.double().abs().max().item(), 1e-6)
        assert err < TOL[dtype], f"relative error {err:.2e}"
    return y


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 3, 17])
@pytest.mark.parametrize("n", [32, 48])  # 48: N off the 32-column tile
def test_fused_moe_matches_ref(dtype, num_tokens, n):
    _check_moe(_moe_inputs(num_tokens, 8, n, 64, 2, dtype), dtype, config=SMALL)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_fused_moe_default_config_and_ragged_hidden(dtype):
    # H = 80: off every BLOCK_K and hidden tile; N = 16, the smallest per-rank width; K = 3
    args = _moe_inputs(5, 6, 16, 80, 3, dtype, seed=3)
    _check_moe(args, dtype)  # default_moe_config(5): 64 x 128 tiles over a 16 x 80 problem
    _check_moe(args, dtype, config=MoeConfig(16, 16, 16, 1, 4, 1))


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_fused_moe_skewed_and_repeated_routing(dtype):
    skewed = torch.full((20, 2), 3)  # all pairs on one expert (two slots): 40 rows, 3 blocks of 16
    skewed[:, 1] = 5
    _check_moe(_moe_inputs(20, 8, 32, 64, 2, dtype, ids=skewed), dtype, config=SMALL)
    repeated = torch.tensor([[1, 2]] * 4)  # the same ids on every token
    _check_moe(_moe_inputs(4, 8, 48, 64, 2, dtype, ids=repeated), dtype, config=SMALL)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_fused_moe_ids_out_of_range_contribute_nothing(dtype):
    ids = torch.tensor([[0, -1], [8, 3], [3, 3]])
    y = _check_moe(_moe_inputs(3, 8, 32, 64, 2, dtype, ids=ids), dtype, config=SMALL)
    x, w13, w2, weights, _ = _moe_inputs(3, 8, 32, 64, 2, dtype, ids=ids)
    alone = fused_moe_triton(x[:1], w13, w2, weights[:1, :1], ids[:1, :1].to(DEVICE), config=SMALL)
    torch.testing.assert_close(y[:1], alone, rtol=0, atol=0)  # token 0's second slot (id -1) adds nothing


def _brute_moe(x, w13, w2, weights, ids):
    """y[t] = sum_k weights[t, k] * w2[e] @ (silu(w13[e, :N] @ x[t]) * (w13[e, N:] @ x[t])), e = ids[t, k], in
    float64, one token and slot at a time (independent of kernels/moe_ref.py)."""
    n = w13.shape[1] // 2
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].cpu().double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            w = w13[e].cpu().double()
            inter = torch.nn.functional.silu(w[:n] @ xt) * (w[n:] @ xt)
            y[t] += float(weights[t, k]) * (w2[e].cpu().double() @ inter)
    return y


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("num_tokens, num_experts, n, top_k, config", [
    (1, 8, 32, 2, SMALL),  # Qwen3-MoE-like decode at batch 1
    (1, 64, 48, 6, None),  # DeepSeek-V2-like (6 of 64), N off the tile, the default config
    (2, 16, 32, 8, SMALL),  # T*K = 16: the largest batch the pair-block path takes
])
def test_fused_moe_pair_blocks_read_only_the_selected_experts(dtype, num_tokens, num_experts, n, top_k, config,
                                                              monkeypatch):
    """Decode-sized batches (T*K <= PAIR_BLOCKS_MAX_PAIRS) run one block per (token, slot) pair: every expert that
    no token selected has w13 and w2 filled with NaN, and the output is still finite and equals the float64 brute
    force over the clean weights, so no unselected expert's weights reach it. A NaN in a selected expert's w2 does
    poison the output (the check can see a read)."""
    from metainfer.kernels import fused_moe as fm

    assert num_tokens * top_k <= fm.PAIR_BLOCKS_MAX_PAIRS
    calls = []
    pair_blocks = fm.pair_blocks
    monkeypatch.setattr(fm, "pair_blocks", lambda *a: calls.append("pairs") or pair_blocks(*a))
    monkeypatch.setattr(fm, "moe_align", lambda *a, **k: pytest.fail("a pair-block batch took moe_align"))
    x, w13, w2, weights, ids = _moe_inputs(num_tokens, num_experts, n, 64, top_k, dtype, seed=11)
    expected = _brute_moe(x, w13, w2, weights, ids)
    selected = set(ids.flatten().tolist())
    unselected = [e for e in range(num_experts) if e not in selected]
    assert len(unselected) >= num_experts - num_tokens * top_k and unselected
    poisoned13, poisoned2 = w13.clone(), w2.clone()
    poisoned13[unselected] = float("nan")
    poisoned2[unselected] = float("nan")
    y = fm.fused_moe_triton(x, poisoned13, poisoned2, weights, ids, config=config)
    assert calls == ["pairs"]
    assert torch.isfinite(y).all(), "an unselected expert's weights reached the output"
    err = (y.cpu().double() - expected).abs().max().item() / expected.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.2e}"
    poisoned2[int(ids[0, 0])] = float("nan")  # the control: a selected expert's NaN shows
    y = fm.fused_moe_triton(x, poisoned13, poisoned2, weights, ids, config=config)
    assert not torch.isfinite(y[0]).any()


def test_fused_moe_rejects_bad_shapes():
    x, w13, w2, weights, ids = _moe_inputs(3, 4, 16, 32, 2, torch.float32)
    with pytest.raises(ValueError, match="fused_moe_triton"):
        fused_moe_triton(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="fused_moe_triton"):
        fused_moe_triton(x, w13, w2, weights[:, :1], ids)


@pytest.mark.skipif(not ON_GPU, reason="the real shapes run compiled on the GPU (METAINFER_TEST_GPU=1)")
@pytest.mark.parametrize("num_experts, n, top_k", [(64, 1408, 6), (128, 768, 8)])
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_fused_moe_real_shapes_gpu(num_experts, n, top_k, num_tokens):
    args = _moe_inputs(num_tokens, num_experts, n, 2048, top_k, torch.bfloat16, seed=num_tokens)
    _check_moe(args, torch.bfloat16)


@pytest.mark.skipif(not ON_GPU, reason="the real shapes run compiled on the GPU (METAINFER_TEST_GPU=1)")
@pytest.mark.parametrize("num_experts, n, top_k", [(66, 1408, 8), (66, 704, 8), (128, 768, 8)])
@pytest.mark.parametrize("num_tokens", [1, 2])
def test_fused_moe_decode_pdl_graph_real_shapes_gpu(num_experts, n, top_k, num_tokens):
    """The decode path (pair blocks, no moe_align) under PDL and in a CUDA graph at DeepSeek-V2-Lite's (tp 1
    and 2) and Qwen3-30B-A3B's shapes against the reference."""
    args = _moe_inputs(num_tokens, num_experts, n, 2048, top_k, torch.bfloat16, seed=num_tokens)
    expected = _check_moe(args, torch.bfloat16, pdl=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe_triton(*args, pdl=True)
    graph.replay()
    torch.testing.assert_close(captured, expected, rtol=0, atol=0)


@pytest.mark.skipif(not ON_GPU, reason="host syncs, PDL and graph capture need CUDA (METAINFER_TEST_GPU=1)")
def test_fused_moe_no_host_sync_and_graph_replay_gpu():
    args = _moe_inputs(8, 64, 704, 2048, 6, torch.bfloat16, seed=5)
    expected = fused_moe_triton(*args)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe_triton(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    pdl = torch.cuda.get_device_capability()[0] >= 9
    torch.testing.assert_close(fused_moe_triton(*args, pdl=pdl), expected, rtol=0, atol=0)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe_triton(*args, pdl=pdl)
    new = _moe_inputs(8, 64, 704, 2048, 6, torch.bfloat16, seed=6)
    for dst, src in zip(args, new, strict=True):
        dst.copy_(src)
    graph.replay()
    torch.testing.assert_close(captured, fused_moe_triton(*args), rtol=0, atol=0)
    assert not torch.equal(captured, expected)


# ----------------------------------------------------------------------------- configs and the table


def test_default_config_by_tokens():
    assert default_moe_config(1).block_m == 16 and default_moe_config(32).block_m == 16
    assert default_moe_config(4096).block_m == 64
    with pytest.raises(ValueError, match="block_m"):
        MoeConfig(block_m=24)


def test_table_lookup_takes_the_smallest_bucket_at_or_above_t():
    small, large = MoeConfig(16, 32, 64, 1, 4, 3), MoeConfig(64, 128, 64, 8, 8, 3)
    raw = {moe_table_key(64, 1408, 2048): {"4": small.to_dict(), "256": large.to_dict()}}
    parsed = parse_moe_table(raw)
    assert parsed == {(64, 1408, 2048): {4: small, 256: large}}
    for table in (raw, parsed):
        assert moe_config(table, 64, 1408, 2048, 1) == small
        assert moe_config(table, 64, 1408, 2048, 4) == small
        assert moe_config(table, 64, 1408, 2048, 5) == large
        assert moe_config(table, 64, 1408, 2048, 9999) == large  # past the largest bucket
        assert moe_config(table, 128, 768, 2048, 5) == default_moe_config(5)  # shape not in the table
    assert moe_config(None, 64, 1408, 2048, 600) == default_moe_config(600)
    assert pick_bucket(3, TOKEN_BUCKETS) == 4 and pick_bucket(5000, TOKEN_BUCKETS) == 8192
    assert pick_bucket(9000, TOKEN_BUCKETS) == 8192


@pytest.mark.parametrize("bad", [{"E64_N1408": {"1": {}}}, {"E64_N1408_H2048": {"3": {}}},
                                 {"E64_N1408_H2048": {"1": {"block_m": 8}}}, {"E64_N1408_H2048": {}},
                                 {"E64_N1408_H2048": {"1": {"tile": 8}}}])
def test_parse_moe_table_rejects_bad_entries(bad):
    with pytest.raises(ValueError):
        parse_moe_table(bad)


def test_shipped_moe_section_parses():
    assert "moe" in SECTIONS
    path = os.path.join(CONFIG_DIR, "NVIDIA_H200.json")
    with open(path) as f:
        section = json.load(f).get("moe") or {}
    for (e, n, h), buckets in parse_moe_table(section).items():
        assert n % 16 == 0 and h % 16 == 0 and e > 0 and buckets


# ----------------------------------------------------------------------------- route_topk_ref


def _brute_route(logits, top_k, method, n_group, topk_group, renormalize, scaling):
    weights, ids = [], []
    for row in logits.double().tolist():
        m = max(row)
        exp = [math.exp(v - m) for v in row]
        probs = [v / sum(exp) for v in exp]
        allowed = range(len(probs))
        if method == "group_limited_greedy":
            size = len(probs) // n_group
            best = sorted(range(n_group), key=lambda gi: -max(probs[gi * size:(gi + 1) * size]))[:topk_group]
            allowed = [i for gi in best for i in range(gi * size, (gi + 1) * size)]
        chosen = sorted(allowed, key=lambda i: -probs[i])[:top_k]
        w = [probs[i] for i in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append([v * scaling for v in w])
        ids.append(chosen)
    return torch.tensor(weights, dtype=torch.float64), torch.tensor(ids)


@pytest.mark.parametrize("method, n_group, topk_group", [("greedy", 1, 1), ("group_limited_greedy", 4, 2),
                                                         ("group_limited_greedy", 8, 3)])
@pytest.mark.parametrize("renormalize, scaling", [(False, 1.0), (True, 1.0), (False, 16.0), (True, 2.5)])
def test_route_topk_ref_matches_brute_force(method, n_group, topk_group, renormalize, scaling):
    logits = torch.randn(9, 32, generator=torch.Generator().manual_seed(7)) * 3
    weights, ids = route_topk_ref(logits, 6, method, n_group, topk_group, renormalize, scaling)
    ref_w, ref_ids = _brute_route(logits, 6, method, n_group, topk_group, renormalize, scaling)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights.double(), ref_w, rtol=1e-5, atol=1e-6)
    if method == "group_limited_greedy":  # every chosen expert lies in one of the topk_group groups
        assert all(len({i // (32 // n_group) for i in row}) <= topk_group for row in ids.tolist())


def test_route_topk_ref_rejects_unknown_method():
    with pytest.raises(ValueError, match="method"):
        route_topk_ref(torch.randn(2, 8), 2, "noaux_tc")


@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(0, 8, 2), (1, 64, 6), (5, 60, 8), (33, 128, 8),
                                                          (9, 256, 1), (4, 8, 8)])
@pytest.mark.parametrize("renormalize, scaling, shared", [(False, 1.0, 0), (True, 1.0, 0), (False, 16.0, 2),
                                                          (True, 2.5, 1)])
def test_route_topk_triton_matches_ref(num_tokens, num_experts, top_k, renormalize, scaling, shared):
    g = torch.Generator(device=DEVICE).manual_seed(num_tokens * 1000 + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=g, device=DEVICE) * 3
    weights, ids = route_topk_triton(logits, top_k, renormalize=renormalize, scaling=scaling, num_shared=shared)
    ref_w, ref_ids = route_topk_ref(logits, top_k, renormalize=renormalize, scaling=scaling, num_shared=shared)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (num_tokens, top_k + shared)
    shared_ids = torch.arange(num_experts, num_experts + shared).expand(num_tokens, -1).int()
    assert torch.equal(ids[:, top_k:].cpu(), shared_ids)
    assert bool((weights[:, top_k:] == 1).all())
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)


def test_route_topk_triton_strided_logits_and_fallbacks():
    g = torch.Generator(device=DEVICE).manual_seed(3)
    wide = torch.randn(7, 80, generator=g, device=DEVICE)
    logits = wide[:, 8:72]  # a view with row stride 80
    for got, ref in zip(route_topk_triton(logits, 6, renormalize=True), route_topk_ref(logits, 6, renormalize=True),
                        strict=True):
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-7)
    # group-limited routing and K > 8 take the reference
    args = (logits, 6, "group_limited_greedy", 8, 3, False, 16.0)
    for got, ref in zip(route_topk_triton(*args), route_topk_ref(*args), strict=True):
        assert torch.equal(got, ref)
    assert torch.equal(route_topk_triton(logits, 10)[1], route_topk_ref(logits, 10)[1])


# ----------------------------------------------------------------------------- AOT compile for sm_90


def _aot_main() -> int:
    """Compile every fused-MoE launch (default and sweep-sized configs, bf16 at the real shapes, fp32, PDL)
    for sm_90 the way tools/aot_check.py does; run in a process without TRITON_INTERPRET."""
    from metainfer.kernels import fused_moe as fm
    from metainfer.kernels import moe_routing

    bf16 = torch.bfloat16
    cases = [(64, 1408, 6, t, bf16, None, t == 1) for t in (1, 64, 1024)]  # the three default configs, PDL at T=1
    cases += [(128, 384, 8, 16, bf16, MoeConfig(16, 32, 256, 1, 4, 4), False),
              (128, 768, 8, 512, bf16, MoeConfig(128, 128, 64, 8, 8, 3), False),
              (8, 48, 2, 3, torch.float32, None, False)]

    def launch():
        for num_experts, n, top_k, num_tokens, dtype, cfg, pdl in cases:
            hidden = 2048 if dtype == bf16 else 80
            x = torch.zeros(num_tokens, hidden, dtype=dtype)
            w13 = torch.empty(num_experts, 2 * n, hidden, dtype=dtype)
            w2 = torch.empty(num_experts, hidden, n, dtype=dtype)
            ids, weights = torch.zeros(num_tokens, top_k, dtype=torch.int32), torch.zeros(num_tokens, top_k)
            fm.fused_moe_triton(x, w13, w2, weights, ids, config=cfg, pdl=pdl)
        for num_experts, top_k, pdl in ((64, 6, True), (128, 8, False), (256, 8, False), (60, 1, False)):
            moe_routing.route_topk_triton(torch.zeros(3, num_experts), top_k, renormalize=True, scaling=2.0, pdl=pdl)

    return aot_main([fm._moe_align_count_kernel, fm._moe_align_scatter_kernel, fm._moe_gate_up_kernel,
                     fm._moe_down_kernel, fm._moe_sum_kernel, moe_routing._route_topk_kernel], launch)


def test_aot_compile_sm90_fused_moe_kernels():
    stdout = run_aot_main("tests.kernels.test_fused_moe", "_aot_main")
    for name in ("_moe_gate_up_kernel", "_moe_down_kernel", "_moe_align_scatter_kernel", "_route_topk_kernel"):
        assert name in stdout


# ----------------------------------------------------------------------------- the K-slot sum folded into the norm


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_slots_then_norm_equal_the_summed_path(dtype, num_tokens):
    """The engine at tp = 1: fused_moe_slots, then the residual add + RMSNorm over the slots, is bit for bit the
    unfused chain (fused_moe's sum kernel, then fused_add_rms_norm) on the same device, residual included; the
    slots themselves match the reference's; an id outside [0, E) (slot rows never written) counts nothing."""
    from metainfer.kernels.fused_moe import fused_moe_slots_triton, moe_sum_triton
    from metainfer.kernels.moe_ref import fused_moe_slots_ref
    from metainfer.kernels.rms_norm import (
        fused_add_rms_norm_slots_ref,
        fused_add_rms_norm_slots_triton,
        fused_add_rms_norm_triton,
    )

    hidden, experts, top_k = 48, 6, 3
    args = _moe_inputs(num_tokens, experts, 40, hidden, top_k, dtype, seed=num_tokens)
    args[4][0, 1] = experts  # out of range: its slot row is left unwritten by the kernels
    slots = fused_moe_slots_triton(*args, config=SMALL)
    ref_slots = fused_moe_slots_ref(*args)
    assert slots.out.shape == (num_tokens * top_k, hidden) and slots.out.dtype == ref_slots.out.dtype == dtype
    valid = ((ref_slots.ids >= 0) & (ref_slots.ids < experts)).flatten()
    err = (slots.out[valid].double() - ref_slots.out[valid].double()).abs().max().item()
    assert err / ref_slots.out[valid].double().abs().max().item() < TOL[dtype]
    slots.out[~valid] = float("nan")  # whatever an unwritten row holds must not reach the sum
    weight = (1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(3))).to(DEVICE, dtype)
    residual = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)

    res_folded, res_chain, res_ref = residual.clone(), residual.clone(), residual.clone()
    folded, _ = fused_add_rms_norm_slots_triton(slots, res_folded, weight, 1e-6)
    chain, _ = fused_add_rms_norm_triton(moe_sum_triton(slots, dtype), res_chain, weight, 1e-6)
    assert torch.equal(folded, chain) and torch.equal(res_folded, res_chain)
    assert torch.equal(moe_sum_triton(slots, dtype), _check_moe(args, dtype, config=SMALL))
    ref, _ = fused_add_rms_norm_slots_ref(ref_slots, res_ref, weight, 1e-6)
    assert torch.isfinite(folded).all()
    for got, want in ((folded, ref), (res_folded, res_ref)):
        err = (got.double() - want.double()).abs().max().item() / want.double().abs().max().item()
        assert err < TOL[dtype], f"relative error {err:.2e}"


def _brute_slots(x, w13, w2, weights, ids, dtype):
    """The slot terms [T*K, H] in `dtype` by a plain loop over (token, slot), independent of kernels/moe_ref.py:
    gate = x[t] . w13[e, :N], up = x[t] . w13[e, N:] (float64, rounded to dtype), h = silu(gate) * up (float64,
    rounded), d = w2[e] @ h (float64, rounded), term = d * weight as an fp32 product, rounded to dtype. Rows of
    ids outside [0, E) stay 0."""
    num_experts, n = w13.shape[0], w13.shape[1] // 2
    num_tokens, top_k = ids.shape
    out = torch.zeros(num_tokens * top_k, x.shape[1], dtype=dtype)
    for t in range(num_tokens):
        xt = x[t].cpu().double()
        for k in range(top_k):
            e = int(ids[t, k])
            if not 0 <= e < num_experts:
                continue
            w = w13[e].cpu().double()
            gate, up = (w[:n] @ xt).to(dtype).double(), (w[n:] @ xt).to(dtype).double()
            hidden = (torch.nn.functional.silu(gate) * up).to(dtype).double()
            down = (w2[e].cpu().double() @ hidden).to(dtype)
            out[t * top_k + k] = (down.float() * weights[t, k].cpu().float()).to(dtype)
    return out


def _check_slots_against_brute(got: torch.Tensor, want: torch.Tensor, dtype):
    """In a 16-bit dtype the terms are bit for bit the loop's, but for 2% (the GEMMs' accumulation order against
    float64 can move a rounding, off by about an ulp of the largest term); rounding the down GEMM's fp32 product
    only once instead of twice would leave ~25% of them one ulp off. In fp32 (no rounding to see) a relative
    tolerance."""
    assert got.dtype == want.dtype == dtype
    got = got.cpu()
    if dtype == torch.float32:
        err = (got.double() - want.double()).abs().max().item() / want.double().abs().max().item()
        assert err < TOL[dtype], f"relative error {err:.2e}"
        return
    same = got == want
    assert same.float().mean().item() >= 0.98, f"{(~same).sum().item()} of {same.numel()} terms differ"
    assert (got.float() - want.float()).abs().max().item() <= torch.finfo(dtype).eps * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", REF_DTYPES)
def test_slots_ref_rounds_each_term_to_x_dtype(dtype):
    """fused_moe_slots_ref's terms (the CPU engine's) against the independent loop, in bf16 too."""
    from metainfer.kernels.moe_ref import fused_moe_slots_ref

    args = [a.cpu() for a in _moe_inputs(9, 8, 40, 48, 3, dtype, seed=21)]
    args[4][2, 1] = -1  # an id outside [0, E): its row is 0 in both
    slots = fused_moe_slots_ref(*args)
    _check_slots_against_brute(slots.out, _brute_slots(*args, dtype), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_slots_kernel_rounds_each_term_to_x_dtype(dtype):
    """The Triton slots (interpreted on the CPU in fp32 and fp16, the interpreter mishandling bf16 dots and
    casts; compiled in bf16 too on the GPU tier) against the independent loop; the K-slot sum of the rounded
    terms (fp32, one rounding) stays within a small tolerance of the unrounded float64 MoE (the fp32 model), and
    closer to it than HF transformers' eager experts' accumulation (each term rounded, summed in the model dtype)
    of the same terms."""
    from metainfer.kernels.fused_moe import fused_moe_slots_triton, moe_sum_triton

    num_tokens, top_k, hidden = 16, 6, 64
    args = _moe_inputs(num_tokens, 8, 40, hidden, top_k, dtype, seed=22)
    slots = fused_moe_slots_triton(*args, config=SMALL)
    want = _brute_slots(*args, dtype)
    _check_slots_against_brute(slots.out, want, dtype)
    exact = _brute_moe(*args)
    summed = moe_sum_triton(slots, dtype).cpu().double()
    hf = torch.zeros(num_tokens, hidden, dtype=dtype)
    for k in range(top_k):  # HF's eager experts: index_add_ of each rounded term into a model-dtype buffer
        hf += want.view(num_tokens, top_k, hidden)[:, k]
    scale = exact.abs().max().item()
    assert (summed - exact).abs().max().item() / scale < TOL[dtype]
    if dtype != torch.float32:
        rms = lambda d: d.pow(2).mean().sqrt().item()  # noqa: E731
        assert rms(summed - exact) <= rms(hf.double() - exact)


@pytest.mark.parametrize("slot_dtype", REF_DTYPES)
def test_norm_and_sum_over_slots_of_any_float_dtype(slot_dtype):
    """The norm's and the sum kernel's slot loads take any float dtype (fp32 residual here: the interpreter loads
    bf16 exactly, its casts to bf16 truncate), against the references."""
    from metainfer.kernels.fused_moe import moe_sum_triton
    from metainfer.kernels.moe_ref import ExpertSlots, moe_sum_ref
    from metainfer.kernels.rms_norm import fused_add_rms_norm_slots_ref, fused_add_rms_norm_slots_triton

    g = torch.Generator().manual_seed(23)
    ids = torch.randint(-1, 5, (4, 3), generator=g, dtype=torch.int32)
    slots = ExpertSlots(torch.randn(12, 40, generator=g).to(DEVICE, slot_dtype), ids.to(DEVICE), 4)
    residual = torch.randn(4, 40, generator=g).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(40, generator=g)).to(DEVICE)
    torch.testing.assert_close(moe_sum_triton(slots, torch.float32), moe_sum_ref(slots, torch.float32),
                               rtol=1e-6, atol=1e-6)
    res_t, res_r = residual.clone(), residual.clone()
    got, _ = fused_add_rms_norm_slots_triton(slots, res_t, weight, 1e-6)
    want, _ = fused_add_rms_norm_slots_ref(slots, res_r, weight, 1e-6)
    torch.testing.assert_close(res_t, res_r, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ON_GPU, reason="the compiled kernels at a real width (GPU tier)")
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_slots_norm_is_the_chain_bit_for_bit_at_real_width(num_tokens):
    """Compiled, bf16, DeepSeek-V2-Lite's width (H = 2,048, 6 routed + 2 shared of 66 experts): the folded norm
    against the sum kernel + add-norm chain, bit for bit, output and residual."""
    from metainfer.kernels.fused_moe import fused_moe_slots_triton, moe_sum_triton
    from metainfer.kernels.rms_norm import fused_add_rms_norm_slots_triton, fused_add_rms_norm_triton

    args = _moe_inputs(num_tokens, 66, 1408, 2048, 8, torch.bfloat16, seed=num_tokens)
    slots = fused_moe_slots_triton(*args)
    weight = torch.rand(2048, device=DEVICE, dtype=torch.bfloat16) + 0.5
    residual = torch.randn(num_tokens, 2048, device=DEVICE, dtype=torch.bfloat16)
    res_folded, res_chain = residual.clone(), residual.clone()
    folded, _ = fused_add_rms_norm_slots_triton(slots, res_folded, weight, 1e-6, pdl=True)
    chain, _ = fused_add_rms_norm_triton(moe_sum_triton(slots, torch.bfloat16, pdl=True), res_chain, weight, 1e-6,
                                         pdl=True)
    assert torch.equal(folded, chain) and torch.equal(res_folded, res_chain)


def test_norm_over_zero_slots_adds_nothing():
    """K = 0 (a token with no slots): the residual is normed as it is (the sum is 0), as the chain gives."""
    from metainfer.kernels.moe_ref import ExpertSlots
    from metainfer.kernels.rms_norm import fused_add_rms_norm_slots_ref, fused_add_rms_norm_slots_triton

    slots = ExpertSlots(torch.zeros(0, 16, device=DEVICE), torch.zeros(3, 0, dtype=torch.int32, device=DEVICE), 4)
    residual = torch.randn(3, 16, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    weight = torch.ones(16, device=DEVICE)
    res_t, res_r = residual.clone(), residual.clone()
    got, _ = fused_add_rms_norm_slots_triton(slots, res_t, weight, 1e-6)
    want, _ = fused_add_rms_norm_slots_ref(slots, res_r, weight, 1e-6)
    assert torch.equal(res_t, residual) and torch.equal(res_r, residual)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_norm_over_slots_rejects_mismatched_shapes():
    from metainfer.kernels.moe_ref import ExpertSlots
    from metainfer.kernels.rms_norm import fused_add_rms_norm_slots_triton

    slots = ExpertSlots(torch.zeros(6, 16, device=DEVICE), torch.zeros(3, 2, dtype=torch.int32, device=DEVICE), 4)
    with pytest.raises(ValueError, match="slots"):
        fused_add_rms_norm_slots_triton(slots, torch.zeros(2, 16, device=DEVICE), torch.ones(16, device=DEVICE), 1e-6)
