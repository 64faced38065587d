"""Parallel linear layers. Per-rank dims from the formulas, each weight_loader slicing
its own shard, and the shards recombining to the unsharded layer.

Most tests build every rank's layer in this process (the rank state is per process and read at
construction) and stand in for the collective by hand; one test runs the real gloo all-reduce.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metainfer.distributed.launch import run_on_ranks
from metainfer.distributed.parallel_state import tp_state
from metainfer.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from tests.helpers.tensors import randn

H = 16


def _ranks(tp, make):
    layers = []
    for rank in range(tp):
        with tp_state(rank, tp):
            layers.append(make())
    return layers


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_column_parallel_concat_equals_full(tp):
    w, b, x = randn(32, H, seed=1), randn(32, seed=2), randn(5, H, seed=3)
    layers = _ranks(tp, lambda: ColumnParallelLinear(H, 32, bias=True))
    for layer in layers:
        assert tuple(layer.weight.shape) == (32 // tp, H) and tuple(layer.bias.shape) == (32 // tp,)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
    torch.testing.assert_close(torch.cat([layer(x) for layer in layers], -1), F.linear(x, w, b))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_merged_gate_up_shards_each_part(tp):
    inter = 24
    gate, up, x = randn(inter, H, seed=4), randn(inter, H, seed=5), randn(3, H, seed=6)
    layers = _ranks(tp, lambda: MergedColumnParallelLinear(H, [inter, inter]))
    part = inter // tp
    for rank, layer in enumerate(layers):
        assert tuple(layer.weight.shape) == (2 * part, H)
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        out = layer(x)  # [gate shard | up shard], the layout silu_and_mul expects
        rows = slice(rank * part, (rank + 1) * part)
        torch.testing.assert_close(out[:, :part], F.linear(x, gate[rows]))
        torch.testing.assert_close(out[:, part:], F.linear(x, up[rows]))


# (heads, kv_heads, tp): plain split, KV replicated (kv < tp), MQA, one head per rank
QKV_CASES = [(4, 2, 2), (4, 2, 4), (8, 1, 4), (4, 4, 4), (8, 2, 1)]


@pytest.mark.parametrize("heads,kv,tp", QKV_CASES)
def test_qkv_shards_and_gqa_mapping(heads, kv, tp):
    d = 4
    wq, wk, wv = randn(heads * d, H, seed=7), randn(kv * d, H, seed=8), randn(kv * d, H, seed=9)
    bq, bk, bv = randn(heads * d, seed=10), randn(kv * d, seed=11), randn(kv * d, seed=12)
    x = randn(3, H, seed=13)
    full_q, full_k, full_v = (F.linear(x, w, b).view(3, -1, d) for w, b in ((wq, bq), (wk, bk), (wv, bv)))
    layers = _ranks(tp, lambda: QKVParallelLinear(H, d, heads, kv, bias=True))
    hq, hk = heads // tp, max(1, kv // tp)
    for rank, layer in enumerate(layers):
        assert (layer.num_heads, layer.num_kv_heads) == (hq, hk)
        assert tuple(layer.weight.shape) == ((hq + 2 * hk) * d, H)
        for param, tensors in ((layer.weight, (wq, wk, wv)), (layer.bias, (bq, bk, bv))):
            for shard_id, t in zip("qkv", tensors):
                param.weight_loader(param, t, shard_id)
        q, k, v = layer(x).split([hq * d, hk * d, hk * d], dim=-1)
        q, k, v = q.view(3, hq, d), k.view(3, hk, d), v.view(3, hk, d)
        torch.testing.assert_close(q, full_q[:, rank * hq:(rank + 1) * hq])
        for local_h in range(hq):  # attention's GQA rule on the rank must pick the right global KV head
            global_h = rank * hq + local_h
            global_kv = global_h // (heads // kv)
            local_kv = local_h // (hq // hk)
            torch.testing.assert_close(k[:, local_kv], full_k[:, global_kv])
            torch.testing.assert_close(v[:, local_kv], full_v[:, global_kv])


def _row_layers(tp, w, b):
    layers = _ranks(tp, lambda: RowParallelLinear(w.shape[1], w.shape[0], bias=True))
    for layer in layers:
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
    return layers


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_reduces_then_adds_bias_once(tp):
    w, b, x = randn(H, 32, seed=14), randn(H, seed=15), randn(5, 32, seed=16)
    layers = _row_layers(tp, w, b)
    cols = 32 // tp
    assert all(tuple(layer.weight.shape) == (H, cols) and tuple(layer.bias.shape) == (H,) for layer in layers)
    partials = []  # what each rank hands to the all-reduce
    for layer in layers:
        layer.reduce = lambda y: partials.append(y.clone()) or y
    for rank, layer in enumerate(layers):
        layer(x[:, rank * cols:(rank + 1) * cols])
    total = torch.stack(partials).sum(0)
    for rank, layer in enumerate(layers):  # now the "all-reduce" returns the real sum
        layer.reduce = lambda y: total.clone()
        torch.testing.assert_close(layer(x[:, rank * cols:(rank + 1) * cols]), F.linear(x, w, b))


def test_loaders_reject_an_already_sliced_tensor():
    """Double slicing: a loader handed a shard (not the full tensor) must refuse it."""
    with tp_state(1, 2):
        col = ColumnParallelLinear(H, 32)
        merged = MergedColumnParallelLinear(H, [24, 24])
        qkv = QKVParallelLinear(H, 4, 4, 2)
        row = RowParallelLinear(32, H)
    with pytest.raises(ValueError, match="rows"):
        col.weight.weight_loader(col.weight, randn(16, H))
    with pytest.raises(ValueError, match="rows"):
        merged.weight.weight_loader(merged.weight, randn(12, H), 0)
    with pytest.raises(ValueError, match="rows"):
        qkv.weight.weight_loader(qkv.weight, randn(8, H), "q")
    with pytest.raises(ValueError, match="rows"):
        qkv.weight.weight_loader(qkv.weight, randn(4, H), "k")
    with pytest.raises(ValueError, match="columns"):
        row.weight.weight_loader(row.weight, randn(H, 16))


def test_indivisible_dims_name_the_field():
    with tp_state(0, 4):
        with pytest.raises(ValueError, match=r"output features \(30\) is not divisible by tensor_parallel_size \(4\)"):
            ColumnParallelLinear(H, 30)
        with pytest.raises(ValueError, match="merged part"):  # 6+6 divides by 4, each part does not
            MergedColumnParallelLinear(H, [6, 6])
        with pytest.raises(ValueError, match=r"num_attention_heads \(6\)"):
            QKVParallelLinear(H, 4, 6, 2)
        with pytest.raises(ValueError, match=r"not a multiple of num_key_value_heads \(3\)"):
            QKVParallelLinear(H, 4, 12, 3)
    with tp_state(0, 2):
        with pytest.raises(ValueError, match=r"num_key_value_heads \(3\)"):
            QKVParallelLinear(H, 4, 6, 3)
        with pytest.raises(ValueError, match=r"input features \(15\)"):
            RowParallelLinear(15, H)


def _mlp_over_gloo(rank: int, world: int) -> torch.Tensor:
    """Column (bias) -> Row (bias) with the real all-reduce; every rank must get the full output."""
    w1, b1, w2, b2 = randn(32, H, seed=20), randn(32, seed=21), randn(H, 32, seed=22), randn(H, seed=23)
    up, down = ColumnParallelLinear(H, 32, bias=True), RowParallelLinear(32, H, bias=True)
    for layer, w, b in ((up, w1, b1), (down, w2, b2)):
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
    return down(torch.relu(up(randn(5, H, seed=24))))


@pytest.mark.tp
def test_column_then_row_with_real_all_reduce():
    x = randn(5, H, seed=24)
    expected = F.linear(torch.relu(F.linear(x, randn(32, H, seed=20), randn(32, seed=21))),
                        randn(H, 32, seed=22), randn(H, seed=23))
    for out in run_on_ranks(_mlp_over_gloo, 2):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
def test_replicated_linear_is_the_full_layer_on_every_rank(tp):
    """MLA's q_a / kv_a projections (with attention_bias) and the MoE router's base: no split and no reduce,
    every rank loads the whole weight and computes the whole output."""
    w, b, x = randn(12, H, seed=30), randn(12, seed=31), randn(4, H, seed=32)
    layers = _ranks(tp, lambda: ReplicatedLinear(H, 12, bias=True, dtype=torch.float32))
    for layer in layers:
        assert tuple(layer.weight.shape) == (12, H) and tuple(layer.bias.shape) == (12,)
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        torch.testing.assert_close(layer(x), F.linear(x, w, b))
