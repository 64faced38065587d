"""Tuning sweeps and kernel studies (by name only, not in the default run): the GEMV and skinny GEMM
sweeps, cuBLAS by rows, the decode attention launch parameters by context and KV dtype, the sampler."""

from __future__ import annotations

import torch

from tools.gpu_suite.common import error_of, show
from tools.gpu_suite.common import variant as engine_variant

HQ, HK, D, BLOCK = 32, 8, 128, 16  # Qwen3-8B heads, the engine's block size
TABLE_WIDTH = 4096 // BLOCK  # the latency engine's block-table width (max_model_len 4,096)


def gemv(args, results) -> dict:
    """Batch-1 GEMV sweep: Triton configs vs cuBLAS per decode shape, then the whole decode set with the
    winners (the `ab` section runs them in the engine)."""
    from tools.tune_gemv import format_report, sweep

    res = sweep()
    print(format_report(res), flush=True)
    return res


def gemm_rows(args, results) -> dict:
    """The decode set through cuBLAS at 1..256 rows (how far from the weight-streaming floor the batches
    between the GEMV and the compute-bound ones run), the untuned skinny GEMM beside it up to 64 rows."""
    from tools.tune_gemv import cublas_by_rows

    return cublas_by_rows()


def skinny_sweep(args, results) -> dict:
    """The skinny GEMM's configs per (decode shape, row bucket) against cuBLAS, then the decode set at
    8-64 rows with the winning table (the `ab` section runs that table in the engine)."""
    from tools.tune_skinny import sweep

    res = sweep()
    show("skinny_sweep", {"table": res["table"], "decode_set": res["decode_set"]})
    return res


def _tables(batch: int, blocks: int, dev) -> torch.Tensor:
    """Each row its own `blocks` blocks, padded with -1 to the engine's table width."""
    tables = torch.full((batch, TABLE_WIDTH), -1, device=dev, dtype=torch.int32)
    tables[:, :blocks] = torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
    return tables


def _time_layers(call, caches) -> float:
    """us a launch: one CUDA graph of `call` over every (distinct) layer cache."""
    from tools.tune_gemv import time_graph

    return time_graph([lambda c=c: call(c) for c in caches], 10) * 1e3 / len(caches)


