"""The MoE families at their real dims with dummy bf16 weights: DeepSeek-V2-Lite (MLA + MoE) and
Qwen3-30B-A3B (GQA + MoE). Per model: engine start, batch-1 decode against the active-weight floor, TTFT of
a 1,024-token prompt, nano-vllm's throughput protocol, HF transformers eager beside, and teacher-forced
agreement with HF bf16 and fp32 at full depth where HF's fp32 model fits the GPU (Qwen3-30B-A3B's 122 GB fits an
H200, not an H100: there it runs 12 of its 48 layers)."""

from __future__ import annotations

import json
import os
import time

import torch

from tools.gpu_suite.common import ROOT, TOKENIZER_FILES, copy_tokenizer, release, save, show

# the depth kept where HF's fp32 model at full depth does not fit the GPU
AGREEMENT_FALLBACK_LAYERS = {"qwen3-30b-a3b": 12}
FP32_HEADROOM = 1.12  # beside the fp32 weights: activations, both logits, the allocator's slack


def agreement_layers(name: str, config: dict, gpu_bytes: int) -> int | None:
    """None (full depth) where HF's fp32 model fits `gpu_bytes` (the GPU's free memory) with headroom, else the
    model's fallback depth."""
    from tools.throughput_floor import model_costs

    costs = model_costs(config)
    params = (costs.dense_params + costs.moe_layers * costs.num_experts * costs.expert_params
              + config["vocab_size"] * config["hidden_size"])  # + the input embedding
    if 4 * params * FP32_HEADROOM <= gpu_bytes:
        return None
    if name not in AGREEMENT_FALLBACK_LAYERS:
        raise ValueError(f"{name}: HF fp32 needs {4 * params / 1e9:.0f} GB, the GPU has {gpu_bytes / 1e9:.0f}, "
                         "and no fallback depth is set")
    return AGREEMENT_FALLBACK_LAYERS[name]


def family_dir(args, name: str, num_layers: int | None = None) -> str:
    """A folder with the model's real config.json (layers cut to `num_layers` where given) and a tokenizer."""
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), f"metainfer-{name}" + (f"-{num_layers}l" if num_layers else ""))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(ROOT, "benchmarks", "configs", f"{name}.json")) as f:
        cfg = json.load(f)
    if num_layers:
        cfg["num_hidden_layers"] = num_layers
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    copy_tokenizer(args.tokenizer_dir, folder)
    assert all(os.path.exists(os.path.join(folder, n)) for n in TOKENIZER_FILES[:1]), "no tokenizer carried"
    return folder


def _engine(folder: str, **kw):
    from metainfer import LLM

    return LLM(folder, **{"load_format": "dummy", "dtype": "bfloat16", "max_model_len": 4096, **kw})


def engine_figures(args, name: str) -> dict:
    from metainfer.bench.latency import run_latency
    from metainfer.bench.throughput import run_throughput
    from tools.gpu_suite.figures import describe_linear

    folder = family_dir(args, name)
    start = time.perf_counter()
    llm = _engine(folder)
    res = {"startup_s": time.perf_counter() - start}
    res["startup_phases_s"] = dict(llm.llm_engine.runner.startup_seconds)  # where a cold start's time goes
    try:
        res["bs1"] = run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=10, warmup=3)
        show(f"{name} bs1", {k: res["bs1"][k] for k in ("decode_tok_s", "tpot_ms", "roofline_tok_s", "bw_ratio")})
        res["profile_bs1"] = decode_profile(llm)
        res["ttft_1024"] = {"ttft_ms": run_latency(llm, batch_size=1, input_len=1024, output_len=2, iters=5)["ttft_ms"]}
        res["bs8"] = run_latency(llm, batch_size=8, input_len=32, output_len=128, iters=2)
        tp = run_throughput(llm, progress=False)
        res["throughput"] = {k: tp[k] for k in ("output_tok_s", "total_tok_s", "elapsed_s")}
        res["throughput"]["decode_seconds"] = tp["timeline"]["decode_seconds"]
        # the prefill steps' count, tokens and time, and the preemptions: an A/B of a prefill-side change (run 81's
        # MoE table) reads them here, not from elapsed - decode
        # the decode steps by rows: each bin against its floor (`tools/schedule_sim` gives the floor's bins)
        res["throughput"].update(prefill=tp["timeline"]["prefill"], preemptions=tp["preemptions"],
                                 decode_bins=tp["timeline"]["decode"])
        runner = llm.llm_engine.runner
        res.update(linear=describe_linear(runner.ops.linear), num_kv_blocks=runner.num_blocks,
                   kv_bytes_per_token=runner.attn_backend.bytes_per_block(len(runner.attention_layers), 1))
        del runner
    finally:
        del llm
        release()
    show(name, {k: v for k, v in res.items() if k not in ("bs1", "bs8")})
    return res


