"""Which decode graph buckets are captured (worker/cuda_graphs.py: decode_batch_sizes): a bucket whose GEMMs the GPU's
measured `gemm_rows` table says run slower than a larger bucket's is left out, its rows replaying the larger graph;
the GEMM cost of a bucket is the table's us of each linear layer's weight shape in the decoder (the LM head runs
outside the graph), summed; every bucket stays where a shape is not measured and for the MoE / MLA families."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from metainfer import LLM
from metainfer.worker.cuda_graphs import (
    SLOWER_BUCKET_MARGIN,
    decode_batch_sizes,
    decode_gemm_us,
    graph_batch_sizes,
    linear_shape_counts,
)
from tests.helpers.tiny_models import build_tiny_model

A, B = (96, 64), (64, 32)  # two weight shapes (N, K)


def _table(a_us: dict[int, float], b_us: dict[int, float]) -> dict:
    return {"96x64": {str(r): us for r, us in a_us.items()}, "64x32": {str(r): us for r, us in b_us.items()}}


def _model(moe_layers=(), is_mla=False, counts=None):
    """A stand-in with the spec fields the rule reads and a decoder of linear layers of shapes A (twice) and B."""
    from torch import nn

    from metainfer.layers.linear import ReplicatedLinear

    counts = counts or {A: 2, B: 1}
    decoder = nn.ModuleList(ReplicatedLinear(k, n, bias=False, dtype=torch.float32) for (n, k), c in counts.items()
                            for _ in range(c))
    return SimpleNamespace(spec=SimpleNamespace(moe_layers=moe_layers, is_mla=is_mla), model=decoder)


def test_gemm_cost_sums_each_shapes_us_times_its_count():
    table = _table({32: 10.0, 48: 12.0}, {32: 5.0, 48: 6.0, 64: 7.0})
    assert decode_gemm_us(Counter({A: 2, B: 1}), table) == {32: 25.0, 48: 30.0}  # 64: A not measured there
    assert decode_gemm_us(Counter({A: 2, (8, 8): 1}), table) == {}  # a shape the table lacks: no costs


def test_a_bucket_a_larger_one_beats_is_left_out():
    # bucket 48 costs 2 x 20 + 10 = 50 us, bucket 64 costs 2 x 15 + 10 = 40: 48's rows replay 64's graph
    table = _table({32: 10.0, 48: 20.0, 64: 15.0, 80: 16.0}, {32: 5.0, 48: 10.0, 64: 10.0, 80: 10.0})
    sizes = decode_batch_sizes(80, _model(), table)
    assert sizes == [1, 2, 4, 8, 16, 32, 64, 80]
    assert set(graph_batch_sizes(80)) - set(sizes) == {48}


def test_a_larger_bucket_within_the_margin_does_not_replace_a_smaller_one():
    cost_48 = 100.0
    within = cost_48 * (1 - SLOWER_BUCKET_MARGIN / 2)  # faster, but by less than the margin
    table = _table({48: cost_48 / 2, 64: within / 2}, {48: 0.0, 64: 0.0})
    assert 48 in decode_batch_sizes(64, _model(), table)
    beyond = cost_48 * (1 - 2 * SLOWER_BUCKET_MARGIN)
    assert 48 not in decode_batch_sizes(64, _model(), _table({48: cost_48 / 2, 64: beyond / 2}, {48: 0.0, 64: 0.0}))


def test_the_largest_bucket_and_unmeasured_ones_always_stay():
    table = _table({32: 1.0, 48: 50.0}, {32: 1.0, 48: 50.0})  # 48 (the largest) is slow: it stays, and so does 64
    assert decode_batch_sizes(48, _model(), table) == graph_batch_sizes(48)
    assert decode_batch_sizes(64, _model(), table) == graph_batch_sizes(64)


@pytest.mark.parametrize("spec", [{"moe_layers": (1,)}, {"is_mla": True}], ids=["moe", "mla"])
def test_moe_and_mla_keep_every_bucket(spec):
    table = _table({48: 20.0, 64: 1.0}, {48: 20.0, 64: 1.0})
    assert decode_batch_sizes(64, _model(**spec), table) == graph_batch_sizes(64)
    assert decode_batch_sizes(64, _model(), {}) == graph_batch_sizes(64)


def test_the_shapes_counted_are_the_decoders_linear_layers(tmp_path):
    """A tiny Qwen3 (2 layers): qkv, o_proj, gate_up and down once a layer; the LM head (outside the graph) not."""
    build_tiny_model(str(tmp_path), "qwen3")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    model, spec = llm.llm_engine.runner.model, llm.llm_engine.spec
    h, d, inter, layers = spec.hidden_size, spec.head_dim, spec.intermediate_size, spec.num_layers
    assert linear_shape_counts(model.model) == Counter({
        ((spec.num_heads + 2 * spec.num_kv_heads) * d, h): layers, (h, spec.num_heads * d): layers,
        (2 * inter, h): layers, (h, inter): layers})
