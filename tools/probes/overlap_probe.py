"""Throwaway probe: does a decode step's batch split in two halves on two streams (one half's attention beside the
other's GEMMs) beat the whole batch on one stream? Qwen3-8B layer shapes, the engine's kernels (cuBLAS GEMMs, the
Triton decode attention, add+RMSNorm, SiLU-and-mul), NL layers cycling over 4 distinct weight/cache sets, CUDA
graphs. Prints ms a step for: one stream (M rows), two streams (M/2 rows each), and one stream running the two halves
one after the other (the split's cost without overlap)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from metainfer.kernels import FP8_KV_DTYPE, paged_decode_attention_triton  # noqa: E402
from metainfer.kernels.activation import silu_and_mul_triton  # noqa: E402
from metainfer.kernels.kv_cache import fp8_cache_copy, to_cache_dtype  # noqa: E402
from metainfer.kernels.rms_norm import fused_add_rms_norm_triton  # noqa: E402

H, HQ, HK, D, I, BS = 4096, 32, 8, 128, 12288, 16
NSETS, NL = 4, 36
dev, bf16 = torch.device("cuda"), torch.bfloat16


class LayerSet:
    def __init__(self, rows, ctx, cache):
        s = 0.02
        self.wqkv = torch.randn(H + 2 * HK * D, H, device=dev, dtype=bf16) * s
        self.wo = torch.randn(H, H, device=dev, dtype=bf16) * s
        self.wgu = torch.randn(2 * I, H, device=dev, dtype=bf16) * s
        self.wd = torch.randn(H, I, device=dev, dtype=bf16) * s
        self.norm = torch.ones(H, device=dev, dtype=bf16)
        blocks = -(-ctx // BS)
        kv = torch.randn(2, rows * blocks, BS, HK, D, device=dev, dtype=bf16)
        if cache == "fp8":
            self.k, self.v = fp8_cache_copy(*to_cache_dtype(kv, FP8_KV_DTYPE))
        else:
            self.k, self.v = kv[0].clone(), kv[1].clone()
        del kv
        self.tables = torch.arange(rows * blocks, device=dev, dtype=torch.int32).view(rows, blocks)
        self.lens = torch.full((rows,), ctx, device=dev, dtype=torch.int32)


class Half:
    """Activations of `rows` rows starting at `r0` (views of the sets' tables), its own buffers."""

    def __init__(self, r0, rows):
        self.r0, self.rows = r0, rows
        self.x = torch.randn(rows, H, device=dev, dtype=bf16)
        self.res = torch.randn(rows, H, device=dev, dtype=bf16)
        self.q = torch.randn(rows, HQ, D, device=dev, dtype=bf16)
        self.attn = torch.empty(rows, HQ, D, device=dev, dtype=bf16)
        self.counters = torch.zeros(rows * HK * 4, device=dev, dtype=torch.int32)


def layer(h: Half, ls: LayerSet):
    x, _ = fused_add_rms_norm_triton(h.x, h.res, ls.norm, 1e-6)
    qkv = torch.mm(x, ls.wqkv.t())
    h.q.copy_(qkv[:, :H].view(-1, HQ, D))
    r = slice(h.r0, h.r0 + h.rows)
    paged_decode_attention_triton(h.q, ls.k, ls.v, ls.tables[r], ls.lens[r], D ** -0.5, out=h.attn,
                                  counters=h.counters)
    o = torch.mm(h.attn.view(h.rows, H), ls.wo.t())
    x2, _ = fused_add_rms_norm_triton(o, h.res, ls.norm, 1e-6)
    a = silu_and_mul_triton(torch.mm(x2, ls.wgu.t()))
    h.x.copy_(torch.mm(a, ls.wd.t()))


def chain(h, sets):
    for i in range(NL):
        layer(h, sets[i % NSETS])


def capture(fn):
    side = torch.cuda.Stream()
    cur = torch.cuda.current_stream()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        fn()
    cur.wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def two_streams(h1, h2, sets):
    def run():
        cur = torch.cuda.current_stream()
        other = _OTHER
        other.wait_stream(cur)
        with torch.cuda.stream(other):
            chain(h2, sets)
        chain(h1, sets)
        cur.wait_stream(other)
    return run


def interleaved(h1, h2, sets):
    """Two streams, the halves' layers issued alternately (so neither stream runs ahead by many layers)."""
    def run():
        cur = torch.cuda.current_stream()
        other = _OTHER
        other.wait_stream(cur)
        for i in range(NL):
            layer(h1, sets[i % NSETS])
            with torch.cuda.stream(other):
                layer(h2, sets[i % NSETS])
        cur.wait_stream(other)
    return run


def time_g(g, reps=5):
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b))
    return best


_OTHER = None


def main():
    global _OTHER
    _OTHER = torch.cuda.Stream()
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "cases": {}}
    cases = [(256, 600, "bf16"), (256, 600, "fp8"), (512, 1500, "bf16"), (512, 1500, "fp8")]
    for rows, ctx, cache in cases:
        sets = [LayerSet(rows, ctx, cache) for _ in range(NSETS)]
        whole = Half(0, rows)
        a, b = Half(0, rows // 2), Half(rows // 2, rows // 2)
        graphs = {"one_stream": capture(lambda: chain(whole, sets)),
                  "halves_serial": capture(lambda: (chain(a, sets), chain(b, sets))),
                  "halves_two_streams": capture(two_streams(a, b, sets)),
                  "halves_interleaved": capture(interleaved(a, b, sets))}
        row = {k: round(time_g(g), 3) for k, g in graphs.items()}
        row["gain_two_streams"] = round(row["one_stream"] / row["halves_two_streams"] - 1, 4)
        row["gain_interleaved"] = round(row["one_stream"] / row["halves_interleaved"] - 1, 4)
        key = f"{cache}/m{rows}/ctx{ctx}"
        res["cases"][key] = row
        print(key, row, flush=True)
        del sets, graphs
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "overlap_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
