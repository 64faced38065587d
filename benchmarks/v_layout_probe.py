"""Probe for the next fp8 decode step: does a token-major V cache make fp8 decode attention byte-bound?

Not engine code. The engine's fp8 decode (kernels/attention.py) reads V head-major and widens it in
registers, outside the cp.async pipeline that stages K (2.3-2.4 TB/s against bf16's 4.1, runs
26-31). This probe is a minimal one-pass decode (GQA group padded to 16 rows, contexts a multiple
of the tile, so no token masks: the question is the load path, not the tail) that reads V either
head-major ([N, S, Hk, D], d fastest) or token-major (each (block, head) a [D, S] tile, tokens
fastest), where P @ V's operand is read along the tokens it reduces over, as q @ K^T reads K along
d. It reports us a launch, the KV read rate, the error against the torch reference and the sm_90
PTX's load instructions per variant. Usage (GPU): python benchmarks/v_layout_probe.py [--out F]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metainfer.kernels._triton import tl, triton  # noqa: E402
from metainfer.kernels.attention import LOG2E, paged_decode_attention_ref, paged_decode_attention_triton  # noqa: E402
from metainfer.kernels.kv_cache import FP8_KV_DTYPE, to_cache_dtype, token_major_copy  # noqa: E402


@triton.jit
def _probe_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, scale_log2e,
                         kc_b, kc_s, kc_h, vc_b, vc_s, vc_h, vc_d, bt_stride, q_sb, q_sh, o_sb, o_sh,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TOKEN_MAJOR: tl.constexpr):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    ctx = tl.load(lens_ptr + seq)
    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + seq * q_sb + heads[:, None] * q_sh + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    q = q.to(tl.float16)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    bt_row = bt_ptr + seq * bt_stride
    for n0 in range(0, ctx, BLOCK_N):
        tok = tl.multiple_of(n0, BLOCK_N) + tl.arange(0, BLOCK_N)
        page = tl.load(bt_row + tok // BLOCK_SIZE).to(tl.int64)
        in_page = tok % BLOCK_SIZE
        k = tl.load(k_ptr + (page * kc_b + in_page * kc_s + kv_head * kc_h)[:, None] + d[None, :]).to(tl.float16)
        s = tl.dot(q, tl.trans(k)) * scale_log2e
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = page * vc_b + in_page * vc_s + kv_head * vc_h
        if TOKEN_MAJOR:
            v = tl.trans(tl.load(v_ptr + v_rows[None, :] + d[:, None] * vc_d).to(tl.float16))
        else:
            v = tl.load(v_ptr + v_rows[:, None] + d[None, :]).to(tl.float16)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * o_sb + heads[:, None] * o_sh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(g < GROUP)[:, None])


def probe_decode(q, k_cache, v_cache, block_tables, context_lens, scale, block_n=64, num_warps=4, num_stages=2):
    """One launch of the probe kernel; v_cache head-major or token-major (decided from its strides).
    Contexts must be multiples of block_n (no token masks). Returns (out, compiled kernel)."""
    batch, hq, head_dim = q.shape
    _, block_size, hk, _ = k_cache.shape
    if block_tables.shape[1] * block_size % block_n:
        raise ValueError(f"the probe has no token masks: contexts must be multiples of block_n={block_n}")
    group = hq // hk
    out = torch.empty_like(q)
    token_major = v_cache.stride(-1) != 1
    compiled = _probe_decode_kernel[(hk, batch)](
        q, k_cache, v_cache, block_tables, context_lens, out, scale * LOG2E,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        block_tables.stride(0), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_G=max(16, group), HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        TOKEN_MAJOR=token_major, num_warps=num_warps, num_stages=num_stages,
    )
    return out, compiled


def ptx_loads(compiled) -> dict | None:
    """Load instructions in the sm_90 PTX (None for a launch whose compiled kernel is not at hand)."""
    if compiled is None or not hasattr(compiled, "asm"):
        return None
    ptx = compiled.asm.get("ptx", "")
    return {name: ptx.count(name) for name in ("cp.async.cg", "cp.async.ca", "ld.global", "ld.shared.b8",
                                                "ldmatrix", "ld.global.v4", "ld.global.u8")}


def measure(batch: int, ctx: int, cache_dtype: torch.dtype, layers: int = 8) -> dict:
    """Every variant at one (batch, context, cache dtype), Qwen3-8B heads (32 q, 8 kv, D 128, block 16)."""
    from metainfer.kernels.gemv_bench import _time_graph

    dev, hq, hk, d, bs = torch.device("cuda"), 32, 8, 128, 16
    blocks = ctx // bs
    tables = torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
    lens = torch.full((batch,), ctx, device=dev, dtype=torch.int32)
    q = torch.randn(batch, hq, d, device=dev, dtype=torch.bfloat16)
    caches = [to_cache_dtype(torch.randn(2, batch * blocks, bs, hk, d, device=dev, dtype=torch.bfloat16), cache_dtype)
              for _ in range(layers)]
    v_token_major = [token_major_copy(c[1]) for c in caches]
    kv_bytes = batch * ctx * hk * d * 2 * caches[0].element_size()
    ref = paged_decode_attention_ref(q.float(), caches[0][0], caches[0][1], tables, lens, d ** -0.5)

    def engine(i):
        return paged_decode_attention_triton(q, caches[i][0], caches[i][1], tables, lens, d ** -0.5), None

    def probe(i, block_n, token_major_v, num_warps=4, num_stages=2):
        v = v_token_major[i] if token_major_v else caches[i][1]
        return probe_decode(q, caches[i][0], v, tables, lens, d ** -0.5, block_n, num_warps, num_stages)

    variants = {"engine": engine}
    for block_n in (64, 128):
        for layout in ("head_major", "token_major"):
            variants[f"probe_{layout}_n{block_n}"] = functools.partial(probe, block_n=block_n,
                                                                       token_major_v=layout == "token_major")
    # run 32: token-major fp8 staged both K and V by cp.async (0 ld.shared.b8) yet read 3.0 TB/s: more
    # bytes in flight an SM (stages, warps) is the next question
    for block_n, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (128, 8, 2), (128, 8, 3), (256, 8, 2)):
        variants[f"probe_token_major_n{block_n}_w{warps}_s{stages}"] = functools.partial(
            probe, block_n=block_n, token_major_v=True, num_warps=warps, num_stages=stages)
    row = {}
    for name, fn in variants.items():
        try:
            out, compiled = fn(0)
            err = (out.float() - ref).abs().max().item()
            us = _time_graph([functools.partial(fn, i) for i in range(layers)], 10) * 1e3 / layers
            row[name] = {"us": round(us, 2), "GBs": round(kv_bytes / us / 1e3, 1), "max_err": err,
                         "ptx": ptx_loads(compiled)}
        except Exception as exc:  # a variant that fails to compile must not hide the others
            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(f"b{batch} ctx{ctx} {cache_dtype} {name}: {row[name]}", flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "v_layout_probe.json"))
    args = p.parse_args()
    res = {}
    for batch, ctx in ((256, 640), (64, 1024)):
        for name, dtype in (("bf16", torch.bfloat16), ("fp8", FP8_KV_DTYPE)):
            res[f"b{batch}_ctx{ctx}_{name}"] = measure(batch, ctx, dtype)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for case, row in res.items():
        for name, v in row.items():
            bad = " WRONG" if v.get("max_err", 0) > 0.01 else ""
            print(f"| {case} | {name} | {v.get('us', '-')} us | {v.get('GBs', '-')} GB/s | "
                  f"err {v.get('max_err', v.get('error', '-'))}{bad} |")


if __name__ == "__main__":
    main()
