"""Kernel micro-benchmarks on CUDA: time, achieved bandwidth/throughput, and a peer in the same run.

    python -m tools.bench_kernels [--quick]

Shapes are Qwen3-8B's per layer (Hq=32, Hk=8, D=128, H=4096, I=12288), bf16, block size 16.
Peers: torch's fused SDPA on dense contiguous K/V (the same math without paging) and plain torch
elementwise code for the small ops. Bandwidth figures count the bytes each op must move once.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch
import torch.nn.functional as F


def _bench(fn, warmup=5, rep=50):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep)  # ms, CUDA events


def _paged(batch, ctx, hk, head_dim, block_size, dtype, device):
    blocks_per_seq = -(-ctx // block_size)
    num_blocks = batch * blocks_per_seq
    kv = torch.randn(2, num_blocks, block_size, hk, head_dim, dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = perm.view(batch, blocks_per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return kv, tables, lens


def bench_decode(results, quick):
    dev, dtype, hq, hk, d, s = "cuda", torch.bfloat16, 32, 8, 128, 16
    cases = [(1, 4096), (8, 4096), (64, 2048)] if quick else [(1, 1024), (1, 8192), (1, 32768), (8, 4096),
                                                              (32, 4096), (64, 2048), (256, 1024)]
    for batch, ctx in cases:
        results.append(_decode_case(batch, ctx, dev, dtype, hq, hk, d, s))


def _decode_case(batch, ctx, dev, dtype, hq, hk, d, s):
    from metainfer.kernels.attention_decode import (
        alloc_decode_workspace,
        decode_num_splits,
        paged_decode_attention_triton,
    )

    kv, tables, lens = _paged(batch, ctx, hk, d, s, dtype, dev)
    q = torch.randn(batch, hq, d, dtype=dtype, device=dev)
    ws = alloc_decode_workspace(batch, hq, d, device=dev)
    out = torch.empty_like(q)
    fn = lambda: paged_decode_attention_triton(q, kv[0], kv[1], tables, lens, d**-0.5, workspace=ws, out=out)  # noqa: E731
    ms = _bench(fn)
    dense_k = kv[0][tables.long()].reshape(batch, -1, hk, d).transpose(1, 2).contiguous()
    dense_v = kv[1][tables.long()].reshape(batch, -1, hk, d).transpose(1, 2).contiguous()
    qd = q.unsqueeze(2)
    peer = _bench(lambda: F.scaled_dot_product_attention(qd, dense_k, dense_v, scale=d**-0.5, enable_gqa=True))
    ref = F.scaled_dot_product_attention(qd, dense_k, dense_v, scale=d**-0.5, enable_gqa=True).squeeze(2)
    err = (fn().float() - ref.float()).abs().max().item()
    gbytes = 2 * batch * ctx * hk * d * 2 / 1e9
    return dict(op="decode", batch=batch, ctx=ctx, ms=ms, tb_s=gbytes / ms, sdpa_dense_ms=peer,
                splits=decode_num_splits(batch, hk, tables.shape[1] * s), max_abs_err=err)


def bench_prefill(results, quick):
    dev, dtype, hq, hk, d, s = "cuda", torch.bfloat16, 32, 8, 128, 16
    cases = [(1, 2048, 2048), (1, 512, 4096)] if quick else [(1, 2048, 2048), (1, 8192, 8192), (4, 1024, 1024),
                                                             (1, 512, 4096), (16, 128, 128)]
    for batch, q_len, ctx in cases:
        results.append(_prefill_case(batch, q_len, ctx, dev, dtype, hq, hk, d, s))


def _prefill_case(batch, q_len, ctx, dev, dtype, hq, hk, d, s):
    from metainfer.kernels.attention_prefill import paged_prefill_attention_triton

    kv, tables, lens = _paged(batch, ctx, hk, d, s, dtype, dev)
    q = torch.randn(batch * q_len, hq, d, dtype=dtype, device=dev)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * q_len
    fn = lambda: paged_prefill_attention_triton(q, kv[0], kv[1], cu, lens, tables, q_len, d**-0.5)  # noqa: E731
    ms = _bench(fn)
    # causal FLOPs: QK^T and PV over the visible keys of every query
    visible = sum(ctx - q_len + i + 1 for i in range(q_len)) * batch
    tflops = 4 * visible * hq * d / ms / 1e9
    peer = None
    if q_len == ctx:
        qd = q.view(batch, q_len, hq, d).transpose(1, 2)
        kd = kv[0][tables.long()].reshape(batch, -1, hk, d)[:, :ctx].transpose(1, 2).contiguous()
        vd = kv[1][tables.long()].reshape(batch, -1, hk, d)[:, :ctx].transpose(1, 2).contiguous()
        sdpa = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=d**-0.5, enable_gqa=True)  # noqa: E731
        peer = _bench(sdpa)
        err = (fn().float().view(batch, q_len, hq, d).transpose(1, 2) - sdpa().float()).abs().max().item()
    else:
        err = None
    return dict(op="prefill", batch=batch, q_len=q_len, ctx=ctx, ms=ms, tflops=tflops,
                sdpa_dense_ms=peer, max_abs_err=err)


def sweep_prefill(results):
    """Tile/warp/stage sweep of the prefill kernel (for choosing the launcher defaults)."""
    from metainfer.kernels.attention_prefill import paged_prefill_attention_triton

    dev, dtype, hq, hk, d, s = "cuda", torch.bfloat16, 32, 8, 128, 16
    for batch, q_len, ctx in [(1, 4096, 4096), (1, 512, 4096)]:
        kv, tables, lens = _paged(batch, ctx, hk, d, s, dtype, dev)
        q = torch.randn(batch * q_len, hq, d, dtype=dtype, device=dev)
        cu = torch.arange(0, batch + 1, dtype=torch.int32, device=dev) * q_len
        visible = sum(ctx - q_len + i + 1 for i in range(q_len)) * batch
        for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            fn = functools.partial(paged_prefill_attention_triton, q, kv[0], kv[1], cu, lens, tables, q_len, d**-0.5,
                                   block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
            try:
                ms = _bench(fn, rep=20)
            except Exception as exc:  # noqa: BLE001 - out of resources etc.: report and go on
                results.append(dict(op="sweep_prefill", q_len=q_len, cfg=[bm, bn, warps, stages], error=str(exc)[:80]))
                continue
            results.append(dict(op="sweep_prefill", q_len=q_len, ctx=ctx, cfg=[bm, bn, warps, stages], ms=ms,
                                tflops=4 * visible * hq * d / ms / 1e9))


def sweep_decode(results):
    """block_n x max_num_splits sweep of the decode kernel."""
    from metainfer.kernels.attention_decode import paged_decode_attention_triton

    dev, dtype, hq, hk, d, s = "cuda", torch.bfloat16, 32, 8, 128, 16
    for batch, ctx in [(1, 1024), (1, 8192), (8, 4096)]:
        kv, tables, lens = _paged(batch, ctx, hk, d, s, dtype, dev)
        q = torch.randn(batch, hq, d, dtype=dtype, device=dev)
        for bn, splits in itertools.product((32, 64, 128), (8, 16, 32, 64)):
            fn = functools.partial(paged_decode_attention_triton, q, kv[0], kv[1], tables, lens, d**-0.5,
                                   max_num_splits=splits, block_n=bn)
            ms = _bench(fn, rep=20)
            results.append(dict(op="sweep_decode", batch=batch, ctx=ctx, cfg=[bn, splits], ms=ms,
                                tb_s=2 * batch * ctx * hk * d * 2 / 1e9 / ms))


def bench_small_ops(results, quick):
    for tokens in ([1, 4096] if quick else [1, 64, 4096, 16384]):
        results.extend(_small_ops_case(tokens))


def _small_ops_case(tokens):
    from metainfer.kernels.activation import silu_and_mul_triton
    from metainfer.kernels.kv_cache import store_kv_triton
    from metainfer.kernels.rms_norm import fused_add_rms_norm_triton, rms_norm_triton
    from metainfer.kernels.rotary import build_cos_sin_cache, rotary_neox_triton

    dev, dtype, results = "cuda", torch.bfloat16, []
    x = torch.randn(tokens, 4096, dtype=dtype, device=dev)
    w = torch.randn(4096, dtype=dtype, device=dev)
    res = torch.randn_like(x)
    nbytes = x.numel() * 2
    ms = _bench(lambda: rms_norm_triton(x, w, 1e-6))
    peer = _bench(lambda: (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + 1e-6) * w).to(dtype))
    results.append(dict(op="rms_norm", tokens=tokens, ms=ms, tb_s=2 * nbytes / ms / 1e9, torch_ms=peer))
    ms = _bench(lambda: fused_add_rms_norm_triton(x, res, w, 1e-6))
    results.append(dict(op="fused_add_rms_norm", tokens=tokens, ms=ms, tb_s=4 * nbytes / ms / 1e9))
    gu = torch.randn(tokens, 2 * 12288, dtype=dtype, device=dev)
    ms = _bench(lambda: silu_and_mul_triton(gu))
    peer = _bench(lambda: F.silu(gu[:, :12288]) * gu[:, 12288:])
    results.append(dict(op="silu_and_mul", tokens=tokens, ms=ms, tb_s=gu.numel() * 3 / ms / 1e9, torch_ms=peer))
    qkv = torch.randn(tokens, (32 + 16) * 128, dtype=dtype, device=dev)
    q, k, v = qkv.split([4096, 1024, 1024], dim=-1)
    cache = build_cos_sin_cache(128, 40960, 1e6, device=dev)
    pos = torch.randint(0, 40960, (tokens,), device=dev)
    ms = _bench(lambda: rotary_neox_triton(pos, q, k, cache, 128))
    results.append(dict(op="rotary", tokens=tokens, ms=ms, tb_s=2 * 5120 * 2 * tokens / ms / 1e9))
    kv = torch.zeros(2, tokens // 16 + 1, 16, 8, 128, dtype=dtype, device=dev)
    slots = torch.arange(tokens, dtype=torch.int32, device=dev)
    ms = _bench(lambda: store_kv_triton(k.view(tokens, 8, 128), v.view(tokens, 8, 128), kv[0], kv[1], slots))
    results.append(dict(op="store_kv", tokens=tokens, ms=ms, tb_s=2 * 2048 * 2 * tokens / ms / 1e9))
    return results


def check_cuda_graph(results):
    """The decode launcher must be capturable: capture once, change context lens, replay."""
    from metainfer.kernels.attention_decode import alloc_decode_workspace, paged_decode_attention_triton
    from metainfer.kernels.attention_ref import paged_decode_attention_ref

    dev, dtype, hq, hk, d = "cuda", torch.bfloat16, 32, 8, 128
    kv, tables, lens = _paged(4, 1000, hk, d, 16, dtype, dev)
    q = torch.randn(4, hq, d, dtype=dtype, device=dev)
    ws = alloc_decode_workspace(4, hq, d, device=dev)
    out = torch.empty_like(q)
    run = lambda: paged_decode_attention_triton(q, kv[0], kv[1], tables, lens, 0.088, workspace=ws, out=out)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    lens.copy_(torch.tensor([1, 0, 517, 1000], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    expected = paged_decode_attention_ref(q, kv[0], kv[1], tables, lens, 0.088)
    err = (out.float() - expected.float()).abs().max().item()
    results.append(dict(op="decode_cuda_graph_replay", max_abs_err=err, ok=err < 3e-2))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="write results here")
    parser.add_argument("--sweep", action="store_true", help="only sweep decode/prefill tile configs")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench: needs CUDA", file=sys.stderr)
        return 2
    import triton

    results = []
    if args.sweep:
        sweep_decode(results)
        sweep_prefill(results)
    else:
        check_cuda_graph(results)
        bench_decode(results, args.quick)
        bench_prefill(results, args.quick)
        bench_small_ops(results, args.quick)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    for r in results:
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