def decode_profile(llm, steps: int = 16) -> dict:
    """Batch-1 decode steps: the wall ms a token at a context of ~40 and of ~150 (where the bs1 bench's 128
    tokens end; run 72 read Qwen3-30B-A3B's 3.66 / 4.74 ms there against the bench's 3.64 over 32-160, measured
    after the profiler then: the walls now come first, and again after it), then under torch.profiler (graphs,
    PDL as built: the profiler books a kernel's PDL wait as its time): device ms a token, launches a token,
    device time by kernel kind, top kernels."""
    from metainfer import SamplingParams
    from tools.gpu_suite.profiles import _device_ms, _drain, _profiled, _wall_ms_per_step, kernel_buckets, top_kernels

    engine = llm.llm_engine
    engine.add_request("profile", {"prompt_token_ids": list(range(200, 232))},
                       SamplingParams(temperature=0, max_tokens=4 * steps + 110, ignore_eos=True), stream=False)
    for _ in range(4):
        engine.step()
    wall_ms = _wall_ms_per_step(engine, steps)
    for _ in range(96 - steps):  # to a context of ~150
        engine.step()
    wall_ms_ctx150 = _wall_ms_per_step(engine, steps)
    prof = _profiled(engine, steps)
    wall_ms_after = _wall_ms_per_step(engine, steps)
    _drain(engine)
    buckets = kernel_buckets(prof, per=steps)
    launches = sum(e.count for e in prof.key_averages() if not e.key.startswith("aten::")) / steps
    return {"wall_ms_per_token": wall_ms, "wall_ms_per_token_ctx150": wall_ms_ctx150,
            "wall_ms_per_token_after_profiler": wall_ms_after, "profiled_context": 32 + 4 + 96 + steps,
            "device_ms_per_token": sum(buckets.values()),
            "launches_per_token": launches, "device_ms_by_kind": buckets, "top_kernels": top_kernels(prof, steps, 15),
            "kernels": sorted(((e.key[:50], e.count / steps, round(_device_ms(e) / steps, 4))
                               for e in prof.key_averages() if not e.key.startswith("aten::")), key=lambda r: -r[2])}


def hf_figures(args, name: str) -> dict:
    from metainfer.bench.baselines import load_hf_model, time_hf

    hf = load_hf_model(family_dir(args, name), torch.bfloat16, torch.device("cuda"), dummy=True)
    try:
        res = {"eager_bs1": time_hf(hf, 1, 32, 128, iters=2, mode="eager"),
               "eager_ttft_1024": time_hf(hf, 1, 1024, 2, iters=3, mode="eager"),
               "experts_implementation": str(getattr(hf.config, "_experts_implementation", None))}
    finally:
        del hf
        release()
    show(f"{name} HF eager", res)
    return res


