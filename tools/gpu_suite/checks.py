"""Correctness on the GPU: kernels against their references at real shapes, the CUDA-graph path against
eager, and the test files compiled on the GPU (pytest in a subprocess)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import torch

from tools.gpu_suite.common import ROOT, copy_tokenizer, ensure_packages, out_dir, release, show

HQ, HK, D, HIDDEN, INTER = 32, 8, 128, 4096, 12288  # Qwen3-8B


def _comparer(out: dict):
    def compare(name, got, ref, tol=2e-2):
        err = (got.float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item() + 1e-6
        out[name] = {"max_abs_err": err, "rel_err": err / scale, "ok": err / scale < tol}
    return compare


def _elementwise(compare, dev, dt):
    from metainfer.kernels import REF_OPS, TRITON_OPS, build_cos_sin_cache

    x = torch.randn(4096, HIDDEN, device=dev, dtype=dt)
    w = torch.randn(HIDDEN, device=dev, dtype=dt)
    compare("rms_norm", TRITON_OPS.rms_norm(x, w, 1e-6), REF_OPS.rms_norm(x, w, 1e-6))
    r1 = torch.randn_like(x)
    r2 = r1.clone()  # before the Triton call, which adds into r1 in place
    y1, res1 = TRITON_OPS.fused_add_rms_norm(x.clone(), r1, w, 1e-6)
    y2, res2 = REF_OPS.fused_add_rms_norm(x.clone(), r2, w, 1e-6)
    compare("fused_add_rms_norm", y1, y2)
    compare("fused_add_residual", res1, res2)
    g = torch.randn(4096, 2 * INTER, device=dev, dtype=dt)
    compare("silu_and_mul", TRITON_OPS.silu_and_mul(g), REF_OPS.silu_and_mul(g))
    cache = build_cos_sin_cache(D, 40960, 1e6, None).to(dev)
    pos = torch.randint(0, 40000, (4096,), device=dev)
    q, k = torch.randn(4096, HQ * D, device=dev, dtype=dt), torch.randn(4096, HK * D, device=dev, dtype=dt)
    qa, ka = TRITON_OPS.rotary_neox(pos, q.clone(), k.clone(), cache, D)
    qb, kb = REF_OPS.rotary_neox(pos, q.clone(), k.clone(), cache, D)
    compare("rotary_q", qa, qb)
    compare("rotary_k", ka, kb)
    return cache


def _attention(compare, out, dev, dt):
    """Decode and prefill over bf16 caches (block sizes 16 and 32) and an fp8 cache (K block-major, V token-major:
    the engine's fp8 layouts); the K/V store into bf16 caches."""
    from metainfer.kernels import FP8_KV_DTYPE, REF_OPS, TRITON_OPS
    from metainfer.kernels.kv_cache import fp8_cache_copy, to_cache_dtype

    nb, lens, qlens = 4096, [1, 17, 500, 4096, 1023, 2049, 64, 3000], [1, 17, 500, 1024, 1023, 33, 64, 700]
    for bs, cache_dtype in ((16, dt), (32, dt), (16, FP8_KV_DTYPE)):
        tag = f"bs{bs}" + ("_fp8" if cache_dtype == FP8_KV_DTYPE else "")
        kc = to_cache_dtype(torch.randn(nb, bs, HK, D, device=dev, dtype=dt), cache_dtype)
        vc = to_cache_dtype(torch.randn(nb, bs, HK, D, device=dev, dtype=dt), cache_dtype)
        if cache_dtype == FP8_KV_DTYPE:
            kc, vc = fp8_cache_copy(kc, vc)
        width = max(lens) // bs + 1
        tables = torch.randperm(nb, device=dev)[: len(lens) * width].view(len(lens), width).int()
        ctx = torch.tensor(lens, device=dev, dtype=torch.int32)
        qd = torch.randn(len(lens), HQ, D, device=dev, dtype=dt)
        compare(f"decode_attention_{tag}", TRITON_OPS.paged_decode_attention(qd, kc, vc, tables, ctx, D ** -0.5),
                REF_OPS.paged_decode_attention(qd, kc, vc, tables, ctx, D ** -0.5))
        cu = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), device=dev, dtype=torch.int32)
        qp = torch.randn(sum(qlens), HQ, D, device=dev, dtype=dt)
        compare(f"prefill_attention_{tag}",
                TRITON_OPS.paged_prefill_attention(qp, kc, vc, cu, ctx, tables, max(qlens), D ** -0.5),
                REF_OPS.paged_prefill_attention(qp, kc, vc, cu, ctx, tables, max(qlens), D ** -0.5))
        if cache_dtype == FP8_KV_DTYPE:
            continue
        slots = torch.randperm(nb * bs, device=dev)[:4096].int()
        slots[::7] = -1
        kn, vn = torch.randn(4096, HK, D, device=dev, dtype=dt), torch.randn(4096, HK, D, device=dev, dtype=dt)
        a_k, a_v, b_k, b_v = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        TRITON_OPS.store_kv(kn, vn, a_k, a_v, slots)
        REF_OPS.store_kv(kn, vn, b_k, b_v, slots)
        out[f"store_kv_{tag}"] = {"ok": bool(torch.equal(a_k, b_k) and torch.equal(a_v, b_v))}


