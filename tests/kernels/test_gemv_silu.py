"""The GEMV with SiLU-and-mul folded into its x loads (the MLP's down projection at batch 1-2) against the
unfused activation reference then an fp32 linear on its rounded output; the first-tile preload against
the plain loop, bit for bit."""

from __future__ import annotations

import pytest
import torch

from metainfer.kernels.activation import silu_and_mul_ref
from metainfer.kernels.gemv import GemvConfig, silu_mul_gemv_triton
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
# one output ulp (fp32: accumulation order)
TIGHT = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
         torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}
EPS = 1e-6
# (config, N, K): even and ragged N/K, a K split, x loaded 1-D (BLOCK_K spans
# the warps) and 2-D
CASES = [
    (GemvConfig(block_n=8, block_k=32, num_warps=4), 24, 64),
    (GemvConfig(block_n=8, block_k=32, num_warps=4), 13, 100),
    (GemvConfig(block_n=4, block_k=64, num_warps=4, split_k=3), 37, 300),
    (GemvConfig(block_n=4, block_k=1024, num_warps=1), 20, 256),
]


def _linear(x, w, b):
    """fp32 math on the rounded operand, rounded once, like the kernel's accumulation."""
    return torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _data(m, n, k, dtype, seed, x_cols=None, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, x_cols or k, generator=g) * 2
    res = torch.randn(m, k, generator=g)
    nw = 1 + 0.3 * torch.randn(k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    to = lambda t: None if t is None else t.to(dtype).to(DEVICE)  # noqa: E731
    return to(x), to(res), to(nw), to(w), to(b)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_silu_mul_gemv_matches_unfused(dtype, m, case):
    cfg, n, k = CASES[case]
    gate_up, _, _, w, b = _data(m, n, k, dtype, seed=case * 7 + m, x_cols=2 * k, bias=case == 0)
    y = silu_mul_gemv_triton(gate_up, w, b, config=cfg)
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y.float(), _linear(silu_and_mul_ref(gate_up), w, b).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", KERNEL_DTYPES[:1] + [pytest.param(d, marks=pytest.mark.slow)
                                                       for d in KERNEL_DTYPES[1:]])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("prologue", ["none", "silu_mul"])
def test_preload_is_bitwise_equal_to_the_plain_loop(dtype, m, case, prologue, monkeypatch):
    """GemvConfig.preload peels the first K-step (its weight tile loaded before the PDL wait): the same
    products summed in the same order, so every output bit equals the plain
    kernel's, with and without PDL, a K split, ragged N / K, and a single K-step (the loop empty after
    the peel: case 3's one 256-column tile)."""
    from dataclasses import replace

    import metainfer.kernels.gemv as gemv_mod
    from metainfer.kernels import pdl_supported
    from metainfer.kernels.gemv import gemv_triton

    cfg, n, k = CASES[case]
    pre = replace(cfg, preload=True)
    seen = []  # the PRELOAD constexpr each launch got: the test must compare two different kernels

    class Spy:
        def __getitem__(self, grid, kernel=gemv_mod._gemv_kernel):
            def launch(*args, **kwargs):
                seen.append(kwargs["PRELOAD"])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(gemv_mod, "_gemv_kernel", Spy())
    x_cols = 2 * k if prologue == "silu_mul" else None
    x, res, nw, w, b = _data(m, n, k, dtype, seed=case * 11 + m, x_cols=x_cols, bias=case != 1)
    for pdl in sorted({False, pdl_supported(DEVICE)}):
        def run(c, pdl=pdl):
            if prologue == "none":
                return (gemv_triton(x, w, b, config=c, pdl=pdl),)
            return (silu_mul_gemv_triton(x, w, b, config=c, pdl=pdl),)

        seen.clear()
        plain, preloaded = run(cfg), run(pre)
        assert seen == [False, True]
        for a, c in zip(plain, preloaded, strict=True):
            assert torch.equal(a, c), f"pdl={pdl}"


def test_preload_must_be_a_bool():
    with pytest.raises(ValueError, match="preload"):
        GemvConfig(preload=1)


def test_prologue_argument_errors():
    x, _, _, w, _ = _data(1, 8, 64, torch.float32, seed=1)
    with pytest.raises(ValueError, match="2K"):
        silu_mul_gemv_triton(x, w)  # gate_up must be twice the weight's K


# ----------------------------------------------------------------------------------------------
# selection and model wiring (CPU: the Triton kernels interpreted)
# ----------------------------------------------------------------------------------------------

