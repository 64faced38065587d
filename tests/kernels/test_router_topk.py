"""The fused router (kernels/moe_routing.py: router_topk_triton, GEMM + routing in one launch for decode-sized
batches) against router_topk_ref (F.linear in the weight's dtype, then route_topk_ref).

Interpreted on the CPU at small shapes; compiled on the GPU (METAINFER_TEST_GPU=1) at the real router
shapes (DeepSeek-V2-Lite: fp32 weight [64, 2048]; Qwen3-30B-A3B: bf16 weight [128, 2048]) and replayed from
a CUDA graph, which only works if the last program resets the ticket counter every launch.
"""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels.moe_ref import router_topk_ref
from metainfer.kernels.moe_routing import ROUTER_FUSED_MAX_TOKENS, router_topk_triton, router_workspace
from tests.helpers.aot import aot_main, run_aot_main
from tests.helpers.kernel_devices import DEVICE, ON_GPU

pytest.importorskip("triton")

SHAPES = [(64, 2048), (128, 2048)] if ON_GPU else [(8, 96), (64, 160), (128, 64)]


def _margin_rows(x, weight, top_k) -> torch.Tensor:
    """Rows whose k-th and (k+1)-th logits (fp64) differ by more than the logits' rounding (fp32 sums in
    another order; a 16-bit weight's logits are rounded to 16 bits) can move them."""
    logits = (x.double() @ weight.double().t()).sort(dim=1, descending=True).values
    if logits.shape[1] <= top_k:
        return torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
    ulp = 2.0 ** -7 if weight.dtype != torch.float32 else 2.0 ** -20
    return (logits[:, top_k - 1] - logits[:, top_k]) > 4 * ulp * logits[:, top_k - 1].abs().clamp(min=1)


def _inputs(num_tokens, num_experts, hidden, x_dtype, w_dtype, seed, top_k=None):
    """Random x [T, H] and router weight [E, H] (logits ~N(0, 4)); with top_k, the first seed from `seed`
    on where most rows' choice is decided (see _margin_rows)."""
    for attempt in range(50):
        g = torch.Generator(device=DEVICE).manual_seed(seed + 1000 * attempt)
        x = torch.randn(num_tokens, hidden, generator=g, device=DEVICE).to(x_dtype)
        weight = (torch.randn(num_experts, hidden, generator=g, device=DEVICE) * 2 / hidden ** 0.5).to(w_dtype)
        if top_k is None or _margin_rows(x, weight, top_k).float().mean() >= 0.5:
            return x, weight
    raise AssertionError("no seed gave decided routing")


@pytest.mark.parametrize("num_experts, hidden", SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 3, ROUTER_FUSED_MAX_TOKENS])
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("top_k, renormalize, scaling, shared", [(6, False, 1.0, 2), (8, True, 2.5, 0),
                                                                 (2, True, 1.0, 1)])
def test_router_topk_matches_ref(num_experts, hidden, num_tokens, x_dtype, w_dtype, top_k, renormalize, scaling,
                                 shared):
    top_k = min(top_k, num_experts)
    x, weight = _inputs(num_tokens, num_experts, hidden, x_dtype, w_dtype, seed=num_tokens * 7 + num_experts,
                        top_k=top_k)
    routing = dict(top_k=top_k, renormalize=renormalize, scaling=scaling, num_shared=shared)
    weights, ids = router_topk_triton(x, weight, router_workspace(num_experts, DEVICE), **routing)
    ref_w, ref_ids = router_topk_ref(x, weight, None, **routing)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert ids.shape == weights.shape == (num_tokens, top_k + shared)
    assert torch.equal(ids[:, top_k:].cpu(), torch.arange(num_experts, num_experts + shared).expand(num_tokens, -1)
                       .int())
    # the logits' summation order differs from the GEMM's: compare the rows whose choice is decided
    rows = _margin_rows(x, weight, top_k)
    # the experts chosen, each with its weight (their order among the chosen may differ at a near-tie)
    ids, order = ids[rows].sort(dim=1)
    ref_ids, ref_order = ref_ids[rows].sort(dim=1)
    assert torch.equal(ids, ref_ids)
    tol = dict(rtol=1e-5, atol=1e-6) if w_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(weights[rows].gather(1, order), ref_w[rows].gather(1, ref_order), **tol)


def test_router_topk_counter_returns_to_zero_and_launches_repeat():
    x, weight = _inputs(2, 64, SHAPES[1][1], torch.bfloat16, torch.float32, seed=5)
    workspace = router_workspace(64, DEVICE)
    first = router_topk_triton(x, weight, workspace, top_k=6, num_shared=2)
    assert int(workspace[1].item()) == 0
    for _ in range(3):
        again = router_topk_triton(x, weight, workspace, top_k=6, num_shared=2)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert int(workspace[1].item()) == 0


def test_router_topk_no_tokens_and_refusals():
    weight = torch.randn(8, 32, device=DEVICE)
    workspace = router_workspace(8, DEVICE)
    weights, ids = router_topk_triton(torch.empty(0, 32, device=DEVICE), weight, workspace, top_k=2)
    assert weights.shape == ids.shape == (0, 2)
    with pytest.raises(ValueError, match="tokens"):
        router_topk_triton(torch.randn(ROUTER_FUSED_MAX_TOKENS + 1, 32, device=DEVICE), weight, workspace, top_k=2)
    with pytest.raises(ValueError, match="method"):
        router_topk_triton(torch.randn(1, 32, device=DEVICE), weight, workspace, top_k=2,
                           method="group_limited_greedy", n_group=2, topk_group=1)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: compiled on the GPU only")
def test_router_topk_replays_from_a_cuda_graph():
    x, weight = _inputs(1, 64, 2048, torch.bfloat16, torch.float32, seed=9)
    workspace = router_workspace(64, DEVICE)
    expected = router_topk_ref(x, weight, None, top_k=6, num_shared=2)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        router_topk_triton(x, weight, workspace, top_k=6, num_shared=2)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_topk_triton(x, weight, workspace, top_k=6, num_shared=2)
    for seed in range(4):
        x.copy_(_inputs(1, 64, 2048, torch.bfloat16, torch.float32, seed=seed)[0])
        graph.replay()
        ref_w, ref_ids = router_topk_ref(x, weight, None, top_k=6, num_shared=2)
        rows = _margin_rows(x, weight, 6)
        assert torch.equal(out[1][rows], ref_ids[rows])
    assert int(workspace[1].item()) == 0
    del expected


def _aot_main() -> int:
    """Compile the fused router's launches (DeepSeek-V2-Lite's fp32 router and Qwen3-30B-A3B's bf16 one at
    1, 3 and 16 tokens, PDL on and off) for sm_90 as tools/aot_check.py does; run without TRITON_INTERPRET."""
    from metainfer.kernels import moe_routing as fm

    def launch():
        for num_experts, w_dtype, top_k, shared in ((64, torch.float32, 6, 2), (128, torch.bfloat16, 8, 0)):
            weight = torch.empty(num_experts, 2048, dtype=w_dtype)
            for num_tokens, pdl in ((1, True), (3, False), (ROUTER_FUSED_MAX_TOKENS, True)):
                fm.router_topk_triton(torch.zeros(num_tokens, 2048, dtype=torch.bfloat16), weight,
                                      router_workspace(num_experts), top_k=top_k, renormalize=True, num_shared=shared,
                                      pdl=pdl)

    return aot_main([fm._router_topk_kernel], launch)


@pytest.mark.slow
def test_aot_compile_sm90_router_kernel():
    assert run_aot_main("tests.kernels.test_router_topk", "_aot_main").count("ok _router_topk_kernel") == 6