def kernels(args, results) -> dict:
    """Triton vs torch reference at Qwen3-8B shapes, bf16: elementwise ops, rotary, paged attention
    (bf16 and fp8 caches), the K/V store and the fused q/k norm + rope + store at decode and prefill sizes."""
    from metainfer.kernels.qkv_prep import qk_norm_rope_store_ref, qk_norm_rope_store_triton

    torch.manual_seed(0)
    dev, dt, out = "cuda", torch.bfloat16, {}
    compare = _comparer(out)
    cos_sin = _elementwise(compare, dev, dt)
    _attention(compare, out, dev, dt)
    for tokens in (1, 8, 4096):  # decode bs1, bs8 and a prefill chunk
        nb, bs = 512, 16
        qkv = torch.randn(tokens, (HQ + 2 * HK) * D, device=dev, dtype=dt)
        pos = torch.randint(0, 40000, (tokens,), device=dev)
        slots = torch.randperm(nb * bs, device=dev)[:tokens].int()
        qn, kn = 1 + 0.3 * torch.randn(D, device=dev, dtype=dt), 1 + 0.3 * torch.randn(D, device=dev, dtype=dt)
        caches = [torch.randn(nb, bs, HK, D, device=dev, dtype=dt) for _ in range(2)]
        caches += [c.clone() for c in caches]  # the same untouched slots on both sides
        got = qk_norm_rope_store_triton(qkv.clone(), pos, cos_sin, qn, kn, 1e-6, caches[0], caches[1], slots,
                                        HQ, HK, D)
        ref = qk_norm_rope_store_ref(qkv.clone(), pos, cos_sin, qn, kn, 1e-6, caches[2], caches[3], slots, HQ, HK, D)
        compare(f"qk_norm_rope_store_T{tokens}_q", got[0], ref[0])
        compare(f"qk_norm_rope_store_T{tokens}_k", got[1], ref[1])
        compare(f"qk_norm_rope_store_T{tokens}_kcache", caches[0], caches[2])
        out[f"qk_norm_rope_store_T{tokens}_vcache"] = {"ok": bool(torch.equal(caches[1], caches[3]))}
    out["all_ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    show("kernels", out)
    return out


# name -> LLM keywords; a kv_fp8 / fp16 run is compared with its own eager run (fp8 changes the tokens)
GRAPH_VARIANTS = {
    "eager": dict(enforce_eager=True, async_scheduling=False),
    "graph": {},  # async scheduling (the CUDA default)
    "graph_no_pdl": dict(enable_pdl=False),
    "graph_torch_sampler": dict(enable_fused_sampler=False),  # greedy: fused == torch argmax
    "graph_sync": dict(async_scheduling=False),
    "graph_preempt": dict(num_kv_blocks=60, kv_reserve_ratio=0.0),  # greedy admission: it preempts
    "eager_async_preempt": dict(enforce_eager=True, num_kv_blocks=60, kv_reserve_ratio=0.0),
    "eager_no_prefix": dict(enforce_eager=True, enable_prefix_caching=False),
    "eager_kv_fp8": dict(enforce_eager=True, async_scheduling=False, kv_cache_dtype="fp8"),
    "graph_kv_fp8": dict(kv_cache_dtype="fp8"),
    "graph_kv_fp8_preempt": dict(kv_cache_dtype="fp8", num_kv_blocks=60, kv_reserve_ratio=0.0),
    # an fp16 model over the fp8 cache (16-bit q and fp8 products in fp16)
    "eager_kv_fp8_fp16": dict(enforce_eager=True, async_scheduling=False, kv_cache_dtype="fp8", dtype="float16"),
    "graph_kv_fp8_fp16": dict(kv_cache_dtype="fp8", dtype="float16"),
    "graph_kv_fp8_fp16_preempt": dict(kv_cache_dtype="fp8", num_kv_blocks=60, kv_reserve_ratio=0.0,
                                      dtype="float16"),
}
PREEMPTING = [name for name, kw in GRAPH_VARIANTS.items() if "num_kv_blocks" in kw]


def eager_reference(name: str) -> str:
    if "kv_fp8" not in name:
        return "eager"
    return "eager_kv_fp8_fp16" if "fp16" in name else "eager_kv_fp8"


def small_config(family: str):
    """The graphs check's small fp32 model: the dense family, DeepSeek-V2 (MLA + MoE with a shared expert and
    a dense first layer) or Qwen3-MoE (a dense layer among MoE ones); routers drawn wide (initializer 0.3) so
    routing is decided, not a tie."""
    import transformers

    common = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                  max_position_embeddings=2048, initializer_range=0.3)
    if family == "qwen3":
        return transformers.Qwen3Config(intermediate_size=512, num_key_value_heads=2, head_dim=64, **common)
    if family == "deepseek_v2":
        return transformers.DeepseekV2Config(
            intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None, qk_nope_head_dim=32,
            qk_rope_head_dim=16, v_head_dim=32, num_key_value_heads=8, topk_method="greedy", **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[1], num_key_value_heads=2, head_dim=64, norm_topk_prob=True, **common)
    raise ValueError(f"--graph-family must be qwen3, deepseek_v2 or qwen3_moe, got {family!r}")


