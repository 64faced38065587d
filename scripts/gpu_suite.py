"""Every GPU check and benchmark in one call (for the device machine).

Writes $OUT/gpu_results.json (+ the log) and prints a short table last. Sections:
  kernels    Triton vs torch reference at Qwen3-8B shapes, bf16
  graphs     greedy output: CUDA-graph path == eager path; with prefix hits and preemption
  agreement  teacher-forced top-1 / logit cosine vs HF transformers at real dims
  latency    batch-1 decode TPOT, TTFT of a 1,024-token prompt, startup time, bandwidth ratio
  throughput nano-vllm protocol (256 seqs, lengths U[100, 1024])
  baseline   HF transformers eager and static cache + torch.compile at batch 1
  profile    torch.profiler breakdown of decode steps
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
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    print(json.dumps(out, indent=1))
    return out


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
    for name, kw in {"eager": dict(enforce_eager=True), "graph": {},
                     "graph_preempt": dict(num_kv_blocks=60), "eager_no_prefix": dict(enforce_eager=True,
                                                                                     enable_prefix_caching=False)}.items():
        llm = LLM(folder, dtype="float32", max_model_len=1024, max_num_seqs=16, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                         "preemptions": llm.llm_engine.scheduler.num_preemptions,
                         "prefix_hit_tokens": llm.llm_engine.block_manager.prefix_hit_tokens}
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    base = results["eager"]["tokens"]
    summary = {k: {"equal_to_eager": v["tokens"] == base, "preemptions": v["preemptions"],
                   "prefix_hit_tokens": v["prefix_hit_tokens"]} for k, v in results.items()}
    print(json.dumps(summary, indent=1))
    return summary


@section("agreement")
def agreement(args):
    """Teacher-forced vs HF bf16, and (the yardstick) HF bf16 and ours vs HF fp32, same weights."""
    import transformers

    from metainfer.bench.agreement import copy_hf_weights, teacher_forced_logits

    folder = model_dir(args)
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf32 = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompt_len, n = 32, 256
    tokens = torch.randint(0, 10000, (prompt_len + n,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref32 = hf32(tokens[None].cuda()).logits[0, prompt_len - 1:prompt_len + n - 1].float()
        hf16 = hf32.to(torch.bfloat16)
        ref16 = hf16(tokens[None].cuda()).logits[0, prompt_len - 1:prompt_len + n - 1].float()
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8,
              num_kv_blocks=64)  # 288 tokens need 18 blocks; HF already holds much of the memory
    copy_hf_weights(llm, hf16)
    ours = teacher_forced_logits(llm, tokens, prompt_len, n)

    def compare(a, b):
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
        return {"top1": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
                "cos_mean": cos.mean().item(), "cos_min": cos.min().item()}

    result = {"positions": n, "ours_bf16_vs_hf_bf16": compare(ours, ref16),
              "ours_bf16_vs_hf_fp32": compare(ours, ref32), "hf_bf16_vs_hf_fp32": compare(ref16, ref32)}
    result["top1_agreement"] = result["ours_bf16_vs_hf_bf16"]["top1"]
    result["cosine_mean"] = result["ours_bf16_vs_hf_bf16"]["cos_mean"]
    print(json.dumps(result, indent=1))
    del llm, hf16, hf32
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
    bs1 = run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=3)
    ttft = run_latency(llm, batch_size=1, input_len=1024, output_len=2, iters=5)
    bs8 = run_latency(llm, batch_size=8, input_len=32, output_len=128, iters=2)
    bs1_gemv = None
    if args.gemv:  # the same engine with the Triton GEMV for M <= 4 (graphs re-captured)
        from metainfer.kernels.gemv import linear_triton
        for module in llm.llm_engine.runner.model.modules():
            if hasattr(module, "matmul"):
                module.matmul = linear_triton
        llm.llm_engine.runner._capture_cudagraphs()
        bs1_gemv = run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=3)
    runner = llm.llm_engine.runner
    res = {"startup_s": startup, "bs1": bs1, "ttft_1024": {"ttft_ms": ttft["ttft_ms"]}, "bs8": bs8,
           "bs1_triton_gemv": bs1_gemv,
           "num_kv_blocks": runner.num_blocks, "graph_batch_sizes": runner.graph_batch_sizes}
    print(json.dumps(res, indent=1, default=str))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return res


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
    return res


@section("baseline")
def baseline(args):
    from metainfer.bench.baselines import load_hf_model, time_hf

    folder = model_dir(args)
    res = {}
    for mode in args.baseline_modes.split(","):
        hf = load_hf_model(folder, torch.bfloat16, torch.device("cuda"), dummy=True)
        res[mode] = time_hf(hf, 1, 32, 128, iters=2, mode=mode)
        print(mode, json.dumps(res[mode]), flush=True)
        del hf
        torch.cuda.empty_cache()
    return res


@section("profile")
def profile(args):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    folder = model_dir(args)
    out = {}
    for name, kw in {"graph": {}, "eager": dict(enforce_eager=True)}.items():
        llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8, **kw)
        prompt = {"prompt_token_ids": list(range(100, 132))}
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
            torch.cuda.synchronize()
        buckets: dict[str, float] = {}
        for evt in prof.key_averages():
            t = getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0)
            if t <= 0 or evt.key.startswith("cuda") or evt.key.startswith("aten::") or evt.key.startswith("Memcpy"):
                continue
            k = evt.key.lower()
            kind = ("gemm" if any(s in k for s in ("gemm", "gemv", "cutlass", "sm90", "nvjet", "cublas")) else
                    "attention" if any(s in k for s in ("decode", "prefill", "attn", "attention")) else
                    "norm/rotary/act" if any(s in k for s in ("rms", "rotary", "silu", "norm")) else
                    "kv_store" if "store" in k else "other")
            buckets[kind] = buckets.get(kind, 0) + t / 1e3
        top = sorted(((e.key, (getattr(e, "device_time_total", 0) or 0) / 1e3) for e in prof.key_averages()),
                     key=lambda kv: -kv[1])[:15]
        out[name] = {"device_ms_by_kind_32_tokens": buckets, "top_kernels_ms": top}
        print(name, json.dumps(out[name], indent=1), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return out


def table() -> str:
    r = RESULTS
    lines = ["", "| figure | ours | reference | ratio |", "|---|---|---|---|"]
    lat, base = r.get("latency", {}), r.get("baseline", {})
    bs1 = lat.get("bs1", {})
    if "tpot_ms" in bs1:
        lines.append(f"| bs1 decode tok/s | {bs1['decode_tok_s']:.1f} | roofline {bs1.get('roofline_tok_s', 0):.1f} "
                     f"(copy {bs1.get('copy_bw_GBs', 0):.0f} GB/s) | {bs1.get('bw_ratio', 0):.1%} |")
        for mode, b in base.items():
            if isinstance(b, dict) and "decode_tok_s" in b:
                lines.append(f"| bs1 decode tok/s vs HF {mode} | {bs1['decode_tok_s']:.1f} | {b['decode_tok_s']:.1f} | "
                             f"{bs1['decode_tok_s'] / b['decode_tok_s']:.2f}x |")
    if "ttft_1024" in lat:
        lines.append(f"| TTFT 1024 tokens (ms) | {lat['ttft_1024']['ttft_ms']:.1f} | target 35 | |")
    if "startup_s" in lat:
        lines.append(f"| engine start, dummy + graphs (s) | {lat['startup_s']:.1f} | target 60 | |")
    tp = r.get("throughput", {})
    if "output_tok_s" in tp:
        lines.append(f"| throughput output tok/s | {tp['output_tok_s']:.0f} | target 12000 | "
                     f"{tp['output_tok_s'] / 12000:.2f} |")
    ag = r.get("agreement", {})
    if "top1_agreement" in ag:
        lines.append(f"| teacher-forced top-1 / cosine | {ag['top1_agreement']:.3f} / {ag['cosine_mean']:.5f} | "
                     f"0.97 / 0.999 | |")
    k = r.get("kernels", {})
    if "all_ok" in k:
        lines.append(f"| kernels vs reference (bf16, 8B shapes) | {'all ok' if k['all_ok'] else 'FAIL'} | | |")
    gr = r.get("graphs", {})
    if gr and "error" not in gr:
        ok = all(v["equal_to_eager"] for v in gr.values())
        lines.append(f"| graph == eager greedy (+prefix, +preempt) | {'yes' if ok else 'NO'} | | |")
    for name, v in r.items():
        if isinstance(v, dict) and "error" in v:
            lines.append(f"| {name} | ERROR {v['error'][:60]} | | |")
    return "\n".join(lines)


def main():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="kernels,graphs,agreement,latency,throughput,baseline,profile")
    p.add_argument("--config", default=os.path.join(here, "benchmarks", "configs", "qwen3-8b.json"))
    p.add_argument("--tokenizer-dir", default=os.path.join(here, ".gpu_assets", "tokenizer"))
    p.add_argument("--baseline-modes", default="eager,compile")
    p.add_argument("--gemv", action="store_true", help="also time the Triton GEMV variant")
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
