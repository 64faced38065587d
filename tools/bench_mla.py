"""MLA attention at DeepSeek-V2-Lite dims on one GPU: the Triton decode against its memory floor, and the
absorbed Triton prefill against the expanded form (K/V up-projected, the choice DeepSeek's engines make for prefill).

    python -m tools.bench_mla --json mla_h200.json --budget-s 100

Dims: H=16 heads, L=512 (kv_lora_rank), R=64 (rope), Dn=128 (nope), Dv=128, block size 16, bf16 (the decode
cases over an fp8 latent cache with `--cache-dtype fp8`: floors and rates then count 1 byte a value).
* decode, batch {1, 8, 32, 128, 256} x context {512, 2048, 8192}: mla_decode_attention_triton with its
  default split rule and a workspace from mla_decode_workspace_numel, timed as a CUDA graph of back-to-back
  launches (device time, as the engine replays decode; it also shows the launch is capturable); the floor is
  the latent bytes read (B * context * (L+R) * 2) at 4.8 TB/s.
* sweeps (instead of the above), decode at the engine's block-table width (`--table-tokens`, the suite's
  max_model_len 4,096: the engine's split count comes from the width, not the context), each launcher knob
  combination timed: `--split-sweep`, batch {1, 8} over contexts {40, 100, 160, 256, 512}, minimum split
  {16, 32, 64, 128, 256} x tile {16, 32, 64} tokens (a minimum below the tile is the tile): at batch 1 a launch is
  latency: do shorter splits (one tile and the merge each) or one pass over a short context beat today's 64-token
  splits (DeepSeek-V2-Lite's bs1 TPOT grows 60 us from context ~40 to the bench's 32-160, run 66)?
  `--large-batch-sweep`, batch 256 at context 600 (the throughput protocol's step, 50-56% of the latent-read floor
  in run 49): splits {1, 2, 4} x tile {32, 64} x warps {4, 8} x stages {2, 3}.
* prefill steps (`PREFILL_STEPS`: one sequence of 256 ... 8,192 tokens; 16 prompts of 512 packed into one
  8,192-token step; a throughput-protocol-like step of prompts of 100-1,024 tokens with a chunk's continuation
  over a cached prefix), each in both of the engine's forms (attention/mla.py):
  (a) absorbed: q_nope[H,T,128] @ W_UK[H,128,512] (bmm), mla_prefill_attention_triton, o[H,T,512] @
      W_UV[H,512,128] (bmm); reported whole and kernel only;
  (b) expanded: the step's context rows (attention.mla.context_rows), their latents gathered from the paged
      cache, up-projected by kv_b ([S,512] @ [512, H*(128+128)]), then mla_expanded_attention_triton (one
      varlen launch); reported whole and kernel only. Checked against torch SDPA per sequence.
* `--absorb-rows T ...` (instead of the above): the absorbed form's per-head K-up and V-up of a decode step at T
  rows (kernels/mla_absorb.py), us a layer (K-up + V-up) over 27 layers' distinct kv_b weights in one CUDA graph:
  the refs' cuBLAS bmm (the engine above 16 rows), the tensor-core form (`mma_rows`) and the row-loop kernels
  (`max_rows`), the Triton forms under PDL where the GPU has it; three rounds in rotated order, the median. It
  understates the Triton forms' gain in the engine, where a bmm also breaks the PDL chain of the kernel after it.
Timing: CUDA events, warm-up, median of repeats. `--budget-s` bounds the run: cases past it are listed as
skipped. Importing this module makes no CUDA call.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from tools.bench_moe import time_eager

HEADS, LORA, ROPE, NOPE, V_DIM, BLOCK = 16, 512, 64, 128, 128, 16
HBM_BYTES_PER_S = 4.8e12
DECODE_BATCHES = (1, 8, 32, 128, 256)
DECODE_CONTEXTS = (512, 2048, 8192)
# prefill steps: (label, [(new tokens, context), ...])
PREFILL_STEPS = (
    ("1x256", [(256, 256)]), ("1x512", [(512, 512)]), ("1x1024", [(1024, 1024)]), ("1x2048", [(2048, 2048)]),
    ("1x8192", [(8192, 8192)]), ("16x512", [(512, 512)] * 16),
    ("mixed8k", [(q, q) for q in (100, 240, 380, 520, 660, 800, 940, 1024, 150, 450, 750, 1000, 600)]
     + [(501, 901)]),  # 8,126 new tokens, the last a continuation over 400 cached ones
)


def decode_floor_us(batch: int, context: int, elem_bytes: int = 2) -> float:
    """Microseconds to read every sequence's latent once at HBM_BYTES_PER_S."""
    return batch * context * (LORA + ROPE) * elem_bytes / HBM_BYTES_PER_S * 1e6