def attn_sweep(args, results) -> dict:
    """Batch-1 decode attention at the bs1 bench's contexts per (block_n, min_split_tokens): one graph of
    36 launches over distinct layer caches, PDL where supported. us a launch, against the shipped pair."""
    import metainfer.kernels.attention_decode as attn
    from metainfer.kernels import paged_decode_attention_ref, pdl_supported

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    pdl = pdl_supported(dev)
    shipped = (attn._DECODE_SPLIT_BLOCK_N, attn._DECODE_MIN_SPLIT_TOKENS)  # bs1: a split launch
    res = {"pdl": pdl, "table_width": TABLE_WIDTH, "shipped": shipped, "rows": []}
    contexts = (32, 96, 160, 1024)  # the bs1 bench's contexts run 32..160
    for ctx in contexts:
        blocks = -(-ctx // BLOCK)
        caches = [torch.randn(2, blocks, BLOCK, HK, D, device=dev, dtype=bf16) for _ in range(36)]
        q = torch.randn(1, HQ, D, device=dev, dtype=bf16)
        tables, lens = _tables(1, blocks, dev), torch.tensor([ctx], device=dev, dtype=torch.int32)
        ref = paged_decode_attention_ref(q.float(), caches[0][0].float(), caches[0][1].float(), tables[:, :blocks],
                                         lens, D ** -0.5)
        for block_n in (16, 32, 64):
            for min_split in (32, 64, 128, 256):
                def call(c, block_n=block_n, min_split=min_split, q=q, tables=tables, lens=lens):
                    return attn.paged_decode_attention_triton(q, c[0], c[1], tables, lens, D ** -0.5, block_n=block_n,
                                                              min_split_tokens=min_split, pdl=pdl)
                err = (call(caches[0]).float() - ref).abs().max().item()
                res["rows"].append({"ctx": ctx, "block_n": block_n, "min_split": min_split,
                                    "us": round(_time_layers(call, caches), 3), "max_err": err})
        del caches
    for ctx in contexts:
        rows = [r for r in res["rows"] if r["ctx"] == ctx]
        res[f"ctx{ctx}"] = {"best": min(rows, key=lambda r: r["us"]),
                            "shipped": next(r for r in rows if (r["block_n"], r["min_split"]) == shipped)}
        show(f"ctx {ctx}", res[f"ctx{ctx}"])
    totals: dict = {}
    for r in res["rows"]:
        if r["ctx"] <= 160:
            totals[(r["block_n"], r["min_split"])] = totals.get((r["block_n"], r["min_split"]), 0) + r["us"]
    best = min(totals, key=totals.get)
    res["best_over_bench_contexts"] = {"block_n_min_split": best, "us_sum": totals[best],
                                       "shipped_us_sum": totals[shipped]}
    torch.cuda.empty_cache()
    return res


COMMON = [("default", {}), ("warps4_stages3", dict(num_warps=4, num_stages=3)), ("block_n64", dict(block_n=64)),
          ("block_n128", dict(block_n=128))]
RAGGED = [("default", {}), ("splits2", dict(num_splits=2, block_n=64)), ("splits4", dict(num_splits=4, block_n=64))]
FP8_ONLY = [("tail32", dict(tail_block_n=32))]  # token-major V: the context's tail in 32-token tiles


def _kv_dtype_cases() -> list:
    """(batch, contexts, {cache: variants}): the throughput bench's big steps (256 / 128 x 600, 64 x
    1,088), batch 1 at 160 (a split launch), 256 ragged rows (uniform in [100, 1,100], the bench's
    spread) in random order and longest first (the scheduler's decode order)."""
    uniform = {"bf16": COMMON, "fp8": COMMON + FP8_ONLY}
    ragged = torch.randint(100, 1101, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    return [(256, [600] * 256, uniform), (128, [600] * 128, uniform), (64, [1088] * 64, uniform),
            (1, [160], uniform), (256, ragged, {"bf16": RAGGED, "fp8": RAGGED + FP8_ONLY}),
            (256, sorted(ragged, reverse=True), {"bf16": RAGGED[:1], "fp8": RAGGED[:1] + FP8_ONLY})]


def attn_kv_dtype(args, results) -> dict:
    """Decode attention alone over a bf16 and an fp8 KV cache (V token-major, the engine's fp8 layout),
    launch variants (warps, stages, block_n, splits, tail tiles); us a launch over a graph of 8 launches
    on distinct caches, and the KV read rate. Then 256 x 600 with GQA groups of 1 and 2 (8 and 16 q heads over
    the same 8 kv heads: the same bytes, a quarter and half the real rows of the padded 16-row tiles)."""
    from metainfer.kernels import FP8_KV_DTYPE, paged_decode_attention_ref, paged_decode_attention_triton
    from metainfer.kernels.kv_cache import to_cache_dtype, token_major_copy

    dev, bf16, res = torch.device("cuda"), torch.bfloat16, {}
    # the GQA group probe (session 19's hypothesis, PERFORMANCE "Pending on the GPU" item 3): the same KV bytes
    # read by groups of 1, 2 and 4 q heads a kv head; the default launch only
    probe = [(256, [600] * 256, {c: COMMON[:1] for c in ("bf16", "fp8")}, hq) for hq in (HK, 2 * HK)]
    for batch, ctxs, case_variants, hq in [(*case, HQ) for case in _kv_dtype_cases()] + probe:
        name = f"b{batch}_ctx{ctxs[0]}" if len(set(ctxs)) == 1 else f"b{batch}_ragged{min(ctxs)}-{max(ctxs)}"
        name += "_longest_first" if len(set(ctxs)) > 1 and ctxs == sorted(ctxs, reverse=True) else ""
        name += "" if hq == HQ else f"_group{hq // HK}"
        per_seq = -(-max(ctxs) // BLOCK)
        tables, lens = _tables(batch, per_seq, dev), torch.tensor(ctxs, device=dev, dtype=torch.int32)
        q = torch.randn(batch, hq, D, device=dev, dtype=bf16)
        row = res.setdefault(name, {"mean_ctx": sum(ctxs) / batch})
        for cache_name, cache_dtype in (("bf16", bf16), ("fp8", FP8_KV_DTYPE)):
            caches = []
            for _ in range(8):
                kv = to_cache_dtype(torch.randn(2, batch * per_seq, BLOCK, HK, D, device=dev, dtype=bf16), cache_dtype)
                caches.append((kv[0], token_major_copy(kv[1]) if cache_name == "fp8" else kv[1]))
            kv_bytes = sum(ctxs) * HK * D * 2 * caches[0][0].element_size()
            ref = paged_decode_attention_ref(q.float(), caches[0][0], caches[0][1], tables[:, :per_seq], lens,
                                             D ** -0.5)
            for variant, kw in case_variants[cache_name]:
                def call(c, kw=kw, q=q, tables=tables, lens=lens):
                    return paged_decode_attention_triton(q, c[0], c[1], tables, lens, D ** -0.5, **kw)
                key = f"{cache_name}_{variant}"
                try:  # one failing variant must not lose the section's other rows
                    err = (call(caches[0]).float() - ref).abs().max().item()
                    us = _time_layers(call, caches)
                except Exception as exc:
                    row[key] = error_of(exc)
                    print(f"{name} {key}: FAILED {exc}", flush=True)
                    continue
                row[key] = {"us": round(us, 2), "GBs": round(kv_bytes / us / 1e3, 1), "max_err": err}
                print(f"{name} {key}: {us:.2f} us, {kv_bytes / us / 1e3:.0f} GB/s, err {err:.2e}", flush=True)
            del caches
        torch.cuda.empty_cache()
    return res


def _read_probe_calls(q, tables, lens, probes: bool) -> dict:
    """{name: call(cache pair)}: the engine's decode attention, and with `probes` the read probe's four variants.
    Each pair is (K, V, the same K block-major: tools.kv_read_probe.block_major_k_copy); the `_kblock` calls read the
    latter (the attention, and the loads-only probe at 64 tokens)."""
    from metainfer.kernels import paged_decode_attention_triton
    from tools.kv_read_probe import kv_read_probe

    calls = {"attention": lambda c: paged_decode_attention_triton(q, c[0], c[1], tables, lens, D ** -0.5)}
    for block_n in (64, 128) if probes else ():
        for widen in (False, True):
            calls[f"probe_{'widen' if widen else 'raw'}_n{block_n}"] = (
                lambda c, w=widen, n=block_n: kv_read_probe(c[0], c[1], tables, lens, widen=w, block_n=n))
    for name in ("attention", "probe_raw_n64") if probes else ("attention",):
        calls[f"{name}_kblock"] = lambda c, call=calls[name]: call((c[2], c[1]))
    return calls



def attn_read_probe(args, results) -> dict:
    """What bounds the fp8 decode attention (2.2-2.7 TB/s against bf16's copy rate): at 256 x 600 and 512 x 1,500
    (the 1,000 x 1,000 protocol's rows) over 8 distinct fp8 caches, the engine's kernel against tools/kv_read_probe
    walking the same cache the same way with no math (raw: loads only; widen: loads + the fp16 widening), 64- and
    128-token tiles; the bf16 kernel beside for the copy rate it reaches. us a launch and GB/s of K/V read. `_kblock`
    rows: the same over a block-major K (is the 128-byte row gather the fp8 kernel's bound?)."""
    from metainfer.kernels import FP8_KV_DTYPE
    from metainfer.kernels.kv_cache import to_cache_dtype, token_major_copy
    from tools.kv_read_probe import block_major_k_copy

    dev, bf16, res = torch.device("cuda"), torch.bfloat16, {}
    for batch, ctx in ((256, 600), (512, 1500)):
        per_seq = -(-ctx // BLOCK)
        tables, lens = _tables(batch, per_seq, dev), torch.full((batch,), ctx, device=dev, dtype=torch.int32)
        q = torch.randn(batch, HQ, D, device=dev, dtype=bf16)
        row = res.setdefault(f"b{batch}_ctx{ctx}", {})
        for cache_name, cache_dtype in (("fp8", FP8_KV_DTYPE), ("bf16", bf16)):
            caches = []
            for _ in range(8):
                kv = to_cache_dtype(torch.randn(2, batch * per_seq, BLOCK, HK, D, device=dev, dtype=bf16), cache_dtype)
                caches.append((kv[0], token_major_copy(kv[1]) if cache_name == "fp8" else kv[1],
                               block_major_k_copy(kv[0])))
            kv_bytes = batch * ctx * HK * D * 2 * caches[0][0].element_size()
            for name, call in _read_probe_calls(q, tables, lens, probes=cache_name == "fp8").items():
                key = f"{cache_name}_{name}"
                try:
                    us = _time_layers(call, caches)
                except Exception as exc:  # one failing variant must not lose the others
                    row[key] = error_of(exc)
                    continue
                row[key] = {"us": round(us, 2), "GBs": round(kv_bytes / us / 1e3, 1)}
                print(f"attn_read_probe b{batch} ctx{ctx} {key}: {us:.1f} us, {kv_bytes / us / 1e3:.0f} GB/s",
                      flush=True)
            del caches
            torch.cuda.empty_cache()
    return res


def fp8_k_layout(args, results) -> dict:
    """The fp8 cache's K layout in the engine, end to end (attn_read_probe's `_kblock` rows as a throughput
    figure): nano-vllm's protocol over the engine's fp8 cache (K head-major: 128-byte rows of one kv head, Hk*D
    apart) and over the same pool with each layer's K re-viewed block-major (tools.kv_read_probe.block_major_k_view:
    a block's tokens of one kv head contiguous) before the warm-up and the graph capture, alternated A, B, A. The
    kernels address K through its strides, so the engine's code is unchanged; output tok/s and decode seconds."""
    from unittest import mock

    from metainfer.attention.paged import PagedAttentionBackend
    from metainfer.bench.throughput import run_throughput
    from tools.kv_read_probe import block_major_k_view

    allocate = PagedAttentionBackend.allocate

    def allocate_block_major(self, layers, num_blocks, block_size):
        allocate(self, layers, num_blocks, block_size)
        for i, layer in enumerate(layers):
            layer.k_cache = block_major_k_view(self.pool[0, i])

    def brief(llm) -> dict:
        full = run_throughput(llm, progress=False)
        return {"output_tok_s": full["output_tok_s"], "elapsed_s": full["elapsed_s"],
                "decode_seconds": full["timeline"]["decode_seconds"]}

    res = {}
    for name in ("head_major", "block_major", "head_major_again"):
        if name == "block_major":
            with mock.patch.object(PagedAttentionBackend, "allocate", allocate_block_major):
                res[name] = engine_variant(args, brief, kv_cache_dtype="fp8")
        else:
            res[name] = engine_variant(args, brief, kv_cache_dtype="fp8")
        show(f"fp8_k_layout {name}", res[name])
    return res

def sampler(args, results) -> dict:
    """The torch sampler against the one-pass Gumbel-max kernel on [B, 151936] bf16 logits (greedy and
    temperature 0.6): ms a call (CUDA events, after a warm-up), and the greedy tokens compared."""
    from metainfer.engine.sequence import Sequence
    from metainfer.kernels.sampling import GumbelSampler
    from metainfer.sampling_params import SamplingParams
    from metainfer.worker.sampler import Sampler

    vocab, res = 151936, {}
    kernel = GumbelSampler(256, vocab, "cuda", warmup_dtype=torch.bfloat16)  # every variant compiled here
    paths = {"torch": Sampler(vocab, (0,), "cuda"), "fused": Sampler(vocab, (0,), "cuda", fused=kernel)}
    for batch in (1, 256):
        logits = torch.randn(batch, vocab + 64, device="cuda", dtype=torch.bfloat16) * 3
        for temperature in (0.0, 0.6):
            seqs = [Sequence(f"r{i}", i, [1], SamplingParams(temperature=temperature, max_tokens=8))
                    for i in range(batch)]
            row, tokens = {}, {}
            for name, path in paths.items():
                for _ in range(3):
                    path(logits, seqs)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(20):
                    tokens[name] = path(logits, seqs).token_ids
                end.record()
                end.synchronize()
                row[f"{name}_ms"] = round(start.elapsed_time(end) / 20, 4)
            if temperature == 0.0:
                row["greedy_equal"] = bool(torch.equal(tokens["torch"], tokens["fused"]))
            res[f"b{batch}_t{temperature}"] = row
            show(f"sampler b{batch} t{temperature}", row)
    return res