HIDDEN, INTER = 64, 96
TABLE = {f"{2 * INTER}x{HIDDEN}": {"block_n": 8, "block_k": 32, "num_warps": 4},
         f"{HIDDEN}x{INTER}": {"block_n": 8, "block_k": 64, "num_warps": 4, "split_k": 2}}


def _mlp_spec():
    from metainfer.config import ModelSpec

    return ModelSpec(architecture="Qwen3ForCausalLM", model_type="qwen3", vocab_size=64, hidden_size=HIDDEN,
                     intermediate_size=INTER, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
                     rms_norm_eps=EPS, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                     tie_word_embeddings=False, qkv_bias=False, qk_norm=True)


def test_select_ops_fuses_only_with_a_table():
    from metainfer.kernels import REF_OPS, fused_linear, gemv, select_ops

    default = select_ops("cuda", gpu_name="NVIDIA H200")  # the activation folded into the down GEMV
    assert default.silu_mul_linear.func is fused_linear.silu_mul_linear_engine
    unfused = select_ops("cuda", gpu_name="NVIDIA H200", fuse_activation=False)
    assert unfused.silu_mul_linear.func is fused_linear.silu_mul_linear_unfused
    # the Triton GEMV under the skinny GEMM's rows wrapper (the H200 default)
    assert unfused.silu_mul_linear.keywords["linear"].keywords["base"].func is gemv.linear_engine
    cublas = select_ops("cuda", gpu_name="NVIDIA H200", gemv_table={}, skinny_gemm=False)
    assert cublas.linear is gemv.linear_ref and cublas.silu_mul_linear.func is fused_linear.silu_mul_linear_unfused
    assert select_ops("cuda", gpu_name="NVIDIA H200", gemv_table={}).linear.keywords["base"] is gemv.linear_ref
    assert REF_OPS.silu_mul_linear.keywords["silu_and_mul"] is REF_OPS.silu_and_mul


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU model wiring test")
@pytest.mark.parametrize("m", [1, 3])  # 1: the fused GEMV; 3: above ENGINE_MAX_ROWS, the unfused kernels
def test_dense_mlp_with_the_folded_activation_matches_the_reference(monkeypatch, m):
    from metainfer.kernels import REF_OPS, fused_linear, select_ops
    from metainfer.layers.mlp import GatedMLP

    launched = []
    real = fused_linear.silu_mul_gemv_triton
    monkeypatch.setattr(fused_linear, "silu_mul_gemv_triton", lambda *a, **k: launched.append(1) or real(*a, **k))
    ops = select_ops("cpu", use_triton=True, gemv_table=TABLE)
    gen = torch.Generator().manual_seed(m)
    spec = _mlp_spec()
    mlps = [GatedMLP(spec.hidden_size, spec.intermediate_size, variant, torch.float32) for variant in (REF_OPS, ops)]
    state = {k: torch.randn(v.shape, generator=gen) / 8 for k, v in mlps[0].state_dict().items()}
    for mlp in mlps:
        mlp.load_state_dict(state)
    x = torch.randn(m, HIDDEN, generator=gen)
    want, got = [mlp(x.clone()) for mlp in mlps]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert launched == ([1] if m == 1 else [])


def _mismatch(a, b) -> float:
    return (a != b).float().mean().item()


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("cfg", [GemvConfig(block_n=8, block_k=32, num_warps=4),     # x loaded 1-D
                                 GemvConfig(block_n=4, block_k=1024, num_warps=1)])  # 2-D
def test_silu_operand_through_an_identity_weight(dtype, cfg):
    """W = I makes y the GEMV's x operand itself (one nonzero product a row): the SiLU fold's operand
    is silu_and_mul's output (in half precision element for element, but for rare ties): the formula,
    not only a tolerance."""
    k = 256
    eye = torch.eye(k, dtype=dtype, device=DEVICE)
    gate_up, _, _, _, _ = _data(2, k, k, dtype, seed=5, x_cols=2 * k)
    act, ref = silu_mul_gemv_triton(gate_up, eye, config=cfg), silu_and_mul_ref(gate_up)
    if dtype == torch.float32:  # no rounding points: exp / division order only
        torch.testing.assert_close(act, ref, rtol=1e-6, atol=1e-6)
    else:  # the same rounded activation but for rare ties of exp
        assert _mismatch(act, ref) < 0.01
    once = (torch.nn.functional.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()).to(dtype)
    if dtype != torch.float32:  # teeth: a single rounding is told apart from silu_and_mul's two
        assert _mismatch(once, silu_and_mul_ref(gate_up)) > 0.05
