"""The headline figures at Qwen3-8B with dummy weights: batch-1 decode and TTFT, offline throughput
(nano-vllm's protocol), the fp8 KV cache's, and HF transformers' at the same shapes."""

from __future__ import annotations

import time

import torch

from tools.gpu_suite.common import bench_llm, model_dir, on_engine, release, show, variant


def describe_linear(linear) -> str:
    """The engine's GEMM as a short name: the function under any functools.partial, and its pdl flag."""
    func = getattr(linear, "func", linear)
    pdl = getattr(linear, "keywords", {}).get("pdl")
    return getattr(func, "__name__", str(func)) + (f" pdl={pdl}" if pdl is not None else "")


def latency(args, results) -> dict:
    """Batch-1 TPOT with vLLM benchmark_latency's iteration counts (10 warm-up, 30 timed: fewer moved
    the figure by up to 1% between re-captures), TTFT of a 1,024-token prompt, batch 8, and the engine's
    start (run first, the start is a cold one: Triton compiles included)."""
    from metainfer.bench.latency import run_latency

    start = time.perf_counter()
    llm = bench_llm(args)
    startup = time.perf_counter() - start
    try:
        res = {"startup_s": startup,
               "bs1": run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=30, warmup=10),
               "ttft_1024": {"ttft_ms": run_latency(llm, batch_size=1, input_len=1024, output_len=2,
                                                    iters=5)["ttft_ms"]},
               "bs8": run_latency(llm, batch_size=8, input_len=32, output_len=128, iters=2)}
        runner = llm.llm_engine.runner
        res.update(linear=describe_linear(runner.ops.linear), num_kv_blocks=runner.num_blocks,
                   graph_batch_sizes=runner.graph_batch_sizes, startup_phases_s=dict(runner.startup_seconds))
        del runner  # a live reference keeps the model and the KV pool: the next engine would find no memory
    finally:
        del llm
        release()
    show("latency", res)
    return res


def throughput(args, results) -> dict:
    """nano-vllm's protocol (256 sequences, input and output lengths uniform in [100, 1,024]) with the
    bf16 KV cache, then with the fp8 one (half the attention bytes)."""
    from metainfer.bench.throughput import run_throughput

    def brief(llm) -> dict:
        full = run_throughput(llm, progress=False)
        return {**{k: full[k] for k in ("output_tok_s", "total_tok_s", "elapsed_s")},
                "decode_seconds": full["timeline"]["decode_seconds"]}

    res = on_engine(args, lambda llm: run_throughput(llm, progress=False))
    show("throughput", res)
    for name, kw in {"kv_fp8": {"kv_cache_dtype": "fp8"}}.items():
        res[name] = variant(args, brief, **kw)
        show(name, res[name])
    return res


def kv_fp8(args, results) -> dict:
    """The latency figures with an fp8 KV cache: batch 1 and 8, TTFT, and batch 64 at context 1,024
    against the bf16 cache (the pools' block counts beside: both may sit at max_num_seqs x a
    sequence's blocks)."""
    from metainfer.bench.latency import run_latency

    def long_context(llm) -> dict:
        return {"bs64_ctx1024": run_latency(llm, batch_size=64, input_len=1024, output_len=64, iters=1),
                "num_kv_blocks": llm.llm_engine.runner.num_blocks}

    def fp8(llm) -> dict:
        return {"bs1": run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=3),
                "ttft_1024": {"ttft_ms": run_latency(llm, batch_size=1, input_len=1024, output_len=2,
                                                     iters=5)["ttft_ms"]},
                "bs8": run_latency(llm, batch_size=8, input_len=32, output_len=128, iters=2), **long_context(llm)}

    res = on_engine(args, fp8, kv_cache_dtype="fp8")
    bf16 = on_engine(args, long_context)  # the same long-context batch over the bf16 cache
    res["bs64_ctx1024_bf16_cache"], res["bf16_cache"] = bf16["bs64_ctx1024"], {"num_kv_blocks": bf16["num_kv_blocks"]}
    show("kv_fp8", res)
    return res


def baseline(args, results) -> dict:
    """HF transformers at the latency section's shapes: bs1 eager and static cache + torch.compile,
    bs8 and a 1,024-token TTFT eager (one compile costs ~45 s; bs8 would need a second one)."""
    from metainfer.bench.baselines import load_hf_model, time_hf

    folder, res = model_dir(args), {}
    for mode in args.baseline_modes.split(","):
        hf = load_hf_model(folder, torch.bfloat16, torch.device("cuda"), dummy=True)
        res[mode] = time_hf(hf, 1, 32, 128, iters=2, mode=mode)
        show(mode, res[mode])
        if mode == "eager":
            res["eager_bs8"] = time_hf(hf, 8, 32, 128, iters=2, mode="eager")
            res["eager_ttft_1024"] = time_hf(hf, 1, 1024, 2, iters=3, mode="eager")
            show("eager bs8 / ttft", [res["eager_bs8"], res["eager_ttft_1024"]])
        del hf
        release()
    return res
