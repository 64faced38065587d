"""The fused-MoE tuner and benchmark (tools/tune_moe.py, tools/bench_moe.py): their pure helpers on the CPU
(config space, routing, winner table in the `moe` section's format and its writer, byte floor, the
torch._grouped_mm competitor against the reference). The sweeps themselves need CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from metainfer.kernels.fused_moe import MoeConfig, default_moe_config, parse_moe_table
from metainfer.kernels.moe_ref import fused_moe_ref
from tools.bench_moe import floor_bytes, grouped_mm_moe, sort_by_expert, summarize
from tools.tune_moe import BUCKETS, SHAPES, about_with_moe, make_routing, pick_winners, sweep_configs, write_moe_section


def test_shapes_and_buckets():
    # as the engine runs them: DeepSeek-V2-Lite's 64 routed + 2 shared experts stacked, 6 + 2 a token
    assert SHAPES["deepseek-v2-lite"] == (66, 1408, 2048, 8, 2) and SHAPES["qwen3-30b-a3b"] == (128, 768, 2048, 8, 0)
    assert SHAPES["deepseek-v2-lite/tp2"][1] == 704 and SHAPES["qwen3-30b-a3b/tp2"][1] == 384
    assert BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 8192)


def test_sweep_space_is_small_valid_and_starts_with_the_default():
    distinct = set()
    for bucket in BUCKETS:
        configs = sweep_configs(bucket)
        assert 8 <= len(configs) <= 20 and len(set(configs)) == len(configs)
        assert configs[0] == default_moe_config(bucket)
        assert all(isinstance(c, MoeConfig) for c in configs)
        if bucket <= 16:
            assert {c.block_m for c in configs} == {16}
        distinct.update(configs)
    assert len(distinct) <= 40  # every distinct config is two GEMM compiles on the GPU


def test_make_routing_is_a_renormalised_top_k():
    weights, ids = make_routing(50, 64, 6, torch.Generator().manual_seed(0))
    assert ids.shape == weights.shape == (50, 6) and ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert int(ids.min()) >= 0 and int(ids.max()) < 64
    assert all(len(set(row)) == 6 for row in ids.tolist())
    torch.testing.assert_close(weights.sum(1), torch.ones(50))
    assert len(set(ids.flatten().tolist())) > 32  # the load spreads over most experts
    # DeepSeek's stacked shared experts: the last `shared` ids on every token, weight 1, after 4 routed ones
    weights, ids = make_routing(9, 66, 6, torch.Generator().manual_seed(1), shared=2)
    assert ids.shape == (9, 6) and bool((ids[:, 4:] == torch.tensor([64, 65])).all())
    assert int(ids[:, :4].max()) < 64 and bool((weights[:, 4:] == 1).all())


def test_pick_winners_gives_the_moe_section_format():
    fast, slow = MoeConfig(16, 32, 128, 1, 4, 4).to_dict(), MoeConfig().to_dict()
    results = {"a": {"E": 64, "N": 1408, "H": 2048, "buckets": {
        "1": {"configs": [{"config": slow, "ok": True, "us": 30.0}, {"config": fast, "ok": True, "us": 20.0},
                          {"config": slow, "ok": False, "rel_err": 1.0, "us": 1.0}]},
        "8": {"configs": [{"config": slow, "ok": False, "error": "skipped: time budget spent"}]}}}}
    table = pick_winners(results)
    assert table == {"E64_N1408_H2048": {"1": fast}}
    assert parse_moe_table(table) == {(64, 1408, 2048): {1: MoeConfig.from_any(fast)}}


def test_pick_winners_keeps_the_default_unless_a_candidate_wins_clearly():
    default, other = MoeConfig().to_dict(), MoeConfig(16, 32, 128, 1, 4, 4).to_dict()
    def rows(default_us, other_us):
        first = {"config": default, "ok": True, "us": default_us} if default_us else {"config": default, "ok": False}
        return {"configs": [first, {"config": other, "ok": True, "us": other_us}]}

    # run 80's figures: 0.6% at one token is noise, 18% at 4,096 is not; a failed default leaves the winner
    results = {"a": {"E": 66, "N": 1408, "H": 2048, "buckets": {
        "1": rows(57.47, 57.12), "4096": rows(1757.6, 1434.9), "8": rows(None, 9.0)}}}
    assert pick_winners(results)["E66_N1408_H2048"] == {"1": default, "4096": other, "8": other}
    assert pick_winners(results, min_gain=0.0)["E66_N1408_H2048"]["1"] == other


def test_write_moe_section_merges_and_notes_it(tmp_path):
    path = str(tmp_path / "Some_GPU.json")
    with open(path, "w") as f:
        json.dump({"device": "Some GPU", "about": "Tables.", "gemv": {"64x32": {"block_n": 4}}}, f)
    entry = {"E8_N32_H64": {"1": MoeConfig().to_dict()}}
    write_moe_section("Some GPU", entry, path)
    write_moe_section("Some GPU", {"E4_N16_H32": {"4096": MoeConfig(64).to_dict()}}, path)
    write_moe_section("Some GPU", {"E8_N32_H64": {"64": MoeConfig(32).to_dict()}}, path)  # one bucket more
    retuned = MoeConfig(16, 32, 128, 1, 4, 4).to_dict()
    write_moe_section("Some GPU", {"E8_N32_H64": {"1": retuned}}, path)  # a bucket swept again replaces its entry
    with open(path) as f:
        doc = json.load(f)
    assert doc["gemv"] == {"64x32": {"block_n": 4}} and set(doc["moe"]) == {"E8_N32_H64", "E4_N16_H32"}
    assert doc["moe"]["E8_N32_H64"] == {"1": retuned, "64": MoeConfig(32).to_dict()}
    assert doc["about"].count("moe:") == 1 and doc["about"].startswith("Tables.")
    assert about_with_moe(doc["about"]) == doc["about"]
    parse_moe_table(doc["moe"])


def test_floor_bytes_counts_distinct_valid_experts():
    ids = torch.tensor([[1, 2], [2, 1], [7, -1]])
    assert floor_bytes(ids, 4, 16, 32) == 2 * 3 * 16 * 32 * 2 + 2 * 3 * 32 * 2
    assert summarize({"us": 1.0}, 4000, 8000.0) == {"us": 1.0, "gbps": 4.0, "pct_of_copy": 0.1}
    assert summarize({"error": "x"}, 4000, None) == {"error": "x"}


def test_sort_by_expert_offsets_and_order():
    ids = torch.tensor([[3, 0], [0, 2], [3, 2]], dtype=torch.int32)
    order, tokens, offs = sort_by_expert(ids, 5)
    assert order.tolist() == [1, 2, 3, 5, 0, 4] and tokens.tolist() == [0, 1, 1, 2, 0, 2]
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 2, 4, 6, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_competitor_matches_ref(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 32, generator=g).to(dtype)
    w13, w2 = torch.randn(6, 64, 32, generator=g).to(dtype), torch.randn(6, 32, 32, generator=g).to(dtype)
    weights, ids = make_routing(7, 6, 2, g)
    try:
        y = grouped_mm_moe(x, w13, w2, weights, ids)
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._grouped_mm does not run here: {exc}")
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)


def test_tools_import_without_cuda():
    assert not torch.cuda.is_initialized()


def test_warm_compile_runs_configs_and_reports_failures(monkeypatch):
    import tools.tune_moe as tune

    configs = [MoeConfig(16, 64, 64, 1, 4, 1), MoeConfig(16, 128, 128, 2, 4, 2)]
    assert tune.warm_compile(configs, (2,), "cpu", torch.float32) == {}
    calls = []

    def failing(*args, config, **kwargs):
        calls.append(config)
        raise RuntimeError("out of resources")

    monkeypatch.setattr(tune, "fused_moe_triton", failing)
    failed = tune.warm_compile(configs, (2,), "cpu", torch.float32)
    assert calls == configs and set(failed) == set(configs) and "out of resources" in failed[configs[0]]


def test_sweep_and_main_end_to_end_in_the_interpreter(monkeypatch, tmp_path):
    """The tuner's plumbing on a tiny shape (CUDA-graph timing replaced by one call of each launch and a
    fake clock per config): rows, winners, the JSON and --write-config into a scratch configs folder."""
    import metainfer.kernels.tuned_configs as tc
    import tools.tune_moe as tune

    configs = (MoeConfig(16, 32, 64, 1, 4, 1), MoeConfig(16, 64, 32, 2, 4, 2))
    fake_us = {configs[0]: 2.0, configs[1]: 1.0}

    def fake_time_graph(calls, replays):
        for call in calls:
            call()
        return fake_us[calls[0].__defaults__[1]] * len(calls) / 1e3  # ms for the graph; defaults (r, cfg, ...)

    monkeypatch.setattr(tune, "sweep_configs", lambda bucket: configs)
    monkeypatch.setattr(tune, "time_graph", fake_time_graph)
    monkeypatch.setattr(tune, "_env", lambda device: {"gpu": "Test GPU 1"})
    monkeypatch.setattr(tune, "SHAPES", {"tiny": (8, 32, 64, 2, 0)})
    monkeypatch.setattr(tc, "CONFIG_DIR", str(tmp_path))
    res = tune.sweep({"tiny": (8, 32, 64, 3, 1)}, buckets=(1, 4), device="cpu", dtype=torch.float32, calls=2)
    rows = res["shapes"]["tiny"]["buckets"]["4"]["configs"]
    assert all(r["ok"] and r["rel_err"] < 1e-5 for r in rows) and [r["us"] for r in rows] == [2.0, 1.0]
    assert res["table"] == {"E8_N32_H64": {"1": configs[1].to_dict(), "4": configs[1].to_dict()}}

    monkeypatch.setattr(tune, "sweep", lambda shapes, buckets, budget: res)
    out = tmp_path / "sweep.json"
    assert tune.main(["--json", str(out), "--write-config", "--budget-s", "5"]) == 0
    assert json.loads(out.read_text())["table"] == res["table"]
    assert tc.load_tuned_configs("Test GPU 1")["moe"] == res["table"]


def test_bench_shape_end_to_end_in_the_interpreter(monkeypatch):
    """bench_moe's rows on a tiny shape (timing replaced by one call of each launch): every backend
    checked against the reference, GB/s and % of copy bandwidth at the byte floor."""
    import tools.bench_moe as bench
    import tools.tune_gemv as tune_gemv

    def fake_time_graph(calls, replays):
        for call in calls:
            call()
        return 0.01 * len(calls)

    monkeypatch.setattr(tune_gemv, "time_graph", fake_time_graph)
    monkeypatch.setattr(bench, "time_eager", lambda fn, iters=10, warmup=2: (fn(), 100.0)[1])
    res = bench.bench_shape(8, 32, 64, 2, tokens=(1, 5), table={(8, 32, 64): {4: MoeConfig(16, 32, 64, 1, 4, 1)}},
                            device="cpu", dtype=torch.float32, calls=2, copy_gbps=1000.0)
    for t in ("1", "5"):
        row = res["tokens"][t]
        assert row["triton"]["rel_err"] < 1e-5 and row["triton"]["us"] == 10.0 and "gbps" in row["triton"]
        assert row["floor_bytes"] > 0 and row["floor_us"] > 0 and row["ref"]["us"] == 100.0
        assert "us" in row["grouped_mm"] or "error" in row["grouped_mm"]


def test_bench_shape_times_eagerly_where_capture_fails(monkeypatch):
    import tools.bench_moe as bench
    import tools.tune_gemv as tune_gemv

    def refusing_time_graph(calls, replays):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(tune_gemv, "time_graph", refusing_time_graph)
    monkeypatch.setattr(bench, "time_eager", lambda fn, iters=10, warmup=2: (fn(), 40.0)[1])
    res = bench.bench_shape(8, 32, 64, 2, tokens=(3,), device="cpu", dtype=torch.float32, calls=2)
    row = res["tokens"]["3"]["triton"]
    assert row["timing"] == "eager" and row["us"] == 20.0 and "capturing" in row["graph_error"]
