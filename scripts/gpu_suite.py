"""Every GPU check and benchmark in one call (for the device machine).

Writes $OUT/gpu_results.json (+ the log) and prints a short table last. Sections:
  kernels    Triton vs torch reference at Qwen3-8B shapes, bf16
  gemv       batch-1 GEMV sweep: Triton configs vs cuBLAS per shape and for the whole decode set;
             the folded norm / SiLU prologues against their own kernels
  attn_sweep batch-1 decode attention launch parameters at the bs1 bench's contexts
  graphs     greedy output: CUDA-graph path == eager path, async == sync; prefix hits, preemption
  agreement  teacher-forced top-1 / logit cosine vs HF transformers at real dims
  latency    batch-1 decode TPOT, TTFT of a 1,024-token prompt, startup time, bandwidth ratio
  throughput nano-vllm protocol (256 seqs, lengths U[100, 1024])
  baseline   HF transformers eager and static cache + torch.compile at batch 1
  profile    torch.profiler breakdown of decode steps
  profile_batch  wall vs device time of a 256-sequence decode step
  allreduce  issue 6 on one GPU: the custom all-reduce's tests with two processes on GPU 0
  gpu_tests  the kernel test files compiled on the GPU (METAINFER_TEST_GPU=1)
  sampler    the torch sampler against the one-pass Gumbel-max kernel (the default on CUDA)
  gemm_rows  the decode set through cuBLAS at 1-256 rows, the untuned skinny GEMM beside it
  skinny_sweep  skinny GEMM configs per (shape, row bucket); the decode set with the winners
  ab         A/B in one engine (bs1): GEMV launch shapes around the shipped table under PDL, the
             folded norm; with skinny_sweep, its table at 4-32 rows
  attn_kv_dtype  decode attention alone with a bf16 and an fp8 KV cache, launch variants, ragged contexts
  kv_fp8     bs1 / bs8 / TTFT / batch 64 at context 1,024 with the fp8 KV cache (against bf16)
Usage: python scripts/gpu_suite.py [--sections a,b,...] [--config PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from metainfer import LLM, SamplingParams  # noqa: E402
from metainfer.bench.common import copy_bandwidth, environment  # noqa: E402

OUT = os.environ.get("OUT", "gpu_out")
RESULTS: dict = {"env": environment()}


def section(name):
    def wrap(fn):
        def run(args):
            start = time.perf_counter()
            print(f"\n=== {name} ===", flush=True)
            try:
                RESULTS[name] = fn(args)
            except Exception as exc:  # keep going: one broken section must not hide the rest
                traceback.print_exc()
                RESULTS[name] = {"error": f"{type(exc).__name__}: {exc}"}
            RESULTS.setdefault("section_seconds", {})[name] = time.perf_counter() - start
            save()
        return run
    return wrap


def save():
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gpu_results.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)


def model_dir(args) -> str:
    """A folder with the real config.json and the Qwen3 tokenizer files (dummy weights)."""
    import shutil

    folder = os.path.join("/tmp", "metainfer-model")
    os.makedirs(folder, exist_ok=True)
    shutil.copy(args.config, os.path.join(folder, "config.json"))
    tok = args.tokenizer_dir
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        if tok and os.path.exists(os.path.join(tok, name)):
            shutil.copy(os.path.join(tok, name), os.path.join(folder, name))
    return folder


# -------------------------------------------------------------------------------------------
@section("kernels")
def kernels(args):
    from metainfer.kernels import REF_OPS, TRITON_OPS, build_cos_sin_cache

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    H, Hq, Hk, D, inter = 4096, 32, 8, 128, 12288
    out = {}

    def compare(name, got, ref, tol=2e-2):
        err = (got.float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item() + 1e-6
        out[name] = {"max_abs_err": err, "rel_err": err / scale, "ok": err / scale < tol}

    x = torch.randn(4096, H, device=dev, dtype=dt)
    w = torch.randn(H, device=dev, dtype=dt)
    compare("rms_norm", TRITON_OPS.rms_norm(x, w, 1e-6), REF_OPS.rms_norm(x, w, 1e-6))
    r1, r2 = torch.randn_like(x), None
    r2 = r1.clone()
    y1, res1 = TRITON_OPS.fused_add_rms_norm(x.clone(), r1, w, 1e-6)
    y2, res2 = REF_OPS.fused_add_rms_norm(x.clone(), r2, w, 1e-6)
    compare("fused_add_rms_norm", y1, y2)
    compare("fused_add_residual", res1, res2)
    g = torch.randn(4096, 2 * inter, device=dev, dtype=dt)
    compare("silu_and_mul", TRITON_OPS.silu_and_mul(g), REF_OPS.silu_and_mul(g))
    cache = build_cos_sin_cache(D, 40960, 1e6, None).to(dev)
    pos = torch.randint(0, 40000, (4096,), device=dev)
    q, k = torch.randn(4096, Hq * D, device=dev, dtype=dt), torch.randn(4096, Hk * D, device=dev, dtype=dt)
    qa, ka = TRITON_OPS.rotary_neox(pos, q.clone(), k.clone(), cache, D)
    qb, kb = REF_OPS.rotary_neox(pos, q.clone(), k.clone(), cache, D)
    compare("rotary_q", qa, qb)
    compare("rotary_k", ka, kb)
    for bs in (16, 32):
        nb = 4096
        kc = torch.randn(nb, bs, Hk, D, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        lens = [1, 17, 500, 4096, 1023, 2049, 64, 3000]
        width = max(lens) // bs + 1
        tables = torch.randperm(nb, device=dev)[: len(lens) * width].view(len(lens), width).int()
        ctx = torch.tensor(lens, device=dev, dtype=torch.int32)
        qd = torch.randn(len(lens), Hq, D, device=dev, dtype=dt)
        compare(f"decode_attention_bs{bs}", TRITON_OPS.paged_decode_attention(qd, kc, vc, tables, ctx, D ** -0.5),
                REF_OPS.paged_decode_attention(qd, kc, vc, tables, ctx, D ** -0.5))
        qlens = [1, 17, 500, 1024, 1023, 33, 64, 700]
        cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), device=dev, dtype=torch.int32)
        qp = torch.randn(sum(qlens), Hq, D, device=dev, dtype=dt)
        compare(f"prefill_attention_bs{bs}",
                TRITON_OPS.paged_prefill_attention(qp, kc, vc, cu, ctx, tables, max(qlens), D ** -0.5),
                REF_OPS.paged_prefill_attention(qp, kc, vc, cu, ctx, tables, max(qlens), D ** -0.5))
        slots = torch.randperm(nb * bs, device=dev)[:4096].int()
        slots[::7] = -1
        kn, vn = torch.randn(4096, Hk, D, device=dev, dtype=dt), torch.randn(4096, Hk, D, device=dev, dtype=dt)
        a_k, a_v, b_k, b_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        TRITON_OPS.store_kv(kn, vn, a_k, a_v, slots)
        REF_OPS.store_kv(kn, vn, b_k, b_v, slots)
        out[f"store_kv_bs{bs}"] = {"ok": bool(torch.equal(a_k, b_k) and torch.equal(a_v, b_v))}
    from metainfer.kernels.qkv_prep import qk_norm_rope_store_ref, qk_norm_rope_store_triton

    for tokens in (1, 8, 4096):  # decode bs1, bs8 and a prefill chunk, Qwen3-8B heads
        nb, bs = 512, 16
        qkv = torch.randn(tokens, (Hq + 2 * Hk) * D, device=dev, dtype=dt)
        pos = torch.randint(0, 40000, (tokens,), device=dev)
        slots = torch.randperm(nb * bs, device=dev)[:tokens].int()
        qn, kn = 1 + 0.3 * torch.randn(D, device=dev, dtype=dt), 1 + 0.3 * torch.randn(D, device=dev, dtype=dt)
        caches = [torch.randn(nb, bs, Hk, D, device=dev, dtype=dt) for _ in range(2)]
        caches += [c.clone() for c in caches]  # the same untouched slots on both sides
        got = qk_norm_rope_store_triton(qkv.clone(), pos, cache, qn, kn, 1e-6, caches[0], caches[1], slots, Hq, Hk, D)
        ref = qk_norm_rope_store_ref(qkv.clone(), pos, cache, qn, kn, 1e-6, caches[2], caches[3], slots, Hq, Hk, D)
        compare(f"qk_norm_rope_store_T{tokens}_q", got[0], ref[0])
        compare(f"qk_norm_rope_store_T{tokens}_k", got[1], ref[1])
        compare(f"qk_norm_rope_store_T{tokens}_kcache", caches[0], caches[2])
        out[f"qk_norm_rope_store_T{tokens}_vcache"] = {"ok": bool(torch.equal(caches[1], caches[3]))}
    # the fused decode launch (q/k prep inside attention) against the torch composition: decode rows
    # at contexts up to 4,096 (the new token at ctx-1), batch 1 (split launch) and 256 (one pass)
    from metainfer.kernels.attention import paged_decode_attention_qkv_ref, paged_decode_attention_qkv_triton

    for batch in (1, 8, 256):
        bs, width = 16, 4096 // 16
        nb = batch * width + 16  # distinct blocks for every row (the new tokens' slots never collide)
        lens = torch.randint(1, 4097, (batch,)).tolist()
        lens[0] = 4096
        tables = torch.randperm(nb, device=dev)[: batch * width].view(batch, width).int()
        ctx = torch.tensor(lens, device=dev, dtype=torch.int32)
        last = ctx.long() - 1
        slots = (tables.gather(1, (last // bs)[:, None]).squeeze(1).long() * bs + last % bs).int()
        qkv = torch.randn(batch, (Hq + 2 * Hk) * D, device=dev, dtype=dt)
        qn, kn = 1 + 0.3 * torch.randn(D, device=dev, dtype=dt), 1 + 0.3 * torch.randn(D, device=dev, dtype=dt)
        caches = [torch.randn(nb, bs, Hk, D, device=dev, dtype=dt) for _ in range(2)]
        caches += [c.clone() for c in caches]
        args = (last, cache, qn, kn, 1e-6)
        got = paged_decode_attention_qkv_triton(qkv.clone(), *args, caches[0], caches[1], slots, tables, ctx, D ** -0.5,
                                                Hq, Hk, D)
        ref = paged_decode_attention_qkv_ref(qkv.clone(), *args, caches[2], caches[3], slots, tables, ctx, D ** -0.5,
                                             Hq, Hk, D)
        compare(f"decode_attention_qkv_B{batch}", got, ref)
        compare(f"decode_attention_qkv_B{batch}_kcache", caches[0], caches[2])
        out[f"decode_attention_qkv_B{batch}_vcache"] = {"ok": bool(torch.equal(caches[1], caches[3]))}
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    print(json.dumps(out, indent=1))
    return out


@section("gemv")
def gemv(args):
    """Batch-1 GEMV sweep (Triton configs vs cuBLAS per decode shape, then the whole decode set)."""
    from metainfer.kernels.gemv import TUNED_CONFIGS
    from metainfer.kernels.gemv_bench import format_report, prologue_ab, sweep

    res = sweep()  # the decode-set figures (with and without PDL) use this sweep's winners
    print(format_report(res), flush=True)
    try:  # the folded norm / activation against their own kernels, at the shipped table's configs
        res["prologue_ab"] = prologue_ab(TUNED_CONFIGS.get(torch.cuda.get_device_name(), {}))
    except Exception as exc:
        res["prologue_ab"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    print(json.dumps(res["prologue_ab"], indent=1), flush=True)
    return res  # run before latency, and latency also measures the engine with these winners


@section("gemm_rows")
def gemm_rows(args):
    """The decode set through cuBLAS at 1..256 rows: how far from the weight-streaming floor the
    batches between the Triton GEMV (M <= 2) and the compute-bound ones run; up to 64 rows the
    tensor-core skinny GEMM next to it."""
    from metainfer.kernels.gemv_bench import cublas_by_rows

    return cublas_by_rows()


@section("attn_sweep")
def attn_sweep(args):
    """Batch-1 decode attention at the Qwen3-8B heads (32 q, 8 kv, D=128, block 16) for the bs1 bench's
    contexts, with the latency engine's block-table width (max_model_len 4,096 / 16; the split count
    comes from the table, 32 at any width from 2,048 tokens, and the live splits from the context):
    one graph of 36 launches over distinct layer caches, PDL where supported, per (block_n,
    min_split_tokens). us a launch."""
    import metainfer.kernels.attention as attn
    from metainfer.kernels import pdl_supported
    from metainfer.kernels.gemv_bench import _time_graph

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    pdl = pdl_supported(dev)
    hq, hk, d, bs, layers, width = 32, 8, 128, 16, 36, 4096 // 16
    shipped = (attn._DECODE_SPLIT_BLOCK_N, attn._DECODE_MIN_SPLIT_TOKENS)  # bs1: a split launch
    res = {"pdl": pdl, "table_width": width, "shipped": shipped, "rows": []}
    contexts = (32, 96, 160, 1024)  # the bs1 bench's contexts run 32..160
    for ctx in contexts:
        blocks = -(-ctx // bs)
        caches = [torch.randn(2, blocks, bs, hk, d, device=dev, dtype=bf16) for _ in range(layers)]
        q = torch.randn(1, hq, d, device=dev, dtype=bf16)
        tables = torch.full((1, width), -1, device=dev, dtype=torch.int32)
        tables[0, :blocks] = torch.arange(blocks, device=dev, dtype=torch.int32)
        lens = torch.tensor([ctx], device=dev, dtype=torch.int32)
        ref = attn.paged_decode_attention_ref(q.float(), caches[0][0].float(), caches[0][1].float(),
                                              tables[:, :blocks], lens, d ** -0.5)
        for block_n in (16, 32, 64):
            for min_split in (32, 64, 128, 256):
                def call(c, block_n=block_n, min_split=min_split, q=q, tables=tables, lens=lens):
                    return attn.paged_decode_attention_triton(q, c[0], c[1], tables, lens, d ** -0.5,
                                                              block_n=block_n, min_split_tokens=min_split, pdl=pdl)
                err = (call(caches[0]).float() - ref).abs().max().item()
                us = _time_graph([lambda c=c: call(c) for c in caches], 10) * 1e3 / layers
                res["rows"].append({"ctx": ctx, "block_n": block_n, "min_split": min_split, "us": round(us, 3),
                                    "max_err": err})
        del caches
    for ctx in contexts:
        rows = [r for r in res["rows"] if r["ctx"] == ctx]
        best = min(rows, key=lambda r: r["us"])
        ship = next(r for r in rows if (r["block_n"], r["min_split"]) == shipped)
        res[f"ctx{ctx}"] = {"best": best, "shipped": ship}
        print(f"ctx {ctx}: shipped {ship['us']} us, best {best}", flush=True)
    combos = {(r["block_n"], r["min_split"]) for r in res["rows"]}
    totals = {c: sum(r["us"] for r in res["rows"] if (r["block_n"], r["min_split"]) == c and r["ctx"] <= 160)
              for c in combos}
    res["best_over_bench_contexts"] = {"block_n_min_split": min(totals, key=totals.get), "us_sum": min(totals.values()),
                                 "shipped_us_sum": totals[shipped]}
    print(res["best_over_bench_contexts"], flush=True)
    torch.cuda.empty_cache()
    return res


@section("attn_kv_dtype")
def attn_kv_dtype(args):
    """Decode attention alone with a bf16 and an fp8 KV cache at the Qwen3-8B heads (32 q, 8 kv,
    D=128, block 16): the throughput bench's big steps (256 / 128 x context 600, 64 x 1,088), 256
    rows over ragged contexts (uniform in [100, 1,100], the bench's spread; in random order, also
    with forced splits, and longest first as the scheduler orders them) and batch 1 at context 160
    (the latency engine's table width: a split launch). Launch variants (warps, stages, block_n,
    splits); us a launch over a graph of 8 launches on distinct caches, and the KV read rate."""
    import metainfer.kernels.attention as attn
    from metainfer.kernels.gemv_bench import _time_graph
    from metainfer.kernels.kv_cache import FP8_KV_DTYPE, to_cache_dtype, token_major_copy

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    hq, hk, d, bs, layers, width = 32, 8, 128, 16, 8, 4096 // 16
    res = {}
    common = [("default", {}), ("warps4_stages3", dict(num_warps=4, num_stages=3)), ("block_n64", dict(block_n=64)),
              ("block_n128", dict(block_n=128))]
    # fp8: V head-major unless a variant asks for the token-major copy (the engine's fp8 layout since run 35)
    # (the fp8 tensor-core decode kernel's variants: run 38, slower, removed)
    token_major = [("v_token_major", dict(v_token_major=True)),
                   ("v_token_major_tail32", dict(v_token_major=True, tail_block_n=32)),
                   ("v_token_major_stages3", dict(v_token_major=True, num_stages=3)),
                   ("v_token_major_block_n64", dict(v_token_major=True, block_n=64))]
    variants = {"fp8": common + token_major, "bf16": common}
    ragged = [("default", {}), ("splits2", dict(num_splits=2, block_n=64)), ("splits4", dict(num_splits=4, block_n=64))]
    gen = torch.Generator().manual_seed(0)
    cases = [(256, [600] * 256, variants), (128, [600] * 128, variants), (64, [1088] * 64, variants),
             (1, [160], variants),
             (256, torch.randint(100, 1101, (256,), generator=gen).tolist(),
              {"fp8": ragged + token_major[:2], "bf16": ragged})]
    longest_first = sorted(cases[-1][1], reverse=True)  # the order the scheduler gives a decode batch
    cases.append((256, longest_first, {"fp8": ragged[:1] + token_major[:2], "bf16": ragged[:1]}))
    for batch, ctxs, case_variants in cases:
        name = f"b{batch}_ctx{ctxs[0]}" if len(set(ctxs)) == 1 else f"b{batch}_ragged{min(ctxs)}-{max(ctxs)}"
        name += "_longest_first" if len(set(ctxs)) > 1 and ctxs == sorted(ctxs, reverse=True) else ""
        per_seq = -(-max(ctxs) // bs)
        tables = torch.arange(batch * per_seq, device=dev, dtype=torch.int32).view(batch, per_seq)
        tables = torch.cat([tables, torch.full((batch, width - per_seq), -1, device=dev, dtype=torch.int32)], 1)
        lens = torch.tensor(ctxs, device=dev, dtype=torch.int32)
        q = torch.randn(batch, hq, d, device=dev, dtype=bf16)
        row = res.setdefault(name, {"mean_ctx": sum(ctxs) / batch})
        for cache_name, cache_dtype in (("bf16", bf16), ("fp8", FP8_KV_DTYPE)):
            caches = []  # (k, v head-major, v token-major for fp8)
            for _ in range(layers):
                kv = to_cache_dtype(torch.randn(2, batch * per_seq, bs, hk, d, device=dev, dtype=bf16), cache_dtype)
                caches.append((kv[0], kv[1], token_major_copy(kv[1]) if cache_name == "fp8" else None))
            kv_bytes = sum(ctxs) * hk * d * 2 * caches[0][0].element_size()
            ref = attn.paged_decode_attention_ref(q.float(), caches[0][0], caches[0][1], tables[:, :per_seq], lens,
                                                  d ** -0.5)
            for variant, kw in case_variants[cache_name]:
                def call(c, kw=kw, q=q, tables=tables, lens=lens):
                    kw = dict(kw)
                    v = c[2] if kw.pop("v_token_major", False) else c[1]
                    return attn.paged_decode_attention_triton(q, c[0], v, tables, lens, d ** -0.5, **kw)
                try:  # one failing variant must not lose the section's other rows
                    err = (call(caches[0]).float() - ref).abs().max().item()
                    us = _time_graph([lambda c=c: call(c) for c in caches], 10) * 1e3 / layers
                except Exception as exc:
                    row[f"{cache_name}_{variant}"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                    print(f"{name} {cache_name} {variant}: FAILED {exc}", flush=True)
                    continue
                row[f"{cache_name}_{variant}"] = {"us": round(us, 2), "GBs": round(kv_bytes / us / 1e3, 1),
                                                  "max_err": err}
                print(f"{name} {cache_name} {variant}: {us:.2f} us, {kv_bytes / us / 1e3:.0f} GB/s, "
                      f"err {err:.2e}", flush=True)
            del caches
        torch.cuda.empty_cache()
    return res


@section("graphs")
def graphs(args):
    """fp32 small model: graph replay must reproduce eager greedy tokens exactly."""
    import transformers

    folder = "/tmp/metainfer-small"
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=2048, initializer_range=0.3)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = os.path.join(args.tokenizer_dir or "", name)
        if os.path.exists(src):
            import shutil
            shutil.copy(src, folder)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 4096, (96,), generator=g).tolist()
    prompts = [{"prompt_token_ids": shared + torch.randint(0, 4096, (n,), generator=g).tolist()} for n in
               (1, 5, 40, 200, 7, 64, 300, 2)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    results = {}
    variants = {"eager": dict(enforce_eager=True, async_scheduling=False), "graph": {},  # graph: async (default)
                "graph_no_pdl": dict(env={"METAINFER_DISABLE_PDL": "1"}),
                "graph_torch_sampler": dict(env={"METAINFER_FUSED_SAMPLER": "0"}),  # greedy: fused == torch argmax
                # q/k prep inside the decode attention launch: fp32 sums in another order
                "graph_fused_decode_prep": dict(env={"METAINFER_FUSED_DECODE_PREP": "1"}),
                "graph_sync": dict(async_scheduling=False), "graph_preempt": dict(num_kv_blocks=60),
                "eager_async_preempt": dict(enforce_eager=True, num_kv_blocks=60),
                "eager_no_prefix": dict(enforce_eager=True, enable_prefix_caching=False),
                # the fp8 KV cache: its graph runs against its own eager run (fp8 changes the tokens)
                "eager_kv_fp8": dict(enforce_eager=True, async_scheduling=False, kv_cache_dtype="fp8"),
                "graph_kv_fp8": dict(kv_cache_dtype="fp8"),
                "graph_kv_fp8_preempt": dict(kv_cache_dtype="fp8", num_kv_blocks=60)}
    # fp8 with V head-major (the A/B layout), against its own eager run (other summation order)
    head_major = {"METAINFER_FP8_V_TOKEN_MAJOR": "0"}
    variants.update({"eager_kv_fp8_v_head_major": dict(enforce_eager=True, async_scheduling=False,
                                                       kv_cache_dtype="fp8", env=head_major),
                     "graph_kv_fp8_v_head_major": dict(kv_cache_dtype="fp8", env=head_major),
                     "graph_kv_fp8_v_head_major_preempt": dict(kv_cache_dtype="fp8", num_kv_blocks=60,
                                                               env=head_major)})
    # an fp16 model over the fp8 cache (16-bit q and fp8 products in fp16), against its own eager run
    variants.update({"eager_kv_fp8_fp16": dict(enforce_eager=True, async_scheduling=False, kv_cache_dtype="fp8",
                                               dtype="float16"),
                     "graph_kv_fp8_fp16": dict(kv_cache_dtype="fp8", dtype="float16"),
                     "graph_kv_fp8_fp16_preempt": dict(kv_cache_dtype="fp8", num_kv_blocks=60, dtype="float16")})
    for name, kw in variants.items():
        env = kw.pop("env", {})
        os.environ.update(env)
        try:
            llm = LLM(folder, **{"dtype": "float32", **kw}, max_model_len=1024, max_num_seqs=16)
        finally:
            for key in env:
                del os.environ[key]
        # two waves: the first prompt's blocks are registered before the rest arrive (prefix hits)
        outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
        results[name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                         "preemptions": llm.llm_engine.scheduler.num_preemptions,
                         "prefix_hit_tokens": llm.llm_engine.block_manager.prefix_hit_tokens}
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    def eager_of(name):
        if "kv_fp8" not in name:
            return "eager"
        if "fp16" in name:
            return "eager_kv_fp8_fp16"
        return "eager_kv_fp8_v_head_major" if "v_head_major" in name else "eager_kv_fp8"

    summary = {k: {"equal_to_eager": v["tokens"] == results[eager_of(k)]["tokens"], "preemptions": v["preemptions"],
                   "prefix_hit_tokens": v["prefix_hit_tokens"]} for k, v in results.items()
               if k not in ("eager", "eager_kv_fp8", "eager_kv_fp8_v_head_major", "eager_kv_fp8_fp16")}
    summary["exercised"] = {  # the comparison means something only if these happened
        "prefix_hits": all(v["prefix_hit_tokens"] >= 96 for k, v in results.items() if k != "eager_no_prefix"),
        "preemptions": all(results[k]["preemptions"] > 0
                           for k in ("graph_preempt", "eager_async_preempt", "graph_kv_fp8_preempt",
                                     "graph_kv_fp8_v_head_major_preempt", "graph_kv_fp8_fp16_preempt")),
        "fp8_changes_tokens": results["eager_kv_fp8"]["tokens"] != results["eager"]["tokens"],
    }
    print(json.dumps(summary, indent=1))
    return summary


@section("agreement")
def agreement(args):
    """Teacher-forced vs HF bf16, and (the yardstick) HF bf16 and ours vs HF fp32, same weights;
    for both engine paths: decode (prefill of the prompt, then one decode step per position through
    the runner, CUDA graphs included) and prefill (all tokens in one paged prefill)."""
    import transformers

    from metainfer.bench.agreement import (
        compare,
        copy_hf_weights,
        hf_logits,
        hf_to_dtype,
        teacher_forced_logits,
        teacher_forced_prefill_logits,
        use_fp8_kv_attention,
    )

    folder = model_dir(args)
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda"):  # fp32 at 8B: 32.8 GB
        hf32 = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompt_len, n = 32, 256
    tokens = torch.randint(0, 10000, (prompt_len + n,), generator=torch.Generator().manual_seed(0))
    ref32 = hf_logits(hf32, tokens, prompt_len, n)
    hf16 = hf_to_dtype(hf32, torch.bfloat16)  # in place: the same weights rounded once; inv_freq stays fp32
    del hf32
    ref16 = hf_logits(hf16, tokens, prompt_len, n)
    # KV sized explicitly: 288 tokens need 18 blocks, and the memory-profiled budget would count
    # HF's model (still resident) against gpu_memory_utilization
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8,
              num_kv_blocks=64)
    copy_hf_weights(llm, hf16)  # hf16 stays for the fp8-cache engine below (16 GB; the fp32 model is gone)
    gc.collect()
    torch.cuda.empty_cache()
    ours = {"decode": teacher_forced_logits(llm, tokens, prompt_len, n),
            "prefill": teacher_forced_prefill_logits(llm, tokens, prompt_len, n)}
    result = {"positions": n, "prompt_len": prompt_len, "hf_bf16_vs_hf_fp32": compare(ref16, ref32)}
    for path, logits in ours.items():
        result[path] = {"ours_bf16_vs_hf_bf16": compare(logits, ref16),
                        "ours_bf16_vs_hf_fp32": compare(logits, ref32)}
    result["ours_decode_vs_ours_prefill"] = compare(ours["decode"], ours["prefill"])
    del llm
    gc.collect()
    # the same weights with an fp8 KV cache (kv_cache_dtype="fp8"): what the rounded K/V cost
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8,
              num_kv_blocks=64, kv_cache_dtype="fp8")
    copy_hf_weights(llm, hf16)
    fp8 = teacher_forced_logits(llm, tokens, prompt_len, n)
    use_fp8_kv_attention(hf16)  # HF bf16 with its attention over fp8-rounded K/V: the fp8 cache's oracle
    ref16_fp8 = hf_logits(hf16, tokens, prompt_len, n)
    result["decode_kv_fp8"] = {"ours_vs_hf_bf16": compare(fp8, ref16), "ours_vs_hf_fp32": compare(fp8, ref32),
                               "ours_vs_ours_bf16_cache": compare(fp8, ours["decode"]),
                               "ours_vs_hf_bf16_fp8_kv": compare(fp8, ref16_fp8),
                               "hf_bf16_fp8_kv_vs_hf_bf16": compare(ref16_fp8, ref16)}
    # the table's headline: decode path vs HF bf16
    result["top1_agreement"] = result["decode"]["ours_bf16_vs_hf_bf16"]["top1"]
    result["cosine_mean"] = result["decode"]["ours_bf16_vs_hf_bf16"]["cos_mean"]
    print(json.dumps(result, indent=1))
    del llm, ours, ref16, ref32, fp8, hf16, ref16_fp8
    gc.collect()
    torch.cuda.empty_cache()
    return result


@section("latency")
def latency(args):
    from metainfer.bench.latency import run_latency

    folder = model_dir(args)
    start = time.perf_counter()
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096)
    startup = time.perf_counter() - start
    # bs1 with vLLM benchmark_latency's iteration counts (10 warm-up, 30 timed; runs 1-40 used 1 and 3): re-captures
    # of one engine moved 3-iteration figures by up to 1% (runs 39-40)
    bs1 = run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=30, warmup=10)
    ttft = run_latency(llm, batch_size=1, input_len=1024, output_len=2, iters=5)
    bs8 = run_latency(llm, batch_size=8, input_len=32, output_len=128, iters=2)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    linear = runner.model.lm_head.matmul
    linear_name = getattr(getattr(linear, "func", linear), "__name__", str(linear)) + (
        f" pdl={linear.keywords.get('pdl')}" if hasattr(linear, "keywords") else "")
    num_blocks, graph_sizes = runner.num_blocks, runner.graph_batch_sizes
    engine.lookahead = 0  # the same engine read back after every step (async scheduling off)
    bs1_sync = run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=3)
    engine.lookahead = 1
    variants = {}
    from metainfer.kernels import select_ops
    from metainfer.layers.linear import bind_kernel_linears

    gpu, dev, pdl = torch.cuda.get_device_name(), runner.device, runner.ops.pdl
    swept = RESULTS.get("gemv", {}).get("table")
    # (the SiLU-unfused and norm-folded GEMV variants were measured in runs 14-20 and are no longer re-run)
    from dataclasses import replace

    from metainfer.kernels.step_inputs import step_inputs_ref

    default_ops = runner.ops
    # torch_step_inputs: a decode graph's ids and positions in six torch launches (before session 11), the A/B
    # of the one-launch kernel; triton_gemv_again: the default re-measured after it (same engine, same machine)
    choices = [("cublas", select_ops(dev, gpu_name=gpu, pdl=pdl, gemv_table={})),
               ("triton_gemv", default_ops), ("torch_step_inputs", replace(default_ops, step_inputs=step_inputs_ref)),
               ("triton_gemv_again", default_ops)]
    if swept:  # this run's sweep winners in the engine (the shipped table stays the default)
        choices.append(("triton_gemv_this_sweep", select_ops(dev, gpu_name=gpu, pdl=pdl, gemv_table=swept)))
    for name, ops in choices:  # swap, re-capture, measure
        runner.ops = ops  # step_inputs is read through runner.ops at capture
        bind_kernel_linears(runner.model, ops)
        runner._capture_cudagraphs()
        variants[name] = run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=3)
        linear = getattr(ops.linear, "keywords", {}).get("base", ops.linear)  # the GEMV under the skinny wrapper
        table = getattr(linear, "keywords", {}).get("table")
        if table:
            variants[name]["gemv_table"] = {f"{n}x{k}": c.to_dict() for (n, k), c in table.items()}
    runner.ops = default_ops
    bind_kernel_linears(runner.model, runner.ops)
    del engine, runner, choices, default_ops  # the modules must go with the LLM, or the next engine finds no memory
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    llm = _bench_llm(folder, METAINFER_DISABLE_PDL="1")  # the same engine without programmatic dependent launch
    variants["no_pdl"] = run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=3)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    # (the torch-sampler and fused-decode-prep variants were measured in runs 17-20 and are no longer re-run)
    llm = _bench_llm(folder, METAINFER_SKINNY_GEMM="0")  # 3-16-row GEMMs on cuBLAS (the skinny GEMM's A/B)
    bs8_no_skinny = run_latency(llm, batch_size=8, input_len=32, output_len=128, iters=2)
    res = {"startup_s": startup, "bs1": bs1, "ttft_1024": {"ttft_ms": ttft["ttft_ms"]}, "bs8": bs8,
           "bs1_sync": bs1_sync, "bs1_variants": variants, "bs8_no_skinny_gemm": bs8_no_skinny,
           "linear": linear_name, "num_kv_blocks": num_blocks, "graph_batch_sizes": graph_sizes}
    print(json.dumps(res, indent=1, default=str))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


@section("skinny_sweep")
def skinny_sweep(args):
    """The skinny GEMM's configs per (decode shape, row bucket) against cuBLAS, then the decode set at
    8-64 rows with the winning table (kernels/skinny_bench.py); the `ab` section runs that table."""
    from metainfer.kernels.skinny_bench import sweep

    res = sweep()
    print(json.dumps({"table": res["table"], "decode_set": res["decode_set"]}, indent=1))
    return res


@section("ab")
def ab(args):
    """A/B in one engine: every variant's ops bound to the model and the graphs re-captured, then bs1
    (the default measured first and last: the run's own noise) and, if
    skinny_sweep ran, batches of 4-32 rows with its table against the shipped one.
    bs1 (session 8, after run 27 shipped 8-row 4-warp programs for qkv / gate_up / LM head): GEMV
    launch shapes around the shipped table under PDL + preload, in the engine (the table was swept in
    isolation without PDL, and the engine's optimum moved): 8 warps on the 8-row shapes, 16-row
    programs per shape, a K split of 2 on o_proj / down (256 programs for 132 SMs), and the RMSNorm
    folded into the qkv / gate_up GEMVs.
    (Measured and retired: the preload on none / down only, 8-row o_proj / down (215 tok/s), the
    no-PDL plain loop vs the peeled kernel, the 8-row parts: runs 21-26, docs/PERFORMANCE.md.)"""
    from dataclasses import replace

    from metainfer.bench.latency import run_latency
    from metainfer.kernels import select_ops
    from metainfer.kernels.gemv import TUNED_CONFIGS, GemvConfig
    from metainfer.layers.linear import bind_kernel_linears

    folder = model_dir(args)
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096)
    runner = llm.llm_engine.runner
    gpu, dev, pdl = torch.cuda.get_device_name(), runner.device, runner.ops.pdl
    shipped = TUNED_CONFIGS[gpu]
    if not pdl:  # tuned_linear drops preload without PDL: the preload variants would all be one kernel
        return {"skipped": "needs programmatic dependent launch (METAINFER_DISABLE_PDL unset, sm_90+)"}

    def preload(keys, **overrides):
        """The shipped table with preload on `keys` only; `overrides` ("NxK" -> config fields) replace
        launch fields of some shapes (the table was tuned per shape in isolation, without PDL)."""
        return {key: replace(GemvConfig.from_any(cfg), preload=key in keys, **overrides.get(key, {})).to_dict()
                for key, cfg in shipped.items()}

    def measure(ops, batches, iters):
        bind_kernel_linears(runner.model, ops)
        runner._capture_cudagraphs()
        return {f"bs{b}": run_latency(llm, batch_size=b, input_len=32, output_len=128, iters=iters) for b in batches}

    res = {"bs1": {}, "rows": {}, "graph_batch_sizes": runner.graph_batch_sizes, "pdl": pdl}
    def shaped(fields, *keys):
        return select_ops(dev, gpu_name=gpu, pdl=pdl, gemv_table=preload(set(shipped), **{k: fields for k in keys}))

    qkv, o_proj, gate_up, down, lm_head = "6144x4096", "4096x4096", "24576x4096", "4096x12288", "151936x4096"
    eight_by_8, sixteen_by_8 = {"block_n": 8, "num_warps": 8}, {"block_n": 16, "num_warps": 8}
    bs1_variants = [("default", runner.ops),
                    ("gemv_qkv_gate_up_lm_head_8_warps", shaped(eight_by_8, qkv, gate_up, lm_head)),
                    ("gemv_gate_up_lm_head_8_warps", shaped(eight_by_8, gate_up, lm_head)),
                    ("gemv_qkv_16_rows", shaped(sixteen_by_8, qkv)),
                    ("gemv_gate_up_16_rows", shaped(sixteen_by_8, gate_up)),
                    ("gemv_lm_head_16_rows", shaped(sixteen_by_8, lm_head)),
                    ("gemv_o_down_split_k2", shaped({"split_k": 2}, o_proj, down)),
                    # the RMSNorms folded into the qkv / gate_up GEMV prologues (runs 12-13: a loss with
                    # 4-row programs; 8-row programs halve the programs that recompute a row's 1/rms)
                    ("norm_fold", select_ops(dev, gpu_name=gpu, pdl=pdl, fuse_norm=True)),
                    ("default_again", runner.ops)]
    for name, ops in bs1_variants:
        res["bs1"][name] = measure(ops, (1,), 3)["bs1"]
        print("ab bs1", name, round(res["bs1"][name]["decode_tok_s"], 1), flush=True)
    swept = RESULTS.get("skinny_sweep", {}).get("table")
    rows_variants = []  # (the shipped skinny GEMM against cuBLAS: runs 21, 22, 25)
    if swept:
        rows_variants = [("default", runner.ops),
                         ("skinny_this_sweep", select_ops(dev, gpu_name=gpu, pdl=pdl, skinny_table=swept))]
    for name, ops in rows_variants:
        res["rows"][name] = measure(ops, (4, 8, 16, 32), 2)
        print("ab rows", name, {b: round(r["decode_tok_s"], 1) for b, r in res["rows"][name].items()}, flush=True)
    bind_kernel_linears(runner.model, runner.ops)
    runner = llm = bs1_variants = rows_variants = None  # the modules must go with the LLM (see latency)
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _bench_llm(folder: str, engine_kw: dict | None = None, **switches: str):
    """The suite's bf16 dummy-weight engine (max_model_len 4,096), built with A/B environment switches
    (read once at engine build) set for the construction only, and extra LLM keywords."""
    saved = {name: os.environ.get(name) for name in switches}
    os.environ.update(switches)
    try:
        return LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, **(engine_kw or {}))
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@section("throughput")
def throughput(args):
    from metainfer.bench.throughput import run_throughput

    folder = model_dir(args)
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096)
    res = run_throughput(llm, progress=False)
    print(json.dumps(res, indent=1))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    # (the torch-sampler and fused-decode-prep variants: runs 17-20)
    # (no_skinny_gemm, 3-16-row GEMMs on cuBLAS: runs 20, 22, 25, within noise of the default)
    # (admission_order, METAINFER_DECODE_ORDER=admission: runs 30-31, -1.6 to -1.8% against longest first)
    # (kv_fp8_v_token_major, runs 34-35: the layout kv_fp8 now has by default; kv_fp8_widen: run 38)
    variants = {"kv_fp8": ({}, {"kv_cache_dtype": "fp8"}),  # float8_e4m3fn KV cache: half the attention bytes
                "kv_fp8_v_head_major": ({"METAINFER_FP8_V_TOKEN_MAJOR": "0"}, {"kv_cache_dtype": "fp8"})}
    for name, (switches, engine_kw) in variants.items():
        llm = None
        try:  # one failing variant must not lose the figures measured before it
            llm = _bench_llm(folder, engine_kw, **switches)
            other = run_throughput(llm, progress=False)
            res[name] = {k: other[k] for k in ("output_tok_s", "total_tok_s", "elapsed_s")}
            res[name]["decode_seconds"] = other["timeline"]["decode_seconds"]
        except Exception as exc:
            traceback.print_exc()
            res[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        print(name, json.dumps(res[name]), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return res


@section("kv_fp8")
def kv_fp8(args):
    """The latency figures with an fp8 KV cache (kv_cache_dtype="fp8"): batch 1 and 8, TTFT, batch 64
    at context 1,024 against the bf16 cache, and both pools' blocks and bytes per block (the block
    count is capped at max_num_seqs x blocks a sequence: both may sit at the cap). The throughput
    section runs the fp8 throughput."""
    from metainfer.bench.latency import run_latency

    llm = _bench_llm(model_dir(args), {"kv_cache_dtype": "fp8"})
    res = {"bs1": run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=3),
           "ttft_1024": {"ttft_ms": run_latency(llm, batch_size=1, input_len=1024, output_len=2, iters=5)["ttft_ms"]},
           "bs8": run_latency(llm, batch_size=8, input_len=32, output_len=128, iters=2),
           "bs64_ctx1024": run_latency(llm, batch_size=64, input_len=1024, output_len=64, iters=1),
           "num_kv_blocks": llm.llm_engine.runner.num_blocks,
           "bytes_per_block": llm.llm_engine.runner._bytes_per_block()}
    print(json.dumps(res, indent=1, default=str))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    llm = _bench_llm(model_dir(args))  # the same long-context batch with the bf16 cache
    res["bs64_ctx1024_bf16_cache"] = run_latency(llm, batch_size=64, input_len=1024, output_len=64, iters=1)
    res["bf16_cache"] = {"num_kv_blocks": llm.llm_engine.runner.num_blocks,
                         "bytes_per_block": llm.llm_engine.runner._bytes_per_block()}
    print("bs64 ctx1024 bf16 cache", json.dumps(res["bs64_ctx1024_bf16_cache"], default=str))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


@section("sampler")
def sampler(args):
    """The torch sampler against the one-pass Gumbel-max kernel on [B, 151936] bf16 logits (greedy
    and temperature 0.6): ms a call (CUDA events, after a warm-up), and the greedy tokens compared."""
    from metainfer.engine.sampler import Sampler
    from metainfer.engine.sequence import Sequence
    from metainfer.kernels.sampling import GumbelSampler
    from metainfer.sampling_params import SamplingParams

    vocab, res = 151936, {}
    kernel = GumbelSampler(256, vocab, "cuda", warmup_dtype=torch.bfloat16)  # every variant compiled here
    paths = {"torch": Sampler(vocab, (0,), "cuda"), "fused": Sampler(vocab, (0,), "cuda", fused=kernel)}
    for batch in (1, 256):
        logits = torch.randn(batch, vocab + 64, device="cuda", dtype=torch.bfloat16) * 3
        for temperature in (0.0, 0.6):
            seqs = [Sequence(f"r{i}", i, [1], SamplingParams(temperature=temperature, max_tokens=8))
                    for i in range(batch)]
            row = {}
            for name, path in paths.items():
                for _ in range(3):
                    path(logits, seqs)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    out = path(logits, seqs)
                end.record()
                end.synchronize()
                row[f"{name}_ms"] = round(start.elapsed_time(end) / 20, 4)
                row[f"{name}_tokens"] = out.token_ids
            if temperature == 0.0:
                row["greedy_equal"] = bool(torch.equal(row["torch_tokens"], row["fused_tokens"]))
            del row["torch_tokens"], row["fused_tokens"]
            res[f"b{batch}_t{temperature}"] = row
            print(batch, temperature, row, flush=True)
    return res


@section("baseline")
def baseline(args):
    """HF transformers at the latency section's shapes: bs1 eager and static cache + compile,
    bs8 and a 1,024-token TTFT eager (one compile costs ~45 s; bs8 would need a second one)."""
    from metainfer.bench.baselines import load_hf_model, time_hf

    folder = model_dir(args)
    res = {}
    for mode in args.baseline_modes.split(","):
        hf = load_hf_model(folder, torch.bfloat16, torch.device("cuda"), dummy=True)
        res[mode] = time_hf(hf, 1, 32, 128, iters=2, mode=mode)
        print(mode, json.dumps(res[mode]), flush=True)
        if mode == "eager":
            res["eager_bs8"] = time_hf(hf, 8, 32, 128, iters=2, mode="eager")
            res["eager_ttft_1024"] = time_hf(hf, 1, 1024, 2, iters=3, mode="eager")
            print("eager bs8 / ttft", json.dumps(res["eager_bs8"]), json.dumps(res["eager_ttft_1024"]), flush=True)
        del hf
        gc.collect()
        torch.cuda.empty_cache()
    return res


@section("profile")
def profile(args):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    folder = model_dir(args)
    out = {}
    # graph_no_pdl: under PDL the profiler books a kernel's early-launch wait as its own time, so only
    # a PDL-off graph profile decomposes into kernels + gaps (docs/PERFORMANCE.md)
    variants = {"graph": ({}, False), "graph_no_pdl": ({}, True), "eager": (dict(enforce_eager=True), False)}
    for name, (kw, no_pdl) in variants.items():
        if no_pdl:
            os.environ["METAINFER_DISABLE_PDL"] = "1"
        try:
            llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8, **kw)
        finally:
            os.environ.pop("METAINFER_DISABLE_PDL", None)
        engine, steps = llm.llm_engine, 32
        engine.add_request("warm", {"prompt_token_ids": list(range(100, 132))},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), stream=False)
        while engine.has_unfinished_requests():
            engine.step()
        engine.add_request("p", {"prompt_token_ids": list(range(200, 232))},
                           SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True), stream=False)
        for _ in range(4):  # prefill and the first decode steps stay out of the window
            engine.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) / steps * 1e3
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        buckets = _kernel_buckets(prof, per=steps)
        top = sorted(((e.key[:60], (getattr(e, "device_time_total", 0) or 0) / 1e3 / steps)
                      for e in prof.key_averages() if not e.key.startswith("aten::")), key=lambda kv: -kv[1])[:12]
        device_ms = sum(buckets.values())
        every = sorted(((e.key[:60], e.count / steps, round((getattr(e, "device_time_total", 0) or 0) / 1e3 / steps, 4))
                        for e in prof.key_averages() if not e.key.startswith("aten::")), key=lambda r: -r[2])
        out[name] = {"decode_steps": steps, "wall_ms_per_token": wall_ms, "device_ms_per_token": device_ms,
                     "gaps_ms_per_token": wall_ms - device_ms, "device_ms_per_token_by_kind": buckets,
                     "top_kernels_ms_per_token": top, "launches_per_token": sum(r[1] for r in every),
                     "kernels_per_token": every}
        print(name, json.dumps(out[name], indent=1), flush=True)
        while engine.has_unfinished_requests():
            engine.step()
        del llm, engine
        gc.collect()
        torch.cuda.empty_cache()
    return out


@section("profile_batch")
def profile_batch(args):
    """Where a decode step of 256 running sequences (context ~600) spends its time: wall time per
    step against device time per kernel kind (what the throughput bench runs most of the time)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    folder = model_dir(args)
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096)
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.6, max_tokens=64, ignore_eos=True)
    for i in range(256):
        engine.add_request(f"p{i}", {"prompt_token_ids": torch.randint(0, 10000, (576,), generator=g).tolist()},
                           params, stream=False)
    def prefilling():
        return any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) or \
            bool(engine.scheduler.waiting)

    # the prefill (18 steps of 8,192 tokens): wall time per step, and a profile of two steps
    torch.cuda.synchronize()
    start, prefill_steps = time.perf_counter(), 0
    for _ in range(2):
        engine.step()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            engine.step()
        torch.cuda.synchronize()
    prefill_steps = 4
    while prefilling():
        engine.step()
        prefill_steps += 1
    torch.cuda.synchronize()
    prefill = {"steps": prefill_steps, "tokens": 256 * 576,
               "wall_ms_per_step_incl_profiled": (time.perf_counter() - start) / prefill_steps * 1e3,
               "device_ms_per_step_by_kind": _kernel_buckets(prof, per=2)}
    prefill["device_ms_per_step"] = sum(prefill["device_ms_per_step_by_kind"].values())
    prefill["top_kernels_ms_per_step"] = sorted(
        ((e.key[:60], (getattr(e, "device_time_total", 0) or 0) / 1e3 / 2) for e in prof.key_averages()
         if not e.key.startswith("aten::")), key=lambda kv: -kv[1])[:10]
    print("prefill", json.dumps(prefill, indent=1), flush=True)
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    steps = 16
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            engine.step()
        torch.cuda.synchronize()
    buckets = _kernel_buckets(prof, per=8)
    while engine.has_unfinished_requests():
        engine.step()
    res = {"prefill": prefill, "running": 256, "context": "576 + 4..36", "wall_ms_per_step": wall_ms,
           "device_ms_per_step_by_kind": buckets, "device_ms_per_step": sum(buckets.values())}
    print(json.dumps(res, indent=1), flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


def _kernel_buckets(prof, per: int) -> dict[str, float]:
    buckets: dict[str, float] = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
        if t <= 0 or evt.key.startswith("cuda") or evt.key.startswith("aten::"):
            continue
        k = evt.key.lower()
        kind = ("gemm" if any(x in k for x in ("gemm", "gemv", "splitk", "cutlass", "sm90", "nvjet", "cublas")) else
                "attention" if any(x in k for x in ("decode", "prefill", "attn", "attention")) else
                "norm/rotary/act" if any(x in k for x in ("rms", "rotary", "silu", "norm", "qk_norm")) else
                "memcpy" if "memcpy" in k else "other")
        buckets[kind] = buckets.get(kind, 0) + t / 1e3 / per
    return buckets


def _pytest_on_gpu(files: list[str], timeout: int, test_filter: str = "") -> dict:
    """Run test files compiled on the GPU (METAINFER_TEST_GPU=1: no Triton interpreter, bf16 too).
    The counts come from pytest's JUnit XML; the whole output is kept in $OUT/gpu_tests_output.txt."""
    import subprocess
    import xml.etree.ElementTree as ET

    env = dict(os.environ, METAINFER_TEST_GPU="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               METAINFER_SHARED_GPU_TIMEOUT="60")
    junit = os.path.join("/tmp", "metainfer-gpu-tests.xml")
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *(["-k", test_filter] if test_filter else [])]
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, cwd=here, env=env, capture_output=True, text=True, timeout=timeout)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gpu_tests_output.txt"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    counts, failed = {}, []
    if os.path.exists(junit):
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            for key in ("tests", "failures", "errors", "skipped"):
                counts[key] = counts.get(key, 0) + int(suite.get(key, 0))
            failed += [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                       if c.find("failure") is not None or c.find("error") is not None]
    tail = (proc.stdout + proc.stderr)[-3000:]
    print(tail, flush=True)
    summary = [f"{counts.get('tests', 0)} tests, {counts.get('failures', 0)} failed, {counts.get('errors', 0)} "
               f"errors, {counts.get('skipped', 0)} skipped"] + failed
    return {"files": files, "counts": counts, "failed": failed, "summary": summary, "returncode": proc.returncode,
            "output_tail": tail}