def graphs(args, results) -> dict:
    """A small fp32 model: graph replay (async and sync, kill switches off, preemption, fp8 KV) must give
    the eager greedy tokens exactly; the prompts share a 96-token prefix, sent in two waves (prefix hits)."""
    import transformers

    from metainfer import LLM, SamplingParams

    folder = os.path.join(tempfile.gettempdir(), f"metainfer-small-{args.graph_family}")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(small_config(args.graph_family)).save_pretrained(folder)
    copy_tokenizer(args.tokenizer_dir, folder)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 4096, (96,), generator=g).tolist()
    prompts = [{"prompt_token_ids": shared + torch.randint(0, 4096, (n,), generator=g).tolist()} for n in
               (1, 5, 40, 200, 7, 64, 300, 2)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = {}
    for name, kw in GRAPH_VARIANTS.items():
        llm = LLM(folder, **{"dtype": "float32", **kw}, max_model_len=1024, max_num_seqs=16)
        outs = llm.generate(prompts[:1], params, use_tqdm=False) + llm.generate(prompts[1:], params, use_tqdm=False)
        runs[name] = {"tokens": [o.outputs[0].token_ids for o in outs],
                      "preemptions": llm.llm_engine.scheduler.num_preemptions,
                      "prefix_hit_tokens": llm.llm_engine.block_manager.prefix_hit_tokens}
        del llm
        release()
    summary = {name: {"equal_to_eager": run["tokens"] == runs[eager_reference(name)]["tokens"],
                      "preemptions": run["preemptions"], "prefix_hit_tokens": run["prefix_hit_tokens"]}
               for name, run in runs.items() if eager_reference(name) != name}
    summary["family"] = args.graph_family  # the small model's (checks.small_config)
    summary["exercised"] = {  # the comparison means something only if these happened
        "prefix_hits": all(v["prefix_hit_tokens"] >= 96 for k, v in runs.items() if k != "eager_no_prefix"),
        "preemptions": all(runs[k]["preemptions"] > 0 for k in PREEMPTING),
        "fp8_changes_tokens": runs["eager_kv_fp8"]["tokens"] != runs["eager"]["tokens"],
    }
    show("graphs", summary)
    return summary


def progress_counts(output: str) -> dict:
    """What pytest's -q progress lines ("..s.F  [ 42%]", the last one maybe unfinished) say ran: the counts of
    a run cut off before its JUnit XML was written."""
    marks = ""
    for line in output.splitlines():
        head = line.split(" [")[0].rstrip() if line.rstrip().endswith("%]") else line.strip()
        if head and set(head) <= set(".sFExX"):
            marks += head
    return {"passed": marks.count("."), "skipped": marks.count("s"), "failed": marks.count("F"),
            "errors": marks.count("E")}


def summarize_tests(counts: dict, failed: list[str]) -> list[str]:
    return [f"{counts.get('tests', 0)} tests, {counts.get('failures', 0)} failed, {counts.get('errors', 0)} errors, "
            f"{counts.get('skipped', 0)} skipped"] + failed


def pytest_on_gpu(files: list[str], timeout: float, marker: str = "", test_filter: str = "",
                  workers: int = 1, output_name: str = "gpu_tests_output.txt") -> dict:
    """Test files compiled on the GPU (METAINFER_TEST_GPU=1: no Triton interpreter, bf16 too). Counts come
    from pytest's JUnit XML (from the progress lines if the timeout cut it off); the whole output is kept in
    $OUT/<output_name>. `workers` > 1: pytest-xdist processes sharing the GPU, a file to a process
    (most of the time is Triton compiling, on the CPU: 16 cores there)."""
    env = dict(os.environ, METAINFER_TEST_GPU="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               METAINFER_SHARED_GPU_TIMEOUT="60",
               METAINFER_TEST_TOKENIZER_DIR=os.path.join(ROOT, ".gpu_assets", "tokenizer"))
    junit = os.path.join(tempfile.gettempdir(), "metainfer-gpu-tests.xml")
    if os.path.exists(junit):
        os.remove(junit)
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *(["-m", marker] if marker else []), *(["-k", test_filter] if test_filter else [])]
    if workers > 1:
        try:
            ensure_packages({"xdist": "pytest-xdist"})
            cmd += ["-n", str(workers), "--dist", "loadfile"]
        except subprocess.CalledProcessError:  # no wheels carried: one process, as before
            print("gpu_tests: pytest-xdist not installable from .gpu_assets/wheels; one process", flush=True)
            workers = 1
    # its own session, so a timeout ends the xdist workers with it (they hold GPU memory the next sections need)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, returncode = proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:  # keep what it printed: the tests that ran are counted there
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0] + f"\n(timed out after {timeout:.0f} s)"
        returncode = "timeout"
    os.makedirs(out_dir(), exist_ok=True)
    with open(os.path.join(out_dir(), output_name), "w") as f:
        f.write(output)
    counts, failed = {}, []
    if os.path.exists(junit):
        for suite in ET.parse(junit).getroot().iter("testsuite"):
            for key in ("tests", "failures", "errors", "skipped"):
                counts[key] = counts.get(key, 0) + int(suite.get(key, 0))
            failed += [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                       if c.find("failure") is not None or c.find("error") is not None]
    if not counts:
        partial = progress_counts(output)
        counts = {"tests": sum(partial.values()), "failures": partial["failed"], "errors": partial["errors"],
                  "skipped": partial["skipped"], "from_progress_lines": True}
    tail = output[-3000:]
    print(tail, flush=True)
    summary = summarize_tests(counts, failed)
    return {"files": files, "marker": marker, "workers": workers, "counts": counts, "failed": failed,
            "summary": summary, "returncode": returncode, "output_tail": tail}


