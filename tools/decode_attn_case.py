"""One decode attention case for a profiler: the engine's kernel over a bf16 or fp8 paged cache (the engine's
layouts: fp8 K block-major, V token-major) at Qwen3-8B's heads, launched `--iters` times after one warm-up call
(the JIT compile), so `ncu --kernel-name regex:_decode_split_kernel --launch-skip 1 --launch-count 1` profiles
a warm launch. Prints us a launch from CUDA events and the KV read rate beside it.

    python -m tools.decode_attn_case --cache fp8 --batch 256 --ctx 600 [--block-n 128] [--num-warps 4]
"""

from __future__ import annotations

import argparse

import torch

HQ, HK, D, BLOCK = 32, 8, 128, 16  # Qwen3-8B heads, the engine's block size


def main(argv=None) -> None:
    from metainfer.kernels import FP8_KV_DTYPE, paged_decode_attention_triton
    from metainfer.kernels.kv_cache import fp8_cache_copy, to_cache_dtype

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ctx", type=int, default=600)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--block-n", type=int, default=None)
    p.add_argument("--num-warps", type=int, default=None)
    p.add_argument("--num-stages", type=int, default=None)
    p.add_argument("--num-splits", type=int, default=None)
    p.add_argument("--maxnreg", type=int, default=None)
    a = p.parse_args(argv)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    blocks = -(-a.ctx // BLOCK)
    kv = torch.randn(2, a.batch * blocks, BLOCK, HK, D, device=dev, dtype=bf16)
    if a.cache == "fp8":
        k, v = fp8_cache_copy(*to_cache_dtype(kv, FP8_KV_DTYPE))
    else:
        k, v = kv[0], kv[1]
    tables = torch.arange(a.batch * blocks, device=dev, dtype=torch.int32).view(a.batch, blocks)
    lens = torch.full((a.batch,), a.ctx, device=dev, dtype=torch.int32)
    q = torch.randn(a.batch, HQ, D, device=dev, dtype=bf16)
    kw = {name: val for name, val in (("block_n", a.block_n), ("num_warps", a.num_warps),
                                       ("num_stages", a.num_stages), ("num_splits", a.num_splits),
                                       ("maxnreg", a.maxnreg)) if val}
    out = paged_decode_attention_triton(q, k, v, tables, lens, D ** -0.5, **kw)  # compile
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.iters):
        out = paged_decode_attention_triton(q, k, v, tables, lens, D ** -0.5, out=out, **kw)
    end.record()
    torch.cuda.synchronize()
    us = start.elapsed_time(end) * 1e3 / a.iters
    kv_bytes = a.batch * a.ctx * HK * D * 2 * k.element_size()
    print(f"{a.cache} b{a.batch} ctx{a.ctx} {kw}: {us:.1f} us a launch, {kv_bytes / us / 1e3:.0f} GB/s")


if __name__ == "__main__":
    main()