@section("allreduce")
def allreduce(args):
    """Issue 6 on one GPU: the custom all-reduce's tests (two processes sharing GPU 0 if allowed)."""
    return _pytest_on_gpu(["tests/test_phase02_custom_all_reduce.py"], timeout=200)


@section("gpu_tests")
def gpu_tests(args):
    """The kernel tests compiled on the GPU: races the interpreter cannot show (the split-KV merge
    by the last split to finish), bf16, the compiled GEMV and fused q/k kernels."""
    files = args.gpu_test_files.split(",")
    return _pytest_on_gpu(files, timeout=420, test_filter=args.gpu_test_filter)


def table() -> str:
    r = RESULTS
    lines = ["", "| figure | ours | reference | ratio |", "|---|---|---|---|"]
    lat, base = r.get("latency", {}), r.get("baseline", {})
    bs1 = lat.get("bs1", {})
    if "tpot_ms" in bs1:
        lines.append(f"| bs1 decode tok/s | {bs1['decode_tok_s']:.1f} | roofline {bs1.get('roofline_tok_s', 0):.1f} "
                     f"(copy {bs1.get('copy_bw_GBs', 0):.0f} GB/s) | {bs1.get('bw_ratio', 0):.1%} |")
        if bs1.get("tpot_e2e_ms", 0) > 0:  # run 42 on: per-token TPOT; the older e2e figure beside it
            lines.append(f"| bs1 decode tok/s, (generate - TTFT) / (n - 1) | {1e3 / bs1['tpot_e2e_ms']:.1f} | | |")
        for mode in ("eager", "compile"):  # HF's TPOT is timed the same way as ours (per-token times, session 11)
            b = base.get(mode)
            if isinstance(b, dict) and "decode_tok_s" in b:
                lines.append(f"| bs1 decode tok/s vs HF {mode} | {bs1['decode_tok_s']:.1f} | {b['decode_tok_s']:.1f} | "
                             f"{bs1['decode_tok_s'] / b['decode_tok_s']:.2f}x |")
    for mode in ("eager", "compile"):  # HF alone (a run of the baseline section only has no bs1 of ours)
        b = base.get(mode)
        if isinstance(b, dict) and "decode_tok_s" in b and "tpot_ms" not in bs1:
            lines.append(f"| HF {mode} bs1 decode tok/s | | {b['decode_tok_s']:.1f} | |")
    if "bs1_sync" in lat:
        lines.append(f"| bs1 decode tok/s, async scheduling off | {lat['bs1_sync']['decode_tok_s']:.1f} | | |")
    for name, v in lat.get("bs1_variants", {}).items():
        lines.append(f"| bs1 decode tok/s, variant {name} | {v['decode_tok_s']:.1f} | roofline "
                     f"{v.get('roofline_tok_s', 0):.1f} | {v.get('bw_ratio', 0):.1%} |")
    gv = r.get("gemv", {}).get("decode_set", {})
    if gv:
        times = {k: v for k, v in gv.items() if k.endswith("_ms")}
        lines.append(f"| decode-set GEMVs in one graph (ms) | {json.dumps(times)[:90]} | | |")
    for name, v in r.get("gemv", {}).get("prologue_ab", {}).items():
        if isinstance(v, dict) and "fused_ms" in v:
            best = f", best folded config {v['fused_best_ms']:.3f}" if "fused_best_ms" in v else ""
            lines.append(f"| {name} x36: GEMV alone / separate kernel / folded (ms) | {v['gemv_only_ms']:.3f} / "
                         f"{v['unfused_ms']:.3f} / {v['fused_ms']:.3f}{best} | saved {v['saved_us_per_launch']:.2f} "
                         f"us a launch | |")
    for ctx in (32, 96, 160, 1024):
        a = r.get("attn_sweep", {}).get(f"ctx{ctx}")
        if a:
            b = a["best"]
            lines.append(f"| bs1 decode attention ctx {ctx} (us) | shipped {a['shipped']['us']:.2f} | "
                         f"best {b['us']:.2f} (block_n {b['block_n']}, min split {b['min_split']}) | |")
    tp = r.get("throughput", {})
    # the variants of runs 17 (fused_sampler) and 18 (unfused_decode_prep) too, for --print-table
    for name in ("kv_fp8", "kv_fp8_widen", "kv_fp8_v_token_major", "kv_fp8_v_head_major", "admission_order",
                 "no_skinny_gemm",
                 "torch_sampler", "fused_decode_prep", "skinny_gemm", "unfused_decode_prep", "fused_sampler"):
        if "output_tok_s" in tp.get(name, {}) and "output_tok_s" in tp:
            lines.append(f"| throughput output tok/s: default / variant {name} | {tp['output_tok_s']:.0f} / "
                         f"{tp[name]['output_tok_s']:.0f} | | |")
    for name, v in r.get("sampler", {}).items():
        if isinstance(v, dict) and "fused_ms" in v:
            lines.append(f"| sampler {name}: torch / fused (ms) | {v['torch_ms']:.3f} / {v['fused_ms']:.3f} | "
                         f"greedy equal: {v.get('greedy_equal', '-')} | |")
    for key, v in r.get("gemm_rows", {}).items():
        if isinstance(v, dict) and "ms" in v:
            skinny = f"{v['skinny_ms']:.3f} (err {v['skinny_max_rel_err']:.1e})" if "skinny_ms" in v else "-"
            lines.append(f"| decode set at {key[1:]} rows: cuBLAS / skinny GEMM (ms) | {v['ms']:.3f} / {skinny} | | |")
    kv8 = r.get("kv_fp8", {})
    if "bs1" in kv8:
        lines.append(f"| fp8 KV cache: bs1 / bs8 tok/s, TTFT ms | {kv8['bs1']['decode_tok_s']:.1f} / "
                     f"{kv8['bs8']['decode_tok_s']:.0f}, {kv8['ttft_1024']['ttft_ms']:.1f} | | |")
        bf16_cache, fp8_cache = kv8["bs64_ctx1024_bf16_cache"], kv8["bs64_ctx1024"]
        lines.append(f"| bs64 ctx 1024 decode tok/s: bf16 / fp8 cache | {bf16_cache['decode_tok_s']:.0f} / "
                     f"{fp8_cache['decode_tok_s']:.0f} | | |")
    for case, row in r.get("attn_kv_dtype", {}).items():
        if isinstance(row, dict) and "bf16_default" in row and "fp8_default" in row:
            best = min((k for k, v in row.items() if isinstance(v, dict) and "us" in v), key=lambda k: row[k]["us"])
            # fp8_default is V head-major (the A/B); the engine's fp8 layout is fp8_v_token_major (run 35 on)
            token_major = f" / {row['fp8_v_token_major']['us']:.1f}" if "us" in row.get("fp8_v_token_major", {}) else ""
            lines.append(f"| decode attention {case}: bf16 / fp8 V head-major{' / token-major' if token_major else ''}"
                         f" (us) | {row['bf16_default']['us']:.1f} / {row['fp8_default']['us']:.1f}{token_major} | "
                         f"fastest {best} {row[best]['us']:.1f} | |")
            if "us" in row.get("fp8_v_token_major_widen", {}):  # session 11: fp8 products against widening
                lines.append(f"| decode attention {case}, token-major fp8: fp8 products / widened (us) | "
                             f"{row['fp8_v_token_major']['us']:.1f} / {row['fp8_v_token_major_widen']['us']:.1f} | | |")
    agr8 = r.get("agreement", {}).get("decode_kv_fp8")
    if agr8:
        a = agr8["ours_vs_hf_bf16"]
        lines.append(f"| agreement, fp8 KV cache vs HF bf16: top-1 / cosine | {a['top1']:.3f} / "
                     f"{a['cos_mean']:.5f} | | |")
        if "ours_vs_hf_bf16_fp8_kv" in agr8:
            o, h = agr8["ours_vs_hf_bf16_fp8_kv"], agr8["hf_bf16_fp8_kv_vs_hf_bf16"]
            lines.append(f"| fp8 KV: ours vs HF bf16 over fp8 K/V / that HF vs HF bf16: top-1 | {o['top1']:.3f} / "
                         f"{h['top1']:.3f} | cosine {o['cos_mean']:.5f} / {h['cos_mean']:.5f} | |")
    pb = r.get("profile_batch", {})
    if "wall_ms_per_step" in pb:
        lines.append(f"| 256-seq decode step: wall / device ms | {pb['wall_ms_per_step']:.2f} / "
                     f"{pb['device_ms_per_step']:.2f} | | |")
    for name in ("allreduce", "gpu_tests"):
        if "returncode" in r.get(name, {}):
            summary = "; ".join(r[name].get("summary", []))[-90:]
            lines.append(f"| {name}: pytest on the GPU | rc {r[name]['returncode']}: {summary} | | |")
    if "bs8" in lat and "bs8_skinny_gemm" in lat:  # run 20: the skinny GEMM as the variant
        lines.append(f"| bs8 decode tok/s: cuBLAS / skinny GEMM | {lat['bs8']['decode_tok_s']:.0f} / "
                     f"{lat['bs8_skinny_gemm']['decode_tok_s']:.0f} | | |")
    if "bs8" in lat and "bs8_no_skinny_gemm" in lat:
        lines.append(f"| bs8 decode tok/s: skinny GEMM (default) / cuBLAS | {lat['bs8']['decode_tok_s']:.0f} / "
                     f"{lat['bs8_no_skinny_gemm']['decode_tok_s']:.0f} | | |")
    if "bs8" in lat and "eager_bs8" in base:
        ours, theirs = lat["bs8"]["decode_tok_s"], base["eager_bs8"]["decode_tok_s"]
        lines.append(f"| bs8 decode tok/s vs HF eager | {ours:.0f} | {theirs:.0f} | {ours / theirs:.1f}x |")
    if "ttft_1024" in lat and "eager_ttft_1024" in base:
        ours, theirs = lat["ttft_1024"]["ttft_ms"], base["eager_ttft_1024"]["ttft_ms"]
        lines.append(f"| TTFT 1024 vs HF eager (ms) | {ours:.1f} | {theirs:.1f} | {theirs / ours:.2f}x |")
    for variant in ("graph", "graph_no_pdl"):
        prof = r.get("profile", {}).get(variant, {})
        if "wall_ms_per_token" in prof:
            kinds = ", ".join(f"{k} {v:.3f}" for k, v in prof["device_ms_per_token_by_kind"].items())
            lines.append(f"| bs1 decode step ({variant}): wall / device / gaps ms | {prof['wall_ms_per_token']:.3f} / "
                         f"{prof['device_ms_per_token']:.3f} / {prof['gaps_ms_per_token']:.3f} | {kinds} | |")
    if "ttft_1024" in lat:
        lines.append(f"| TTFT 1024 tokens (ms) | {lat['ttft_1024']['ttft_ms']:.1f} | target 35 | |")
    if "startup_s" in lat:
        lines.append(f"| engine start, dummy + graphs (s) | {lat['startup_s']:.1f} | target 60 | |")
    tp = r.get("throughput", {})
    if "output_tok_s" in tp:
        lines.append(f"| throughput output tok/s | {tp['output_tok_s']:.0f} | target 12000 | "
                     f"{tp['output_tok_s'] / 12000:.2f} |")
        tl = tp.get("timeline", {})
        if tl:
            lines.append(f"| throughput: prefill s / decode s | {tl['prefill']['seconds']:.2f} / "
                         f"{tl['decode_seconds']:.2f} | of {tp['elapsed_s']:.2f} s | |")
            lines.append("| decode ms/step by seqs | " + ", ".join(
                f"{k}: {v['ms_per_step']:.2f} x{v['steps']}" for k, v in tl["decode"].items()) + " | | |")
    ag = r.get("agreement", {})
    if "top1_agreement" in ag:
        lines.append(f"| teacher-forced top-1 / cosine | {ag['top1_agreement']:.3f} / {ag['cosine_mean']:.5f} | "
                     f"0.97 / 0.999 | |")
    k = r.get("kernels", {})
    if "all_ok" in k:
        lines.append(f"| kernels vs reference (bf16, 8B shapes) | {'all ok' if k['all_ok'] else 'FAIL'} | | |")
    gr = r.get("graphs", {})
    if gr and "error" not in gr:
        ok = all(v["equal_to_eager"] for k, v in gr.items() if k != "exercised") and all(gr["exercised"].values())
        lines.append(f"| graph == eager greedy (+prefix, +preempt) | {'yes' if ok else 'NO'} | | |")
    sw = r.get("skinny_sweep", {})
    for key, d in sw.get("decode_set", {}).items():
        lines.append(f"| decode set at {key[1:]} rows: cuBLAS / tuned skinny GEMM (ms) | {d['cublas_ms']:.3f} / "
                     f"{d['skinny_tuned_ms']:.3f} | | {d['ratio_cublas_over_skinny']:.3f} |")
    abr = r.get("ab", {})
    for name, v in abr.get("bs1", {}).items():
        lines.append(f"| ab bs1 tok/s, {name} | {v['decode_tok_s']:.1f} | | |")
    for name, per in abr.get("rows", {}).items():
        lines.append(f"| ab tok/s at bs 4 / 8 / 16 / 32, {name} | "
                     + " / ".join(f"{per[b]['decode_tok_s']:.0f}" for b in ("bs4", "bs8", "bs16", "bs32") if b in per)
                     + " | | |")
    for name, v in r.items():
        if isinstance(v, dict) and "error" in v:
            lines.append(f"| {name} | ERROR {v['error'][:60]} | | |")
    return "\n".join(lines)