def absorbed_prefill_flops(q_len: int, heads: int = HEADS, context: int | None = None) -> float:
    """Causal absorbed attention: per (query, visible key, head) a (L+R)-long score and an L-long P@V."""
    return 2.0 * heads * causal_pairs(q_len, context) * (LORA + ROPE + LORA)


def expanded_prefill_flops(q_len: int, heads: int = HEADS, context: int | None = None) -> float:
    """Causal attention with Q/K of Dn+R and V of Dv (the kv_b up-projection not counted)."""
    return 2.0 * heads * causal_pairs(q_len, context) * (NOPE + ROPE + V_DIM)


def causal_pairs(q_len: int, context: int | None = None) -> float:
    """(query, visible key) pairs of q_len new tokens at the end of a context (default: no cached prefix)."""
    prefix = (context or q_len) - q_len
    return q_len * prefix + q_len * (q_len + 1) / 2


def faster_form(absorbed_us: float | None, expanded_us: float | None) -> str | None:
    """"absorbed" / "expanded" (whichever is faster; None when one is missing)."""
    if absorbed_us is None or expanded_us is None:
        return None
    return "absorbed" if absorbed_us <= expanded_us else "expanded"


def _graph_us(fn, inner: int, repeats: int) -> float:
    """Per-call device time of `inner` calls captured in one CUDA graph (fn warmed up eagerly first)."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    us = time_eager(graph.replay, iters=repeats, warmup=2) / inner
    del graph
    return us


def _paged_cache(num_tokens: int, device, dtype=torch.bfloat16, seed: int = 0,
                 fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache [N, 16, L+R] of random latents, in fp8 (e4m3, as the engine stores them) when asked, a random
    permutation of its blocks)."""
    from metainfer.kernels import FP8_KV_DTYPE
    from metainfer.kernels.kv_cache import to_cache_dtype

    num_blocks = -(-num_tokens // BLOCK)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = torch.randn(num_blocks, BLOCK, LORA + ROPE, device=device, dtype=dtype, generator=gen)
    order = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    return (to_cache_dtype(cache, FP8_KV_DTYPE) if fp8 else cache), order


def _decode_case(cache, order, batch: int, context: int, inner: int, repeats: int, table_tokens: int | None = None,
                 **knobs) -> dict:
    """One decode launch timed; `table_tokens` the block table's width in tokens (default: the context);
    `knobs` the launcher's tuning arguments (min_split_tokens, short_split_tokens, block_n, num_splits,
    num_warps, num_stages; None or absent: its own default)."""
    from metainfer.kernels.mla_attention import (
        _MLA_DECODE_BLOCK_N,
        _MLA_MIN_SPLIT_TOKENS,
        _MLA_SHORT_SPLIT_TOKENS,
        mla_decode_attention_triton,
        mla_decode_num_splits,
        mla_decode_workspace_numel,
    )

    knobs = {k: v for k, v in knobs.items() if v is not None}
    table_tokens = max(table_tokens or context, context)
    dev, scale, width = cache.device, (NOPE + ROPE) ** -0.5, -(-table_tokens // BLOCK)
    tables = order[: batch * width].view(batch, width)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q_lat = torch.randn(HEADS, batch, LORA, device=dev, dtype=torch.bfloat16).transpose(0, 1)  # a bmm's transpose
    q_pe = torch.randn(batch, HEADS, NOPE + ROPE, device=dev, dtype=torch.bfloat16)[..., NOPE:]
    block_n = knobs.get("block_n", _MLA_DECODE_BLOCK_N)
    splits = knobs.get("num_splits") or mla_decode_num_splits(batch, HEADS, width * BLOCK, block_n)
    numel = max(mla_decode_workspace_numel(batch, HEADS, LORA, width * BLOCK), batch * HEADS * splits * (LORA + 1))
    workspace = torch.empty(numel, dtype=torch.float32, device=dev)
    out = torch.empty(batch, HEADS, LORA, dtype=torch.bfloat16, device=dev)

    def run():
        mla_decode_attention_triton(q_lat, q_pe, cache, tables, lens, scale, workspace=workspace, out=out, **knobs)

    try:
        us, timing = _graph_us(run, inner, repeats), "cuda_graph"
    except RuntimeError as exc:  # capture refused: report the eager time and why
        torch.cuda.synchronize()
        us, timing = time_eager(run, iters=repeats, warmup=3), f"eager ({exc!s:.80})"
    floor = decode_floor_us(batch, context, cache.element_size())
    min_split = knobs.get("min_split_tokens", _MLA_MIN_SPLIT_TOKENS)
    short_split = knobs.get("short_split_tokens", _MLA_SHORT_SPLIT_TOKENS)
    return {"splits": splits, "live_splits": live_splits(context, splits, min_split, block_n, short_split),
            "us": round(us, 3), "timing": timing,
            "floor_fraction": round(floor / us, 3),
            "tb_per_s": round(batch * context * (LORA + ROPE) * cache.element_size() / us / 1e6, 3)}


def live_splits(context: int, splits: int, min_split_tokens: int, block_n: int, short_split_tokens: int) -> int:
    """Splits that hold tokens: the launcher's rounding of the two minimums, then the kernel's chunk rule."""
    from metainfer.kernels.mla_attention import mla_split_chunk

    def round_up(tokens: int) -> int:
        return -(-tokens // block_n) * block_n

    chunk = mla_split_chunk(context, splits, round_up(min_split_tokens),
                            round_up(min(short_split_tokens, min_split_tokens)), block_n)
    return -(-context // chunk)


# --split-sweep: batch 1 and 8 over short contexts, the minimum split lengths, the tile and the warps (a short
# split of 1,024 tokens is never below the minimum: the rule without its short-context case; run 72 swept
# minimums of 16-256 and tiles of 16-64 at 4 warps)
SPLIT_SWEEP = dict(batches=(1, 8), contexts=(40, 100, 160, 256, 512),
                   grid=dict(min_split_tokens=(32, 64), short_split_tokens=(32, 1024), block_n=(32, 64),
                             num_warps=(4, 8)))
# --large-batch-sweep: the throughput protocol's 256-row step (context ~600), splits and launch shape
LARGE_BATCH_SWEEP = dict(batches=(256,), contexts=(600,),
                         grid=dict(num_splits=(1, 2, 4), block_n=(32, 64), num_warps=(4, 8), num_stages=(2, 3)))


def bench_decode_sweep(batches, contexts, table_tokens: int, grid: dict, budget_end: float, results: list,
                       inner: int, repeats: int, kind: str, device: str = "cuda") -> None:
    """Decode at the engine's table width for every combination of the launcher knobs in `grid`."""
    cache, order = _paged_cache(max(batches) * -(-max(table_tokens, max(contexts)) // BLOCK) * BLOCK,
                                torch.device(device))
    names = list(grid)
    for context in contexts:
        for batch in batches:
            for values in itertools.product(*(grid[n] for n in names)):
                knobs = dict(zip(names, values))
                case = dict(kind=kind, batch=batch, context=context, table_tokens=table_tokens, **knobs,
                            floor_us=round(decode_floor_us(batch, context), 3))
                if time.monotonic() > budget_end:
                    results.append({**case, "skipped": "budget"})
                    continue
                try:
                    results.append({**case, **_decode_case(cache, order, batch, context, inner, repeats, table_tokens,
                                                           **knobs)})
                except Exception as exc:  # a launch shape the GPU refuses (registers, shared memory): say so
                    results.append({**case, "error": f"{type(exc).__name__}: {exc}"[:200]})
                print(json.dumps(results[-1]), flush=True)


def bench_decode(batches, contexts, budget_end: float, results: list, inner: int, repeats: int,
                 fp8: bool = False) -> None:
    cache, order = _paged_cache(max(batches) * -(-max(contexts) // BLOCK) * BLOCK, torch.device("cuda"), fp8=fp8)
    for context in contexts:
        for batch in batches:
            case = dict(kind="decode", cache="fp8" if fp8 else "bf16", batch=batch, context=context,
                        floor_us=round(decode_floor_us(batch, context, cache.element_size()), 3))
            if time.monotonic() > budget_end:
                results.append({**case, "skipped": "budget"})
                continue
            results.append({**case, **_decode_case(cache, order, batch, context, inner, repeats)})
            print(json.dumps(results[-1]), flush=True)


def _prefill_weights(dev):
    """W_UK [H, Dn, L], W_UV [H, L, Dv] and the kv_b up-projection [L, H * (Dn + Dv)] they make."""
    gen = torch.Generator(device=dev).manual_seed(1)
    w_uk = torch.randn(HEADS, NOPE, LORA, device=dev, dtype=torch.bfloat16, generator=gen) * LORA ** -0.5
    w_uv = torch.randn(HEADS, LORA, V_DIM, device=dev, dtype=torch.bfloat16, generator=gen) * LORA ** -0.5
    # per head the columns [k_nope | v]: k_nope = c @ W_UK[h]^T (so q_nope . k_nope = (q_nope @ W_UK[h]) . c)
    kv_b = torch.cat([w_uk.transpose(1, 2), w_uv], dim=2).transpose(0, 1).reshape(LORA, HEADS * (NOPE + V_DIM))
    return w_uk, w_uv, kv_b


def _prefill_case(seqs: list[tuple[int, int]], weights, repeats: int) -> dict:
    import torch.nn.functional as F

    from metainfer.attention.mla import context_rows
    from metainfer.kernels.mla_attention import mla_prefill_attention_triton
    from metainfer.kernels.mla_expanded import mla_expanded_attention_triton

    dev, bf16, scale = torch.device("cuda"), torch.bfloat16, (NOPE + ROPE) ** -0.5
    w_uk, w_uv, kv_b = weights
    width = max(-(-ctx // BLOCK) for _, ctx in seqs)
    cache, order = _paged_cache(len(seqs) * width * BLOCK, dev, seed=len(seqs))
    tables = order[: len(seqs) * width].view(len(seqs), width)
    lens = torch.tensor([ctx for _, ctx in seqs], dtype=torch.int32, device=dev)
    q_lens = [q for q, _ in seqs]
    cu = torch.tensor([0] + list(itertools.accumulate(q_lens)), dtype=torch.int32, device=dev)
    total_q, total_k, max_q = sum(q_lens), sum(ctx for _, ctx in seqs), max(q_lens)
    q = torch.randn(total_q, HEADS, NOPE + ROPE, device=dev, dtype=bf16)
    q_nope, q_pe = q[..., :NOPE], q[..., NOPE:]
    q_nope_h = q_nope.transpose(0, 1)  # [H, T, Dn]

    def absorbed_kernel(q_lat):
        return mla_prefill_attention_triton(q_lat, q_pe, cache, cu, lens, tables, max_q, scale)

    def absorbed():
        q_lat = torch.bmm(q_nope_h, w_uk).transpose(0, 1)  # [T, H, L], strided
        return torch.bmm(absorbed_kernel(q_lat).transpose(0, 1), w_uv).transpose(0, 1)  # [T, H, Dv]

    def gathered():
        rows, cu_k = context_rows(lens, tables, total_k, BLOCK)
        latent = cache.view(-1, LORA + ROPE).index_select(0, rows)
        return (latent[:, :LORA] @ kv_b).view(total_k, HEADS, NOPE + V_DIM), latent[:, LORA:], cu_k

    def expanded():
        kv, k_pe, cu_k = gathered()
        return mla_expanded_attention_triton(q, kv, k_pe, cu, cu_k, max_q, scale)

    def sdpa():  # per sequence, the check
        kv, k_pe, cu_k = gathered()
        out = []
        for b, (q_len, ctx) in enumerate(seqs):
            k0, q0 = int(cu_k[b]), int(cu[b])
            k = torch.cat([kv[k0:k0 + ctx, :, :NOPE], k_pe[k0:k0 + ctx, None].expand(ctx, HEADS, ROPE)], -1)
            mask = torch.ones(q_len, ctx, dtype=torch.bool, device=dev).tril(ctx - q_len)
            out.append(F.scaled_dot_product_attention(q[q0:q0 + q_len].transpose(0, 1), k.transpose(0, 1),
                                                      kv[k0:k0 + ctx, :, NOPE:].transpose(0, 1), attn_mask=mask,
                                                      scale=scale).transpose(0, 1))
        return torch.cat(out)

    ref = sdpa().float()
    scale_of = ref.abs().max().clamp_min(1e-6)
    err_absorbed = ((absorbed().float() - ref).abs().max() / scale_of).item()
    err_expanded = ((expanded().float() - ref).abs().max() / scale_of).item()
    q_lat_pre = torch.bmm(q_nope_h, w_uk).transpose(0, 1)
    kv_pre, k_pe_pre, cu_k_pre = gathered()
    kernel_us = time_eager(lambda: absorbed_kernel(q_lat_pre), iters=repeats, warmup=2)
    absorbed_us = time_eager(absorbed, iters=repeats, warmup=2)
    expanded_kernel_us = time_eager(lambda: mla_expanded_attention_triton(q, kv_pre, k_pe_pre, cu, cu_k_pre, max_q,
                                                                          scale), iters=repeats, warmup=2)
    expanded_us = time_eager(expanded, iters=repeats, warmup=2)
    absorbed_flops = sum(absorbed_prefill_flops(q_len, context=ctx) for q_len, ctx in seqs)
    expanded_flops = sum(expanded_prefill_flops(q_len, context=ctx) for q_len, ctx in seqs)
    return {"new_tokens": total_q, "context_tokens": total_k, "sequences": len(seqs),
            "absorbed_us": round(absorbed_us, 2), "absorbed_kernel_us": round(kernel_us, 2),
            "expanded_us": round(expanded_us, 2), "expanded_kernel_us": round(expanded_kernel_us, 2),
            "faster": faster_form(absorbed_us, expanded_us),
            "absorbed_kernel_tflops": round(absorbed_flops / kernel_us / 1e6, 1),
            "expanded_kernel_tflops": round(expanded_flops / expanded_kernel_us / 1e6, 1),
            "max_rel_diff_absorbed": round(err_absorbed, 5), "max_rel_diff_expanded": round(err_expanded, 5)}


ABSORB_LAYERS = 27  # DeepSeek-V2-Lite's MLA layers: distinct weights, as a decode step reads them


def bench_absorb(rows, budget_end: float, results: list, repeats: int) -> None:
    """K-up + V-up a layer at each T: bmm against the tensor-core and row-loop Triton forms (module docstring)."""
    from metainfer.kernels._triton import pdl_supported

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    kv_b = [torch.randn(HEADS, NOPE + V_DIM, LORA, generator=g, device=dev, dtype=torch.bfloat16) * LORA ** -0.5
            for _ in range(ABSORB_LAYERS)]
    for t in rows:
        case = dict(kind="absorb", rows=t)
        if time.monotonic() > budget_end:
            results.append({**case, "skipped": "budget"})
            continue
        results.append({**case, **_absorb_case(t, kv_b, pdl_supported(dev), g, repeats)})
        print(json.dumps(results[-1]), flush=True)


def _absorb_case(t: int, kv_b: list, pdl: bool, g, repeats: int) -> dict:
    from metainfer.kernels.mla_absorb import mla_absorb_ref, mla_absorb_triton, mla_value_up_ref, mla_value_up_triton

    dev, bf16 = kv_b[0].device, kv_b[0].dtype
    q_nope = torch.randn(t, HEADS, NOPE + ROPE, generator=g, device=dev, dtype=bf16)[..., :NOPE]
    o_lat = torch.randn(t, HEADS, LORA, generator=g, device=dev, dtype=bf16)
    out = torch.empty(t, HEADS * V_DIM, device=dev, dtype=bf16)
    forms = {"bmm": (mla_absorb_ref, lambda o, w: mla_value_up_ref(o, w, out)),
             "mma": (lambda x, w: mla_absorb_triton(x, w, pdl=pdl, max_rows=0, mma_rows=t),
                     lambda o, w: mla_value_up_triton(o, w, out, pdl=pdl, max_rows=0, mma_rows=t)),
             "rows": (lambda x, w: mla_absorb_triton(x, w, pdl=pdl, max_rows=t),
                      lambda o, w: mla_value_up_triton(o, w, out, pdl=pdl, max_rows=t))}
    ref_q = mla_absorb_ref(q_nope, kv_b[0][:, :NOPE]).float()
    ref_o = mla_value_up_ref(o_lat, kv_b[0][:, NOPE:]).float()
    case, times = {}, {name: [] for name in forms}
    for name, (absorb, value_up) in forms.items():  # both products checked against the bmm, once
        err_q = (absorb(q_nope, kv_b[0][:, :NOPE]).float() - ref_q).abs().max() / ref_q.abs().max()
        err_o = (value_up(o_lat, kv_b[0][:, NOPE:]).float() - ref_o).abs().max() / ref_o.abs().max()
        case[f"{name}_absorb_rel_err"] = round(err_q.item(), 5)
        case[f"{name}_value_up_rel_err"] = round(err_o.item(), 5)
    names = list(forms)
    for shift in range(3):  # rotated order: no form always first
        for name in names[shift:] + names[:shift]:
            absorb, value_up = forms[name]

            def step(absorb=absorb, value_up=value_up):
                for w in kv_b:
                    absorb(q_nope, w[:, :NOPE])
                    value_up(o_lat, w[:, NOPE:])

            times[name].append(_graph_us(step, 1, repeats) / ABSORB_LAYERS)
    for name, runs in times.items():
        case[f"{name}_us_per_layer"] = round(sorted(runs)[1], 2)
    return case


def bench_prefill(steps, budget_end: float, results: list, repeats: int) -> None:
    weights = _prefill_weights(torch.device("cuda"))
    for label, seqs in steps:
        case = dict(kind="prefill", step=label)
        if time.monotonic() > budget_end:
            results.append({**case, "skipped": "budget"})
            continue
        results.append({**case, **_prefill_case(seqs, weights, repeats)})
        print(json.dumps(results[-1]), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--budget-s", type=float, default=100.0, help="stop starting cases after this many seconds")
    parser.add_argument("--batches", type=int, nargs="*", default=list(DECODE_BATCHES))
    parser.add_argument("--contexts", type=int, nargs="*", default=list(DECODE_CONTEXTS))
    parser.add_argument("--prefill-steps", nargs="*", default=[label for label, _ in PREFILL_STEPS],
                        help="labels of PREFILL_STEPS to time (default: all)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--inner", type=int, default=10, help="decode calls per CUDA graph")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--cache-dtype", choices=("bf16", "fp8"), default="bf16",
                        help="the decode cases' latent cache (fp8: e4m3, as kv_cache_dtype fp8 stores it)")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--split-sweep", action="store_true",
                        help="only the short-context split sweep at the engine's table width (module docstring)")
    parser.add_argument("--large-batch-sweep", action="store_true",
                        help="only the 256-row launch-shape sweep at the engine's table width (module docstring)")
    parser.add_argument("--table-tokens", type=int, default=4096, help="the sweeps' block-table width in tokens")
    parser.add_argument("--absorb-rows", type=int, nargs="+", default=None,
                        help="only the K-up / V-up forms at these decode row counts (module docstring)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mla: needs a CUDA GPU", file=sys.stderr)
        return 2
    start = time.monotonic()
    budget_end = start + args.budget_s
    results: list[dict] = []
    if args.absorb_rows:
        bench_absorb(args.absorb_rows, budget_end, results, args.repeats)
        args.skip_decode = args.skip_prefill = True
    sweeps = [(name, sweep) for name, sweep, on in (("split_sweep", SPLIT_SWEEP, args.split_sweep),
                                                    ("large_batch_sweep", LARGE_BATCH_SWEEP, args.large_batch_sweep))
              if on]
    for i, (name, sweep) in enumerate(sweeps):  # an even share of the budget each
        end = start + (i + 1) * args.budget_s / len(sweeps)
        bench_decode_sweep(sweep["batches"], sweep["contexts"], args.table_tokens, sweep["grid"], end, results,
                           args.inner, args.repeats, name)
    if not sweeps and not args.skip_decode:
        # decode first, but keep ~40% of the budget for prefill
        decode_end = budget_end if args.skip_prefill else start + 0.6 * args.budget_s
        bench_decode(args.batches, args.contexts, decode_end, results, args.inner, args.repeats,
                     fp8=args.cache_dtype == "fp8")
    if not args.skip_prefill and not sweeps:
        steps = [(label, seqs) for label, seqs in PREFILL_STEPS if label in args.prefill_steps]
        bench_prefill(steps, budget_end, results, max(5, args.repeats // 2))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, heads=HEADS, kv_lora_rank=LORA,
                rope_dim=ROPE, nope_dim=NOPE, v_dim=V_DIM, block_size=BLOCK, dtype="bf16",
                hbm_bytes_per_s=HBM_BYTES_PER_S, wall_s=round(time.monotonic() - start, 1))
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps(meta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
