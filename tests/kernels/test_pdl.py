"""Programmatic dependent launch (PDL): how it is selected, and that it changes no result.

CPU: `select_ops(..., pdl=True)` binds every Triton launcher and the GEMV to PDL and refuses a
device that cannot run it. GPU (METAINFER_TEST_GPU=1 on sm_90+): a chain of decode layers at
Qwen3-8B widths, where each kernel may start while the previous one finishes, must give bit for
bit the output and KV cache of the same chain launched without PDL, eagerly and replayed from a
CUDA graph. A kernel that read its input or wrote its output before `pdl_enter` would race here.
"""

import functools
import inspect

import pytest
import torch

from metainfer.kernels import REF_OPS, TRITON_OPS, build_cos_sin_cache, pdl_supported, select_ops
from metainfer.kernels.gemv import gemv_triton
from tests.helpers.kernel_devices import ON_GPU

PDL_LAUNCHERS = ("rms_norm", "fused_add_rms_norm", "rotary_neox", "silu_and_mul", "store_kv",
                 "paged_decode_attention", "paged_prefill_attention", "qk_norm_rope_store", "step_inputs")


def test_select_ops_binds_pdl_to_every_triton_launcher():
    ops = select_ops("cuda", pdl=True, gpu_name="NVIDIA H200")
    assert ops.pdl and ops.backend == "triton"
    for name in PDL_LAUNCHERS:
        fn = getattr(ops, name)
        assert isinstance(fn, functools.partial) and fn.keywords == {"pdl": True}, name
        assert fn.func is getattr(TRITON_OPS, name), name
    assert ops.linear.keywords["pdl"] is True and ops.linear.keywords["base"].keywords["pdl"] is True
    fused = ops.silu_mul_linear  # the SiLU-folded GEMV, and its unfused fallback
    gemv_table = ops.linear.keywords["base"].keywords["table"]  # the GEMV's, under the skinny GEMM's wrapper
    assert fused.keywords["pdl"] is True and fused.keywords["table"] == gemv_table
    unfused = fused.keywords["unfused"].keywords
    assert unfused["linear"].keywords["pdl"] is True and unfused["silu_and_mul"].keywords == {"pdl": True}


def test_select_ops_without_pdl_leaves_launchers_unbound():
    ops = select_ops("cuda", gpu_name="NVIDIA H200")
    assert not ops.pdl
    for name in PDL_LAUNCHERS:
        assert getattr(ops, name) is getattr(TRITON_OPS, name), name
    assert ops.linear.keywords["pdl"] is False
    # a GPU without a tuned GEMV table: cuBLAS, which takes no pdl keyword
    assert select_ops("cuda", gpu_name="Some Other GPU", pdl=True).linear is REF_OPS.linear


def test_every_launcher_takes_the_pdl_keyword():
    for fn in [getattr(TRITON_OPS, name) for name in PDL_LAUNCHERS] + [gemv_triton]:
        param = inspect.signature(fn).parameters.get("pdl")
        assert param is not None and param.default is False, fn.__name__


@pytest.mark.parametrize("device, use_triton", [("cpu", None), ("cpu", True), ("cuda", False)])
def test_pdl_is_refused_where_it_cannot_run(device, use_triton):
    with pytest.raises(ValueError, match="pdl"):
        select_ops(device, use_triton=use_triton, pdl=True)


def test_pdl_supported_is_false_on_cpu():
    assert not pdl_supported("cpu")


# ----------------------------------------------------------------------------------------------
# GPU: a decode chain with and without PDL
# ----------------------------------------------------------------------------------------------

HIDDEN, HQ, HK, D, INTER, LAYERS, EPS = 4096, 32, 8, 128, 12288, 6, 1e-6
BLOCK, NUM_BLOCKS, CONTEXT = 16, 256, 700