def allreduce(args, results) -> dict:
    """The custom all-reduce's tests with two processes sharing GPU 0 (where the driver allows it)."""
    return pytest_on_gpu(["tests/distributed/test_custom_all_reduce.py"], timeout=200)


def gpu_tests(args, results) -> dict:
    """The kernel tests compiled on the GPU: races the interpreter cannot show (the split-KV merge by the
    last split to finish), bf16, the compiled GEMV, skinny GEMM and fused q/k kernels. The timeout is what
    is left of --budget-s; with under --quick-below-s left, only the tests not marked slow run. Files under
    tests/kernels run over --gpu-test-workers processes (they hold tensors, no engine); the others first, in
    one process: an engine sizes its KV pool from the GPU's free memory, so it must not share the GPU."""
    files = args.gpu_test_files.split(",")
    shared = [f for f in files if args.gpu_test_workers > 1 and f.rstrip("/").startswith("tests/kernels")]
    alone = [f for f in files if f not in shared]
    parts = []
    for group, workers, name in ((alone, 1, "gpu_tests_output.txt"),
                                 (shared, args.gpu_test_workers, "gpu_tests_output_workers.txt")):
        if group:
            left = args.budget_s - (time.perf_counter() - args.started)
            marker = args.gpu_test_marker or ("not slow" if left < args.quick_below_s else "")
            parts.append(pytest_on_gpu(group, timeout=max(left - 15, 60), marker=marker,
                                       test_filter=args.gpu_test_filter, workers=workers, output_name=name))
    return parts[0] if len(parts) == 1 else merge_test_runs(parts)


def merge_test_runs(parts: list[dict]) -> dict:
    """One record of several pytest_on_gpu runs: counts added, failures listed, the first bad return code."""
    counts = {key: sum(p["counts"].get(key, 0) for p in parts) for key in ("tests", "failures", "errors", "skipped")}
    if any(p["counts"].get("from_progress_lines") for p in parts):
        counts["from_progress_lines"] = True
    failed = [name for part in parts for name in part["failed"]]
    summary = summarize_tests(counts, failed)
    returncode = next((p["returncode"] for p in parts if p["returncode"] != 0), 0)
    return {"files": [f for p in parts for f in p["files"]], "parts": parts, "counts": counts, "failed": failed,
            "summary": summary, "returncode": returncode}
