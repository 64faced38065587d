"""tools/kv_read_probe: the fp8 read-rate probe sums exactly the K and V values of each sequence's context, read
through the block table from a head-major K and a token-major V cache (what the timing in the GPU suite's
`attn_read_probe` then stands for). Reference: torch, token by token, in float64."""

import pytest
import torch

from metainfer.kernels.kv_cache import FP8_KV_DTYPE, to_cache_dtype, token_major_copy
from tests.helpers.kernel_devices import DEVICE
from tools.kv_read_probe import block_major_k_copy, kv_read_probe, kv_read_probe_ref


@pytest.mark.parametrize("k_layout", ["head_major", "block_major"])
@pytest.mark.parametrize("widen", [True, False])
@pytest.mark.parametrize("block_size, block_n", [(16, 32), (16, 64), (4, 16)])
def test_probe_sums_each_context_through_the_block_table(widen, block_size, block_n, k_layout):
    torch.manual_seed(0)
    hk, d, lens = 2, 32, [1, 15, 16, 37, 70]
    per_seq = -(-max(lens) // block_size)
    num_blocks = len(lens) * per_seq + 3
    kv = to_cache_dtype(torch.randn(2, num_blocks, block_size, hk, d) * 3, FP8_KV_DTYPE)
    k_cache, v_cache = kv[0].to(DEVICE), token_major_copy(kv[1]).to(DEVICE)
    if k_layout == "block_major":
        k_cache = block_major_k_copy(k_cache)
        assert k_cache.stride()[1:] == (d, block_size * d, 1)
    assert v_cache.stride(-1) != 1  # token-major, as the engine's fp8 V
    tables = torch.randperm(num_blocks)[: len(lens) * per_seq].view(len(lens), per_seq).to(torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    got = kv_read_probe(k_cache, v_cache, tables.to(DEVICE), lens_t.to(DEVICE), widen=widen, block_n=block_n)
    want = kv_read_probe_ref(k_cache, v_cache, tables, lens_t, widen=widen)
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-3)
    # a token past a context's end changes nothing (sequence 0 holds 1 token); one inside it does (sequence 3)
    big = to_cache_dtype(torch.tensor(100.0), FP8_KV_DTYPE).to(DEVICE)
    k_cache[tables[0, 0].item(), 1, 1, 0] = big
    v_cache[tables[0, 0].item(), 1, 1, 0] = big
    assert torch.equal(kv_read_probe(k_cache, v_cache, tables.to(DEVICE), lens_t.to(DEVICE), widen=widen,
                                     block_n=block_n), got)
    k_cache[tables[3, 0].item(), 0, 1, 0] = big
    moved = kv_read_probe(k_cache, v_cache, tables.to(DEVICE), lens_t.to(DEVICE), widen=widen, block_n=block_n)
    assert moved[3, 1] != got[3, 1] and torch.equal(moved[[0, 1, 2, 4]], got[[0, 1, 2, 4]])