def family_agreement(args, name: str) -> dict:
    """Teacher-forced top-1 and cosine vs HF bf16, with HF's own bf16-vs-fp32 as the yardstick; the routers
    drawn afresh (std 0.1) so that routing is decided, not a near-tie of a zero-initialised gate."""
    import transformers

    from tools.agreement import compare, copy_hf_weights, hf_logits, hf_to_dtype, teacher_forced_logits

    with open(os.path.join(ROOT, "benchmarks", "configs", f"{name}.json")) as f:
        release()
        layers = agreement_layers(name, json.load(f), torch.cuda.mem_get_info()[0])  # what is free now
    folder = family_dir(args, name, layers)
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf32 = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, param in hf32.named_parameters():
            if pname.endswith("mlp.gate.weight"):
                param.normal_(0, 0.1)
    prompt_len, n = 32, args.agreement_positions
    tokens = torch.randint(0, 10000, (prompt_len + n,), generator=torch.Generator().manual_seed(0))
    ref32 = hf_logits(hf32, tokens, prompt_len, n)
    routers = {p: t.detach().clone() for p, t in hf32.named_parameters() if p.endswith("mlp.gate.weight")}
    hf16 = hf_to_dtype(hf32, torch.bfloat16)
    del hf32
    if config.model_type == "deepseek_v2":  # transformers keeps DeepSeek's router in fp32 (_keep_in_fp32_modules)
        for p, t in routers.items():
            owner, _, leaf = p.rpartition(".")
            setattr(hf16.get_submodule(owner), leaf, torch.nn.Parameter(t, requires_grad=False))
    ref16 = hf_logits(hf16, tokens, prompt_len, n)
    hf16.to("cpu")  # the engine's own copy of the weights is built beside it (Qwen3-30B-A3B: 61 GB each)
    release()
    llm = _engine(folder, max_num_seqs=8, num_kv_blocks=max(64, (prompt_len + n) // 16 + 8))
    copy_hf_weights(llm, hf16)
    del hf16
    release()
    ours = teacher_forced_logits(llm, tokens, prompt_len, n)
    del llm
    release()
    res = {"layers": layers or config.num_hidden_layers, "positions": n,
           "hf_bf16_vs_hf_fp32": compare(ref16, ref32), "ours_bf16_vs_hf_bf16": compare(ours, ref16),
           "ours_bf16_vs_hf_fp32": compare(ours, ref32)}
    show(f"{name} agreement", res)
    return res


def _bs1_variants(default) -> dict:
    """The in-engine A/B's kernel sets, by name: the default first and again last (the run's own noise), between
    them each rule the default replaced while its A/B is pending (DeepSeek only where the op is MLA's)."""
    from dataclasses import replace
    from functools import partial

    return {"default": default,
            # MLA decode without the short-context splits: 64-token splits at every context (session 20)
            "long_splits": replace(default, mla_decode_attention=partial(default.mla_decode_attention,
                                                                         short_split_tokens=64)),
            "default_again": default}


def bs1_ab(args, name: str) -> dict:
    """In one engine, bs1 decode (10 timed iterations each) under each kernel set of _bs1_variants, the CUDA
    graphs re-captured for each; a rule is kept or deleted by this A/B."""
    from metainfer.bench.latency import run_latency

    llm = _engine(family_dir(args, name))
    runner = llm.llm_engine.runner
    res = {}
    try:
        for variant, ops in _bs1_variants(runner.ops).items():
            runner.swap_kernels(ops)
            r = run_latency(llm, batch_size=1, input_len=32, output_len=128, iters=10, warmup=3)
            res[variant] = {k: r[k] for k in ("decode_tok_s", "tpot_ms")}
            print(f"{name} bs1_ab {variant}", round(r["decode_tok_s"], 1), flush=True)
    finally:
        del runner, llm
        release()
    return res


def prefill_ab(args, name: str) -> dict:
    """In one engine, the nano-vllm throughput protocol (and a 1,024-token TTFT) under each MLA prefill rule:
    the expanded form from 1,024 new tokens (the rule before the varlen kernel), from 256, and 1,024 again
    (the run's own noise). DeepSeek only."""
    from metainfer.bench.latency import run_latency
    from metainfer.bench.throughput import run_throughput

    llm = _engine(family_dir(args, name), enable_prefix_caching=False)  # each variant runs the same prompts
    backend = llm.llm_engine.runner.attn_backend
    res = {}
    try:
        for variant, min_q in (("min_q_1024", 1024), ("min_q_256", 256), ("min_q_1024_again", 1024)):
            backend.expanded_min_q = min_q
            t = run_throughput(llm, progress=False)
            ttft = run_latency(llm, batch_size=1, input_len=1024, output_len=2, iters=3, warmup=1)
            res[variant] = {"output_tok_s": t["output_tok_s"], "elapsed_s": t["elapsed_s"],
                            "decode_seconds": t["timeline"]["decode_seconds"], "ttft_1024_ms": ttft.get("ttft_ms")}
            print(f"{name} prefill_ab {variant}", res[variant], flush=True)
    finally:
        del backend, llm
        release()
    return res


def moe_families(args, results) -> dict:
    """Per model of --moe-models, the parts of --moe-parts: engine figures, HF eager, agreement, bs1_ab."""
    res = {}
    parts = {"engine": engine_figures, "hf": hf_figures, "agreement": family_agreement, "bs1_ab": bs1_ab,
             "prefill_ab": prefill_ab}
    for name in args.moe_models.split(","):
        res[name] = {}
        for part in args.moe_parts.split(","):
            fn = parts[part]
            try:
                res[name][part] = fn(args, name)
            except Exception as exc:  # one failing part must not hide the others
                import traceback

                traceback.print_exc()
                res[name][part] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                release()
            results["moe_families"] = res
            save(results)
    return res


def _tool(module: str, argv: list[str], json_name: str) -> dict:
    """Run a kernel tool's main(argv) with its JSON under $OUT; return what it wrote."""
    import importlib

    from tools.gpu_suite.common import out_dir

    path = os.path.join(out_dir(), json_name)
    rc = importlib.import_module(module).main([*argv, "--json", path])
    with open(path) as f:
        return {"rc": rc, "results": json.load(f)}


def tune_moe(args, results) -> dict:
    """tools/tune_moe.py over both MoE shapes (and their tp=2 halves), winners written into the kernel
    configs JSON, which is copied under $OUT (the device's working tree does not come back)."""
    import shutil

    from metainfer.kernels.tuned_configs import config_path
    from tools.gpu_suite.common import out_dir

    shapes = [s for s in args.moe_tune_shapes.split(",") if s]
    argv = ["--write-config", "--budget-s", "200"] + (["--shapes", *shapes] if shapes else [])
    res = _tool("tools.tune_moe", argv, "tune_moe.json")
    path = config_path(torch.cuda.get_device_name())
    shutil.copy(path, os.path.join(out_dir(), os.path.basename(path)))
    return res


def bench_moe(args, results) -> dict:
    """Triton fused MoE vs torch._grouped_mm vs the reference at both shapes (tools/bench_moe.py), at the token
    counts of --moe-bench-tokens (all of the tool's by default)."""
    tokens = [t for t in args.moe_bench_tokens.split(",") if t]
    return _tool("tools.bench_moe", ["--tokens", *tokens] if tokens else [], "bench_moe.json")


def bench_mla(args, results) -> dict:
    """MLA decode vs its latent-read floor; absorbed vs expanded prefill by length (tools/bench_mla.py)."""
    return _tool("tools.bench_mla", ["--budget-s", "90", *args.bench_mla_args.split()], "bench_mla.json")


def mla_split_sweep(args, results) -> dict:
    """MLA decode launch knobs at the engine's table width (tools/bench_mla.py): batch 1 and 8 over short contexts
    per minimum split length and tile (does one pass beat 2-3 splits and their merge at batch 1?), and the
    256-row step's splits, tile, warps and stages."""
    return _tool("tools.bench_mla", ["--split-sweep", "--large-batch-sweep", "--budget-s", "120"],
                 "bench_mla_sweeps.json")


# the batch-1 GEMM shapes of the MoE families (tp=1): DeepSeek-V2-Lite's stacked q + latent projection,
# o_proj, its dense first layer's MLP and LM head; Qwen3-30B-A3B's qkv, o_proj and LM head
MOE_FAMILY_GEMV_SHAPES = {"ds_qkv_a": (3648, 2048), "ds_o_proj": (2048, 2048), "ds_gate_up": (21888, 2048),
                          "ds_down": (2048, 10944), "ds_lm_head": (102400, 2048), "qm_qkv": (5120, 2048),
                          "qm_o_proj": (2048, 4096), "qm_lm_head": (151936, 2048)}


def tune_gemv_moe(args, results) -> dict:
    """The Triton GEMV swept on the MoE families' batch-1 shapes (tools/tune_gemv.py); the shapes where
    it beats cuBLAS are merged into the `gemv` table (used under PDL) and the JSON copied under $OUT."""
    import shutil

    from metainfer.kernels.tuned_configs import config_path
    from tools.gpu_suite.common import out_dir
    from tools.tune_gemv import _key, format_report, sweep, write_tuned_section

    res = sweep(shapes=MOE_FAMILY_GEMV_SHAPES, decode_set=False, multi_row_check=False, time_budget_s=70.0)
    print(format_report(res), flush=True)
    wins = {_key(s["n"], s["k"]): s["best"]["config"] for s in res["shapes"].values()
            if "best" in s and s["best"]["us"] < s["cublas"]["us"]}
    path = write_tuned_section(torch.cuda.get_device_name(), "gemv", wins)
    shutil.copy(path, os.path.join(out_dir(), os.path.basename(config_path(torch.cuda.get_device_name()))))
    return {"wins": wins, "shapes": {name: {"cublas_us": s["cublas"]["us"], "triton_us": s.get("best", {}).get("us")}
                                     for name, s in res["shapes"].items()}}
