"""Skinny GEMM (tensor cores, a few to 64 rows): against F.linear in float64.

Interpreted on the CPU (fp32, fp16), compiled on the GPU with bf16 too: ragged row counts around
the padded MMA width, N and K off the tile sizes, explicit and automatic K splits, a bias, and
argument errors. The AOT check compiles the Qwen3-8B decode shapes for sm_90.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metainfer.kernels import select_ops
from metainfer.kernels.skinny_gemm import MAX_ROWS, SkinnyConfig, linear_with_skinny, skinny_gemm_triton, skinny_split_k
from tests.helpers.aot import run_aot_check
from tests.helpers.kernel_devices import DEVICE, KERNEL_DTYPES

triton = pytest.importorskip("triton")

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _inputs(m, n, k, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE)


def _check(y, x, w, b, dtype):
    ref = F.linear(x.double().cpu(), w.double().cpu(), None if b is None else b.double().cpu())
    assert y.dtype == dtype and y.shape == ref.shape
    err = (y.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    assert err < TOL[dtype], f"relative error {err:.2e}"


CASES = [  # (m, n, k, config)
    (3, 100, 96, SkinnyConfig(block_n=32, block_k=32, split_k=1)),   # N and K off the tiles
    (5, 256, 512, SkinnyConfig(block_n=64, block_k=64, split_k=3)),  # an explicit ragged K split
    (16, 130, 1000, SkinnyConfig(block_n=64, block_k=128)),          # automatic: too few K-steps to split
    (20, 64, 4096, SkinnyConfig()),                                  # the automatic split (8), BLOCK_M 32
    (33, 64, 256, SkinnyConfig(block_n=32, block_k=64, split_k=2)),  # rows past one MMA width of 32
    (MAX_ROWS, 96, 160, SkinnyConfig(block_n=32, block_k=32, num_stages=2)),
    (1, 48, 64, SkinnyConfig(block_n=16, block_k=16, split_k=1)),
]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"m{c[0]}-n{c[1]}-k{c[2]}-split{c[3].split_k}")
def test_skinny_gemm_matches_linear(case, dtype, bias):
    m, n, k, cfg = case
    x, w, b = _inputs(m, n, k, dtype, bias)
    _check(skinny_gemm_triton(x, w, b, config=cfg), x, w, b, dtype)


def test_skinny_gemm_strided_rows():
    """x and weight as row slices of larger tensors (row strides != K)."""
    x, w, _ = _inputs(7, 80, 300, torch.float32, False)
    xs = torch.zeros(7, 400, device=DEVICE)
    xs[:, :300] = x
    ws = torch.zeros(80, 320, device=DEVICE)
    ws[:, :300] = w
    cfg = SkinnyConfig(block_n=32, block_k=64, split_k=2)
    _check(skinny_gemm_triton(xs[:, :300], ws[:, :300], config=cfg), x, w, None, torch.float32)


def test_skinny_split_k_is_shape_only():
    assert skinny_split_k(4096, 4096) == 5  # 64 programs at BLOCK_N 64: 5 splits reach the 264-program target
    assert skinny_split_k(151936, 4096) == 1  # 2,374 programs fill the GPU
    assert skinny_split_k(4096, 12288, SkinnyConfig(split_k=3)) == 3
    assert skinny_split_k(64, 256) == 1  # at least 4 K-steps a split


def test_skinny_gemm_rejects_bad_inputs():
    x, w, _ = _inputs(4, 32, 64, torch.float32, False)
    with pytest.raises(ValueError, match="skinny_gemm"):
        skinny_gemm_triton(torch.zeros(MAX_ROWS + 1, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="skinny_gemm"):
        skinny_gemm_triton(x[:, :32], w)
    with pytest.raises(ValueError, match="skinny_gemm"):
        skinny_gemm_triton(x.half(), w)
    with pytest.raises(ValueError, match="split_k"):
        SkinnyConfig(split_k=-1)
    with pytest.raises(ValueError, match="block_n"):
        SkinnyConfig(block_n=48)


@pytest.mark.slow
def test_aot_compile_sm90_skinny_gemm():
    run_aot_check(["skinny_gemm"])


def test_linear_with_skinny_dispatches_by_rows():
    """3..MAX_ROWS rows go to the skinny GEMM, the rest to the base linear (shape only)."""
    calls = []

    def base(x, w, b=None):
        calls.append(x.shape[0])
        return F.linear(x, w, b)

    w = torch.randn(32, 64, device=DEVICE)
    for rows, to_base in ((1, True), (2, True), (3, False), (MAX_ROWS, False), (MAX_ROWS + 1, True)):
        calls.clear()
        x = torch.randn(rows, 64, device=DEVICE)
        y = linear_with_skinny(x, w, base=base, pdl=False)
        assert calls == ([rows] if to_base else []), rows
        _check(y, x, w, None, torch.float32)


def test_select_ops_skinny_switch():
    """On by default where the GPU has a skinny table (the H200), wrapping the GEMV / cuBLAS linear;
    skinny_gemm=False or a GPU without a table leaves that linear as it is."""
    from metainfer.kernels.skinny_gemm import parse_skinny_table
    from metainfer.kernels.tuned_configs import load_tuned_configs

    plain = select_ops("cpu", use_triton=True, gpu_name="NVIDIA H200", skinny_gemm=False)
    skinny = select_ops("cpu", use_triton=True, gpu_name="NVIDIA H200")
    base = skinny.linear.keywords["base"]
    assert skinny.linear.func is linear_with_skinny
    assert skinny.linear.keywords["table"] == parse_skinny_table(load_tuned_configs("NVIDIA H200")["skinny"])
    assert base.func is plain.linear.func and base.keywords == plain.linear.keywords
    assert skinny.silu_mul_linear.keywords["unfused"].keywords["linear"] is skinny.linear  # M > 2 falls back to it
    other = select_ops("cpu", use_triton=True, gpu_name="some GPU")
    assert other.linear is select_ops("cpu", use_triton=True, gpu_name="some GPU", skinny_gemm=False).linear



def test_linear_with_skinny_takes_only_the_tables_entries():
    """A tuned table sends only its (shape, row bucket) entries to the skinny GEMM, with their configs."""
    from metainfer.kernels.skinny_gemm import parse_skinny_table

    calls = []

    def base(x, w, b=None):
        calls.append((x.shape[0], w.shape[0]))
        return F.linear(x, w, b)

    table = parse_skinny_table({"32x64/m16": {"block_n": 16, "block_k": 32, "split_k": 2},
                                (48, 64, 32): SkinnyConfig(block_n=16, block_k=16)})
    assert parse_skinny_table({" 32X64 /M16": {}}) == {(32, 64, 16): SkinnyConfig()}  # the GEMV keys' leniency
    w32, w48 = torch.randn(32, 64, device=DEVICE), torch.randn(48, 64, device=DEVICE)
    for rows, w, to_base in ((5, w32, False), (16, w32, False), (17, w32, True), (20, w48, False), (8, w48, True)):
        calls.clear()
        x = torch.randn(rows, 64, device=DEVICE)
        y = linear_with_skinny(x, w, base=base, pdl=False, table=table)
        assert calls == ([(rows, w.shape[0])] if to_base else []), (rows, w.shape)
        _check(y, x, w, None, torch.float32)


@pytest.mark.parametrize("table", [{"32x64": {}}, {"32x64/m8": {}}, {"0x64/m16": {}}, {"32x64/m16": {"bogus": 1}},
                                   {"32x64/m16": {"block_n": 3}}, {"32x64/m16": "64x128"}, [("32x64/m16", {})],
                                   {(32, 64, 8): {}}, {(32, 64, True): {}}, {(32, 64, 16.0): {}}, {(32, 64): {}},
                                   {"32x/m16": {}}])
def test_bad_skinny_tables_raise(table):
    from metainfer.kernels.skinny_gemm import parse_skinny_table

    with pytest.raises(ValueError):
        parse_skinny_table(table)


def test_select_ops_binds_a_skinny_table():
    table = {"32x64/m16": {"block_n": 16, "block_k": 32}}
    ops = select_ops("cpu", use_triton=True, gpu_name="NVIDIA H200", skinny_gemm=True, skinny_table=table)
    assert ops.linear.keywords["table"] == {(32, 64, 16): SkinnyConfig(block_n=16, block_k=32)}
    untuned = select_ops("cpu", use_triton=True, gpu_name="some GPU", skinny_table=table)
    assert untuned.linear.keywords["table"] == {(32, 64, 16): SkinnyConfig(block_n=16, block_k=32)}


@pytest.mark.slow
@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors through the interpreter (run 22 ran it compiled: a test bug)")
def test_skinny_sweep_plumbing_on_cpu(monkeypatch):
    """tools.tune_skinny.sweep's bookkeeping (verify, per-bucket pick, only where it beats cuBLAS, decode
    set) with the GPU timing stubbed out: each timed call still runs once through the interpreter."""
    import json

    import tools.tune_skinny as sb
    from metainfer.kernels.skinny_gemm import parse_skinny_table

    ticks = iter(range(10_000, 0, -1))  # later measurements look faster: cuBLAS loses, the last config wins

    def fake_time_graph(calls, replays):
        for call in calls:
            call()
        return float(next(ticks))

    monkeypatch.setattr(sb, "time_graph", fake_time_graph)
    monkeypatch.setattr("tools.tune_gemv.time_graph", fake_time_graph)
    monkeypatch.setattr(sb, "_env", lambda device: {"gpu": "cpu"})
    configs = (SkinnyConfig(block_n=16, block_k=32, split_k=1), SkinnyConfig(block_n=32, block_k=16, split_k=2))
    shapes = {"a": (40, 64), "b": (24, 96)}
    res = sb.sweep(device="cpu", shapes=shapes, rows=(8, 16, 20), configs=configs, dtype=torch.float32)
    json.dumps(res)
    assert set(res["shapes"]) == {f"{nm}/rows{m}" for nm in shapes for m in (8, 16, 20)}
    assert all(r["ok"] for s in res["shapes"].values() for r in s["configs"])
    assert parse_skinny_table(res["table"]) == {(n, k, b): configs[-1] for n, k in shapes.values() for b in (16, 32)}
    assert set(res["decode_set"]) == {"m8", "m16", "m20"}
    ticks = iter(range(1, 10_000))  # later measurements look slower: cuBLAS (timed first) wins everywhere
    res = sb.sweep(device="cpu", shapes={"a": (40, 64)}, rows=(8,), configs=configs[:1], dtype=torch.float32)
    assert res["table"] == {} and res["shapes"]["a/rows8"]["best"]["config"] == configs[0].to_dict()
    for bad in ((2, 8), (65,), ()):
        with pytest.raises(ValueError, match="rows"):
            sb.sweep(device="cpu", shapes={"a": (40, 64)}, rows=bad, configs=configs[:1], dtype=torch.float32)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_a_row_does_not_depend_on_the_row_count(dtype):
    """Eager runs a 5-sequence decode at 5 rows, a CUDA graph at its 8-row bucket (padded): both
    compile for BLOCK_M 16 and each output row sums the same products in the same order, so the
    first 5 rows are bit-equal (graph == eager for the skinny GEMM)."""
    cfg = SkinnyConfig(block_n=32, block_k=32, split_k=2)
    x8, w, b = _inputs(8, 96, 256, dtype, bias=True, seed=4)
    assert torch.equal(skinny_gemm_triton(x8[:5].contiguous(), w, b, cfg), skinny_gemm_triton(x8, w, b, cfg)[:5])


def test_model_linear_shapes_match_the_checkpoint_shapes():
    """The sweep's shapes for DeepSeek-V2-Lite (the engine's model on the meta device) against the checkpoint's
    parameter shapes (knowledge.spec_report, written from the config independently): the q and latent
    projections fused, gate and up fused in the one dense layer, o_proj and the LM head as they are; the
    router and kv_b_proj (not multiplied by the decode's linear) left out."""
    from metainfer.config.model_spec import ModelSpec
    from metainfer.knowledge.spec_report import param_shapes
    from tools.tune_skinny import model_linear_shapes

    path = "benchmarks/configs/deepseek-v2-lite.json"
    spec = ModelSpec.from_file(path)
    ckpt = param_shapes(spec)
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    dense = spec.num_layers - len(spec.moe_layers)
    h, q, kv_a = spec.hidden_size, ckpt[a + "q_proj.weight"], ckpt[a + "kv_a_proj_with_mqa.weight"]
    want = [(q[0] + kv_a[0], h, spec.num_layers), (*ckpt[a + "o_proj.weight"], spec.num_layers),
            (2 * ckpt[m + "gate_proj.weight"][0], h, dense), (*ckpt[m + "down_proj.weight"], dense),
            (*ckpt["lm_head.weight"], 1)]
    shapes, counts = model_linear_shapes(path)
    assert sorted((n, k, counts[name]) for name, (n, k) in shapes.items()) == sorted(want)
