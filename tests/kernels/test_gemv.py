"""The Triton GEMV (interpreted on CPU) against torch's F.linear; config table; sweep plumbing."""

from __future__ import annotations

import json

import pytest
import torch

import metainfer.kernels.gemv as gemv_mod
import tools.tune_gemv as bench
from metainfer.kernels.gemv import (
    DEFAULT_CONFIG,
    GemvConfig,
    gemv_config,
    gemv_plan,
    gemv_triton,
    get_gemv_configs,
    linear_ref,
    linear_triton,
    set_gemv_configs,
)
from tests.helpers.kernel_devices import ON_GPU

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3)}

# CPU tensors through the interpreter (and the sweep's CPU plumbing): the GPU checks the compiled GEMV in
# test_gemv_silu.py (plain and folded launches, preload bit-equality), test_pdl.py (the decode chain) and
# the GPU suite's kernels / gemv sections
pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU-tensor interpreter tests")


@pytest.fixture(autouse=True)
def _restore_table():
    saved = get_gemv_configs()
    yield
    set_gemv_configs(saved)


def _data(m, n, k, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    return x.to(dtype), w.to(dtype), None if b is None else b.to(dtype)


def _ref(x, w, b):
    """fp32 math on the (already rounded) inputs, rounded once to x's dtype, like the kernel."""
    return linear_ref(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _check(got, x, w, b):
    assert got.dtype == x.dtype and got.shape == (x.shape[0], w.shape[0])
    torch.testing.assert_close(got.float(), _ref(x, w, b).float(), **TOL[x.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(24, 64), (13, 100), (37, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_linear(dtype, m, n, k, bias):
    x, w, b = _data(m, n, k, bias, dtype, seed=m * 100 + n)
    _check(gemv_triton(x, w, b, config=GemvConfig(block_n=8, block_k=32, num_warps=4)), x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_default_config_and_split_k_rows(dtype, m):
    """Table miss -> DEFAULT_CONFIG (BLOCK_K clamped to K); split-K with several rows and a bias."""
    x, w, b = _data(m, 29, 200, True, dtype, seed=5 + m)
    assert gemv_config(29, 200) == DEFAULT_CONFIG
    _check(gemv_triton(x, w, b), x, w, b)
    _check(gemv_triton(x, w, b, config=GemvConfig(block_n=4, block_k=32, num_warps=4, split_k=3)), x, w, b)


@pytest.mark.parametrize("cfg", bench.SWEEP_CONFIGS, ids=lambda c: f"{c.block_n}x{c.block_k}w{c.num_warps}s{c.split_k}")
def test_every_sweep_config_on_tiny_shape(cfg):
    # K = 1100 is a multiple of none of the block widths; N = 20 of neither 8 nor 16
    x, w, b = _data(1, 20, 1100, True, torch.float16, seed=cfg.block_n * 7 + cfg.split_k)
    plan = gemv_plan(1, 20, 1100, cfg)
    assert plan.block_k == min(cfg.block_k, 2048) and plan.block_n == cfg.block_n  # 2048 = next_pow2(1100)
    assert not plan.even_k and plan.even_n == (20 % cfg.block_n == 0)
    _check(gemv_triton(x, w, b, config=cfg), x, w, b)


def test_sweep_grid_covers_the_families():
    cfgs = bench.SWEEP_CONFIGS
    assert 12 <= len(cfgs) <= 40 and len(set(cfgs)) == len(cfgs)
    assert {c.block_n for c in cfgs} >= {4, 8, 16} and {c.block_k for c in cfgs} >= {256, 512, 1024}
    assert {c.num_warps for c in cfgs} >= {4, 8} and any(c.split_k > 1 for c in cfgs)
    assert DEFAULT_CONFIG in cfgs and set(bench.QUICK_CONFIGS) <= set(cfgs)
    plans = [gemv_plan(1, 4096, 4096, c) for c in cfgs]
    assert {p.x_2d for p in plans} == {True, False}  # both x-load forms are in the grid


def test_plan():
    p = gemv_plan(1, 4096, 12288, GemvConfig(8, 1024, 8, split_k=2))
    assert (p.grid, p.k_per_split, p.split_k, p.even_n, p.even_k, p.x_2d) == ((512, 2), 6144, 2, True, True, True)
    p = gemv_plan(1, 4096, 4096, GemvConfig(4, 1024, 4))
    assert (p.grid, p.x_2d, p.even_k) == ((1024, 1), False, True)
    p = gemv_plan(3, 4096, 4096, GemvConfig(8, 1024, 8))  # rows padded to 4: BLOCK_K / 4
    assert (p.rows, p.block_k, p.grid) == (3, 256, (512, 1))
    p = gemv_plan(1, 20, 64, GemvConfig(8, 1024, 8, split_k=4))  # tile clamped to K; one split left
    assert (p.block_k, p.split_k, p.k_per_split, p.even_k, p.even_n) == (64, 1, 64, True, False)
    p = gemv_plan(1, 20, 100, GemvConfig(8, 32, 4, split_k=3))  # 3 splits of 64 > 100: last one partial
    assert (p.split_k, p.k_per_split, p.even_k) == (2, 64, False)
    assert gemv_plan(1, 64, 512, GemvConfig(8, 512, 4), elem_bytes=4).x_2d is False  # fp32: 4 a vector
    assert gemv_plan(1, 64, 512, GemvConfig(8, 512, 4), elem_bytes=2).x_2d is True


def test_strided_inputs():
    """x rows and weight rows with strides larger than K (views into wider buffers)."""
    g = torch.Generator().manual_seed(3)
    xb, wb = torch.randn(3, 150, generator=g), torch.randn(21, 160, generator=g) / 10
    x, w = xb[:, 10:110], wb[:, 5:105]
    assert x.stride(0) == 150 and w.stride(0) == 160
    for cfg in (GemvConfig(8, 32, 4), GemvConfig(4, 64, 4, split_k=2)):
        _check(gemv_triton(x, w, config=cfg), x, w, None)


class _Recorder:
    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


def test_config_table_changes_the_launch(monkeypatch):
    rec, red = _Recorder(), _Recorder()
    monkeypatch.setattr(gemv_mod, "_gemv_kernel", rec)
    monkeypatch.setattr(gemv_mod, "_splitk_reduce_kernel", red)
    x, w = torch.randn(1, 512), torch.randn(64, 512)

    gemv_triton(x, w)  # (64, 512) is not in the table
    grid, kw = rec.launches[-1]
    assert gemv_config(64, 512) == DEFAULT_CONFIG
    assert (grid, kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["SPLIT_K"]) == ((8, 1), 8, 512, 8, 1)

    previous = set_gemv_configs({(64, 512): GemvConfig(block_n=16, block_k=128, num_warps=4, num_stages=3,
                                                        split_k=2)})
    assert previous == {}  # nothing installed by default: DEFAULT_CONFIG everywhere
    linear_triton(x, w)  # the engine's entry point reads the same table
    grid, kw = rec.launches[-1]
    assert (grid, kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["num_stages"], kw["SPLIT_K"]) == \
        ((4, 2), 16, 128, 4, 3, 2)
    assert red.launches[-1][1]["SPLIT_K"] == 2

    set_gemv_configs({"64x512": {"block_n": 4, "block_k": 256, "num_warps": 4}})  # the sweep's JSON form
    gemv_triton(x, w)
    grid, kw = rec.launches[-1]
    assert (grid, kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["num_stages"], kw["SPLIT_K"]) == \
        ((16, 1), 4, 256, 4, 1, 1)
    assert gemv_config(64, 512) == GemvConfig(4, 256, 4)

    gemv_triton(x, w, config=GemvConfig(8, 64, 8))  # an explicit config beats the table
    assert rec.launches[-1][0] == (8, 1) and rec.launches[-1][1]["BLOCK_K"] == 64

    set_gemv_configs(None)
    assert get_gemv_configs() == {} and gemv_config(64, 512) == DEFAULT_CONFIG


def test_config_table_numerics_through_linear_triton():
    x, w, b = _data(2, 40, 130, True, torch.float32, seed=9)
    set_gemv_configs({(40, 130): GemvConfig(block_n=16, block_k=64, num_warps=4, split_k=2)})
    _check(linear_triton(x, w, b), x, w, b)


@pytest.mark.parametrize("table", [
    {(4096, 4096): {"block_n": 3}},                      # not a power of two
    {(4096, 4096): {"block_k": 100}},
    {(4096, 4096): {"block_k": 8}},                      # below 16
    {(4096, 4096): {"num_warps": 3}},
    {(4096, 4096): {"num_stages": 0}},
    {(4096, 4096): {"split_k": 0}},
    {(4096, 4096): {"split_k": 2.0}},
    {(4096, 4096): {"block_n": True}},
    {(4096, 4096): {"bogus": 1}},                        # unknown field
    {(4096, 4096): "8x1024"},                            # not a config
    {(4096, 4096): (8, 1024, 8)},
    {"4096-4096": DEFAULT_CONFIG},                       # bad keys
    {"0x4096": DEFAULT_CONFIG},
    {(4096,): DEFAULT_CONFIG},
    {(4096.0, 4096): DEFAULT_CONFIG},
    {(-1, 4096): DEFAULT_CONFIG},
    [((4096, 4096), DEFAULT_CONFIG)],                    # not a mapping
])
def test_invalid_table_entries_raise(table):
    before = get_gemv_configs()
    good = {(8, 8): GemvConfig(4, 16, 4)}
    with pytest.raises(ValueError):
        set_gemv_configs({**good, **table} if isinstance(table, dict) else table)
    assert get_gemv_configs() == before  # nothing installed from a rejected table


def test_shipped_h200_table_is_valid():
    """The H200's shipped GEMV tables (kernels/configs/) install and plan a grid covering every row."""
    from metainfer.kernels.tuned_configs import load_tuned_configs

    for section in ("gemv", "gemv_no_pdl"):
        table = load_tuned_configs("NVIDIA H200")[section]
        assert table and set_gemv_configs(table) is not None
        for (n, k), cfg in get_gemv_configs().items():
            assert gemv_config(n, k) == cfg and gemv_plan(1, n, k, cfg).grid[0] * cfg.block_n >= n


def test_linear_dispatch_by_rows():
    x, w = torch.randn(6, 16), torch.randn(8, 16)
    torch.testing.assert_close(linear_triton(x, w), linear_ref(x, w))  # cuBLAS/ATen path for M > 4
    torch.testing.assert_close(linear_triton(x[:0], w), linear_ref(x[:0], w))  # M = 0 too
    with pytest.raises(ValueError, match="gemv_triton needs"):
        gemv_triton(x, w)
    for bad in [(torch.randn(1, 16), torch.randn(8, 12), None),        # K mismatch
                (torch.randn(16, 2).t()[:1], torch.randn(8, 16), None),  # x last stride != 1
                (torch.randn(1, 16), torch.randn(16, 8).t(), None),     # weight last stride != 1
                (torch.randn(1, 16), torch.randn(8, 16), torch.randn(7)),
                (torch.randn(16), torch.randn(8, 16), None)]:
        with pytest.raises(ValueError, match="gemv_triton needs"):
            gemv_triton(*bad)


def test_sweep_plumbing_on_cpu(monkeypatch):
    """The sweep's bookkeeping (verify, best pick, table, decode set, M > 1 check, report) with the
    GPU timing stubbed out: every captured call still runs once through the interpreter."""
    ticks = iter(range(1, 10_000))

    def fake_time_graph(calls, replays):
        for call in calls:
            call()
        return float(next(ticks))  # later measurements look slower: the first config wins

    monkeypatch.setattr(bench, "time_graph", fake_time_graph)
    monkeypatch.setattr(bench, "_env", lambda device: {"gpu": "cpu", "torch": torch.__version__, "triton": "-"})
    monkeypatch.setattr(bench, "_copy_gbps", lambda device, replays: 1000.0)
    configs = (GemvConfig(4, 32, 4), GemvConfig(8, 64, 4, split_k=2))
    shapes = {"a": (20, 64), "b": (12, 96)}
    res = bench.sweep(device="cpu", shapes=shapes, configs=configs, counts={"a": 2, "b": 1}, calls=3, replays=1,
                      decode_replays=1)
    json.dumps(res)
    for name, (n, k) in shapes.items():
        s = res["shapes"][name]
        assert s["bytes"] == n * k * 2 + k * 2 + n * 2 and s["weight_copies"] >= 3
        assert all(r["ok"] and r["rel_err"] < bench.REL_TOL for r in s["configs"]), s["configs"]
        assert s["best"]["config"] == configs[0].to_dict()
        assert res["table"][f"{n}x{k}"] == configs[0].to_dict()
    ds = res["decode_set"]
    assert ds["launches"] == 3 and ds["bytes"] == 2 * res["shapes"]["a"]["bytes"] + res["shapes"]["b"]["bytes"]
    assert {"cublas_ms", "triton_best_ms", "triton_default_ms", "floor_ms", "ratio_cublas_over_triton_best"} <= set(ds)
    assert [r["m"] for r in res["multi_row"]] == [1, 2, 3, 4] and all(r["ok"] for r in res["multi_row"])
    assert get_gemv_configs() == {}  # the sweep does not leave its table installed
    set_gemv_configs(res["table"])
    assert gemv_config(20, 64) == configs[0]
    report = bench.format_report(res)
    assert "decode set (3 GEMVs" in report and "table:" in report


def test_tuned_linear_binds_its_table_and_rows():
    from metainfer.kernels import gemv

    previous = gemv.get_gemv_configs()
    assert gemv.tuned_linear(None) is gemv.linear_ref and gemv.tuned_linear({}) is gemv.linear_ref
    # a given table keeps its launches; without PDL its preload is dropped
    given = {"24x64": {"block_n": 8, "block_k": 32, "num_warps": 4, "preload": True}}
    assert gemv.tuned_linear(given).keywords["table"][(24, 64)].preload is False
    assert gemv.tuned_linear(given, pdl=True).keywords["table"][(24, 64)].preload is True
    assert gemv.get_gemv_configs() == previous  # the table travels with the linear, not process-wide
    g = torch.Generator().manual_seed(5)
    w, w_other = torch.randn(24, 64, generator=g), torch.randn(40, 64, generator=g)
    with_shape = gemv.tuned_linear({"24x64": {"block_n": 8, "block_k": 32, "num_warps": 4}})
    for m in (1, gemv.ENGINE_MAX_ROWS, gemv.ENGINE_MAX_ROWS + 1):  # Triton, Triton, cuBLAS/ATen
        x = torch.randn(m, 64, generator=g)
        torch.testing.assert_close(with_shape(x, w), linear_ref(x, w), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(with_shape(x, w_other), linear_ref(x, w_other), rtol=1e-4, atol=1e-4)


def test_engine_linear_launches_with_its_own_table(monkeypatch):
    """The bound table picks the launch (a shape it lacks goes to cuBLAS); the process-wide table is
    not consulted; pdl reaches the launch."""
    from metainfer.kernels import gemv

    rec = _Recorder()
    monkeypatch.setattr(gemv_mod, "_gemv_kernel", rec)
    set_gemv_configs({(64, 512): GemvConfig(block_n=32, block_k=64, num_warps=2)})  # must be ignored
    linear = gemv.tuned_linear({"64x512": {"block_n": 16, "block_k": 128, "num_warps": 4}})
    x, w = torch.randn(1, 512), torch.randn(64, 512)
    linear(x, w)
    grid, kw = rec.launches[-1]
    assert (grid, kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["USE_PDL"]) == ((4, 1), 16, 128, 4, False)
    launches = len(rec.launches)
    w40 = torch.randn(40, 512)
    torch.testing.assert_close(linear(x, w40), linear_ref(x, w40))  # not in the bound table: cuBLAS/ATen
    assert len(rec.launches) == launches
    gemv.tuned_linear({"64x512": {"block_n": 16, "block_k": 128, "num_warps": 4}}, pdl=True)(x, w)
    assert rec.launches[-1][1]["USE_PDL"] is True and rec.launches[-1][1]["launch_pdl"] is True


def test_select_ops_without_a_no_pdl_table_uses_the_pdl_table_without_preload(monkeypatch):
    import metainfer.kernels as kernels

    table = {"24x64": {"block_n": 8, "block_k": 32, "num_warps": 4, "preload": True}}
    monkeypatch.setattr(kernels, "load_tuned_configs", lambda name: {"gemv": table, "gemv_no_pdl": {}, "skinny": {}})
    chosen = kernels.select_ops("cuda", gpu_name="A GPU with only a PDL table").linear.keywords["table"]
    assert chosen == {(24, 64): GemvConfig(block_n=8, block_k=32, num_warps=4, preload=False)}