def main():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser()
    # latency first: its engine start is then a cold one (Triton compiles included)
    p.add_argument("--sections", default="latency,throughput,sampler,profile,profile_batch,kernels,gemv,graphs,"
                                          "agreement,baseline,gpu_tests")
    p.add_argument("--config", default=os.path.join(here, "benchmarks", "configs", "qwen3-8b.json"))
    p.add_argument("--tokenizer-dir", default=os.path.join(here, ".gpu_assets", "tokenizer"))
    p.add_argument("--baseline-modes", default="eager,compile")
    p.add_argument("--gpu-test-filter", default="", help="pytest -k expression for the gpu_tests section")
    p.add_argument("--gpu-test-files", default=",".join(
        f"tests/{name}.py" for name in ("test_phase01_pdl", "test_phase05_attention_kernels", "test_phase05_fused_qkv",
                                        "test_phase01_kernels", "test_phase01_gemv_prologue",
                                        "test_phase05_sampling_kernel", "test_phase05_decode_qkv",
                                        "test_phase05_skinny_gemm", "test_phase05_fp8_kv_cache",
                                        "test_phase09_step_inputs")))
    # test_phase01_gemv is CPU-only (gemv: the sweep)
    p.add_argument("--print-table", action="store_true", help="only print the table of $OUT/gpu_results.json")
    args = p.parse_args()
    if args.print_table:
        with open(os.path.join(OUT, "gpu_results.json")) as f:
            RESULTS.update(json.load(f))
        print(table())
        return
    RESULTS["env"]["copy_bw_GBs"] = copy_bandwidth(torch.device("cuda")) / 1e9
    for name in args.sections.split(","):
        globals()[name](args)
    print(table())
    with open(os.path.join(OUT, "table.md"), "w") as f:
        f.write(table())


if __name__ == "__main__":
    main()