def _decode_chain_inputs(batch: int) -> dict:
    """Random weights and a paged KV cache of `CONTEXT` tokens per sequence (one cache per layer)."""
    g = torch.Generator(device="cuda").manual_seed(batch)
    dev, dt = "cuda", torch.bfloat16

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    layers = [{"w_in": 1 + rand(HIDDEN, scale=0.1), "w_post": 1 + rand(HIDDEN, scale=0.1),
               "qkv": rand((HQ + 2 * HK) * D, HIDDEN), "o": rand(HIDDEN, HQ * D),
               "gate_up": rand(2 * INTER, HIDDEN), "down": rand(HIDDEN, INTER),
               "q_norm": 1 + rand(D, scale=0.1), "k_norm": 1 + rand(D, scale=0.1),
               "k_cache": rand(NUM_BLOCKS, BLOCK, HK, D, scale=1.0),
               "v_cache": rand(NUM_BLOCKS, BLOCK, HK, D, scale=1.0)}
              for _ in range(LAYERS)]
    width = -(-CONTEXT // BLOCK)
    tables = torch.randperm(NUM_BLOCKS, generator=g, device=dev)[: batch * width].view(batch, width).int()
    positions = torch.full((batch,), CONTEXT - 1, device=dev, dtype=torch.int64)
    last = CONTEXT - 1
    slots = (tables[:, last // BLOCK].long() * BLOCK + last % BLOCK).int()
    return {"layers": layers, "tables": tables, "positions": positions, "slots": slots,
            "context_lens": torch.full((batch,), CONTEXT, device=dev, dtype=torch.int32),
            "cos_sin": build_cos_sin_cache(D, 4096, 1e6, None).to(dev), "x": rand(batch, HIDDEN, scale=1.0)}


def _decode_chain(ops, inp: dict) -> torch.Tensor:
    """The kernel sequence of Qwen3 decode layers, as the dense model and the paged attention backend launch
    them: the (add +) RMSNorm, the qkv GEMM, q/k norm + rotary + K/V store, decode attention, o_proj, the
    norm, gate_up, and at batch 1-2 SiLU-and-mul inside the down GEMV; at 5 the activation as its own kernel
    before the skinny GEMM (o_proj, gate_up, down on the H200 table) or cuBLAS (qkv)."""
    hidden, residual = inp["x"].clone(), None
    for w in inp["layers"]:
        if residual is None:
            normed, residual = ops.rms_norm(hidden, w["w_in"], EPS), hidden
        else:
            normed, residual = ops.fused_add_rms_norm(hidden, residual, w["w_in"], EPS)
        qkv = ops.linear(normed, w["qkv"], None)
        q, _, _ = ops.qk_norm_rope_store(qkv, inp["positions"], inp["cos_sin"], w["q_norm"], w["k_norm"], EPS,
                                         w["k_cache"], w["v_cache"], inp["slots"], HQ, HK, D)
        attn = ops.paged_decode_attention(q, w["k_cache"], w["v_cache"], inp["tables"], inp["context_lens"],
                                          D ** -0.5)
        hidden = ops.linear(attn.reshape(-1, HQ * D), w["o"])
        normed, residual = ops.fused_add_rms_norm(hidden, residual, w["w_post"], EPS)
        gate_up = ops.linear(normed, w["gate_up"], None)
        hidden = ops.silu_mul_linear(gate_up, w["down"], None)
    hidden, _ = ops.fused_add_rms_norm(hidden, residual, inp["layers"][0]["w_in"], EPS)
    return hidden


def _caches(inp: dict) -> list[torch.Tensor]:
    return [w[name].clone() for w in inp["layers"] for name in ("k_cache", "v_cache")]


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available() and pdl_supported("cuda")),
                    reason="needs METAINFER_TEST_GPU=1 and a CUDA GPU of compute capability >= 9")
@pytest.mark.parametrize("batch", [1, 2, 5])  # 1-2: the Triton GEMV; 5: the skinny GEMM and cuBLAS (qkv)
def test_pdl_chain_is_bitwise_equal_eager_and_in_a_graph(batch):
    name = torch.cuda.get_device_name()
    plain = select_ops("cuda", gpu_name=name)
    pdl = select_ops("cuda", gpu_name=name, pdl=True)
    inp = _decode_chain_inputs(batch)
    initial = _caches(inp)

    def reset():
        for cache, saved in zip([w[n] for w in inp["layers"] for n in ("k_cache", "v_cache")], initial):
            cache.copy_(saved)

    ref = _decode_chain(plain, inp).clone()
    ref_caches = _caches(inp)
    assert ref.float().abs().sum() > 0 and any(not torch.equal(a, b) for a, b in zip(ref_caches, initial))
    for _ in range(3):  # back-to-back runs: the next chain's first kernels overlap this one's last
        reset()
        got = _decode_chain(pdl, inp)
        assert torch.equal(got, ref)
        assert all(torch.equal(a, b) for a, b in zip(_caches(inp), ref_caches))

    reset()
    _decode_chain(pdl, inp)  # warm-up outside the capture (compiles, default buffers)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _decode_chain(pdl, inp)
    for _ in range(3):
        reset()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)
        assert all(torch.equal(a, b) for a, b in zip(_caches(inp), ref_caches))
