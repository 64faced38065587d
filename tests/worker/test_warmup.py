"""The build-time warm-up (issue 23, item 2): every kernel variant the engine can launch is compiled before the
engine reports ready, so serving never JIT-compiles.

CPU: the plan's shape classes (token counts, query lengths, decode rows, table widths) cover every class a
kernel specialises on; and an engine built on the Triton kernels under the interpreter, with every launch's
variant key recorded (tests/helpers/triton_compiles.py: LaunchKeys, the key JITFunction's cache would look up),
serves prompts of many lengths, prefix hits, chunked prompts, mixed steps and decode batches of every size
without one variant the warm-up did not launch (dense, MLA and MoE families). GPU (marked gpu): Triton's own
compile hook counts zero compilations while serving after start-up, and the cold start is reported.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.kernels import select_ops
from metainfer.worker.cuda_graphs import graph_batch_sizes
from metainfer.worker.warmup import decode_row_counts, warmup_lengths, warmup_plan
from tests.helpers.kernel_devices import ON_GPU
from tests.helpers.tiny_models import build_tiny_model, make_prompts
from tests.helpers.triton_compiles import CompileCounter, LaunchKeys


def _class(n: int) -> str:
    """How Triton specialises a non-constexpr int: 1, a multiple of 16, or other."""
    return "one" if n == 1 else "d16" if n % 16 == 0 else "other"


def _pow2_bucket(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("budget", [1, 7, 16, 100, 8192, 16384])
def test_warmup_lengths_cover_every_int_class_and_power_of_two_bucket(budget):
    lengths = warmup_lengths(budget)
    assert lengths[0] == 1 and lengths[-1] == budget and lengths == sorted(set(lengths))
    want = {(_pow2_bucket(n), _class(n)) for n in range(1, budget + 1)}
    got = {(_pow2_bucket(n), _class(n)) for n in lengths}
    assert got == want, "a (bucket, class) pair a step can reach is not warmed up"
    assert len(lengths) <= 2 * budget.bit_length() + 1


@pytest.mark.parametrize("max_num_seqs", [1, 3, 64, 256, 600])
@pytest.mark.parametrize("configured", [None, (1, 100), (1, 5, 12), (3, 7, 300)])
def test_decode_row_counts_cover_each_graph_bucket_and_the_rows_after_it(max_num_seqs, configured):
    """Every bucket is replayed (its graph's kernels run at the bucket's rows) and every row count's (skinny
    BLOCK_M bucket, int class) is seen (the LM head and the sampler run outside the graph at the batch's own
    rows), for the default buckets and configured ones (EngineConfig.cuda_graph_sizes)."""
    sizes = graph_batch_sizes(max_num_seqs, configured)
    counts = decode_row_counts(max_num_seqs, sizes)
    assert max(counts) == max_num_seqs and min(counts) == 1 and set(sizes) <= set(counts)
    rows = range(1, max_num_seqs + 1)
    assert {(_pow2_bucket(n), _class(n)) for n in counts} == {(_pow2_bucket(n), _class(n)) for n in rows}
    if configured is None:  # the default buckets also meet every (graph bucket, BLOCK_M bucket, class) triple
        bucket_of = {n: next((b for b in sizes if b >= n), None) for n in rows}
        want = {(bucket_of[n], _pow2_bucket(n), _class(n)) for n in rows}
        assert {(bucket_of[n], _pow2_bucket(n), _class(n)) for n in counts} == want


def test_the_plan_has_every_step_kind_within_the_engine_limits():
    budget, max_len, seqs, block = 64, 160, 4, 16
    plan = warmup_plan(budget, max_len, seqs, block, graph_sizes=[1, 2, 4], eager_decode_rows=4)
    kinds = {s.kind for s in plan}
    assert kinds == {"prefill", "prefix", "chunk", "mixed", "decode"}
    for s in plan:
        assert s.new_tokens + s.decode_rows <= budget and s.context + s.new_tokens <= max_len
        assert s.decode_rows <= seqs
    assert {s.new_tokens for s in plan if s.kind == "prefix"} == set(warmup_lengths(budget))
    assert [s.decode_rows for s in plan if s.kind == "decode"] == [1, 2, 3, 4]
    assert all(s.table_width == 0 for s in plan if s.kind == "decode"), "graph buckets need no width sweep"
    eager = warmup_plan(budget, max_len, seqs, block, graph_sizes=[], eager_decode_rows=0)
    assert {s.table_width for s in eager if s.kind == "decode"} == {1, 2, 4, 8, 10}


# -- the engine under the interpreter: serving launches no variant the warm-up did not ---------------------
def _triton_on_cpu(monkeypatch):
    """Engines built on the Triton kernels on the CPU (interpreted); the fused sampler compiles its own
    variants at construction on CUDA and is left out here."""
    import metainfer.worker.model_runner as model_runner

    monkeypatch.setattr(model_runner, "select_ops",
                        lambda device, **kw: select_ops(device, use_triton=True, **{**kw, "fused_sampler": False}))


def _serve_everything(llm, max_tokens=6):
    """Prompts of many lengths (1 to past the token budget: chunked), prefix hits of several suffix lengths,
    arrivals while others decode (mixed steps) and decode batches from 1 to max_num_seqs rows."""
    engine = llm.llm_engine
    shared = make_prompts([40], seed=9)[0]
    prompts = make_prompts([1, 2, 5, 13, 16, 17, 31, 33, 64, 77, 100, 150], seed=2)
    prompts += [shared + t for t in make_prompts([1, 7, 20, 50], seed=3)] + [shared]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kinds, step, queue = set(), 0, list(enumerate(prompts))
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        if batch is not None:
            kinds.add("mixed" if batch.is_mixed else "prefill" if batch.is_prefill else f"decode{len(batch.seqs)}")
        return batch

    engine.scheduler.schedule = recording
    while queue or engine.has_unfinished_requests():
        if queue and step % 3 == 0:
            i, prompt = queue.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
        engine.step()
        step += 1
    batch = make_prompts([3] * engine.config.max_num_seqs, seed=6)  # then a full decode batch
    llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    engine.scheduler.schedule = schedule
    return kinds


def _serve_request_features(llm):
    """What the server passes through (prompt logprobs, penalties, logit bias, seeds, n = 2, min_tokens, min_p),
    the 300-token prompt's prompt logprobs chunked through mixed steps beside the others' decodes; returns the
    outputs and each mixed step's prompt tokens."""
    served = [SamplingParams(max_tokens=6, prompt_logprobs=2, presence_penalty=0.5, seed=7),
              SamplingParams(n=2, temperature=0.8, top_k=5, min_tokens=3, max_tokens=6, logit_bias={5: 2.0}),
              SamplingParams(temperature=1.0, min_p=0.1, repetition_penalty=1.2, frequency_penalty=0.3,
                             max_tokens=6, logprobs=0),
              SamplingParams(max_tokens=4, prompt_logprobs=1, seed=3)]
    scheduler = llm.llm_engine.scheduler
    schedule, mixed = scheduler.schedule, []

    def recording():
        batch = schedule()
        if batch is not None and batch.is_mixed:
            mixed.append(batch.num_prefill_tokens)
        return batch

    scheduler.schedule = recording
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts([9, 40, 130, 300], seed=5)], served,
                            use_tqdm=False)
    finally:
        scheduler.schedule = schedule
    return outs, mixed


def test_start_up_records_each_phase_in_order(tmp_path):
    """Where a cold start's time goes (issue 23: start within 60 s; DeepSeek-V2-Lite's 50.9 s was not broken
    down): every phase of the runner's start-up, the warm-up last, with its wall seconds."""
    build_tiny_model(str(tmp_path), "qwen3")
    start = time.perf_counter()
    llm = LLM(str(tmp_path), device="cpu")
    total = time.perf_counter() - start
    phases = llm.llm_engine.runner.startup_seconds
    assert list(phases) == ["build_and_load", "kv_pool", "sampler", "decode_graphs", "piecewise_graphs", "warm_up"]
    assert all(v >= 0 for v in phases.values()) and sum(phases.values()) <= total
    assert phases["warm_up"] == llm.llm_engine.warmup_seconds


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="the interpreter's launch keys: the GPU counts real compiles (test below)")
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2", "qwen3_moe"])
def test_serving_after_the_warm_up_launches_no_new_kernel_variant(arch, tmp_path, monkeypatch):
    build_tiny_model(str(tmp_path), arch)
    _triton_on_cpu(monkeypatch)
    # the MoE router's ids index the experts: it runs; every other kernel is only recorded
    with LaunchKeys(run_kernels=False, always_run=("_step_inputs_kernel", "_route_topk_kernel")) as keys:
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_batched_tokens=64, max_model_len=160,
                  max_num_seqs=4, block_size=16, async_scheduling=True)
        assert llm.llm_engine.runner.warmup_steps and llm.llm_engine.warmup_seconds > 0
        warm = set(keys.seen)
        keys.seen.clear()
        kinds = _serve_everything(llm)
    assert {"mixed", "prefill", "decode1", "decode4"} <= kinds, kinds
    assert keys.seen, "serving launched no Triton kernel: the instrumentation is not in the path"
    assert llm.llm_engine.block_manager.prefix_hit_tokens >= 4 * 32
    new = sorted(keys.seen - warm)
    assert not new, f"{len(new)} kernel variant(s) first launched while serving: {new[:3]}"


@pytest.mark.slow
@pytest.mark.skipif(ON_GPU, reason="the interpreter's launch keys: the GPU counts real compiles (test below)")
def test_the_check_catches_a_warm_up_that_misses_a_query_length(tmp_path, monkeypatch):
    """The same check with a warm-up of full-budget steps only: the short-query prefill variants (a prefix
    hit's, BLOCK_M 16/32) are first launched while serving, as the 954 ms first hit on the H200 was."""
    import metainfer.worker.model_runner as model_runner

    build_tiny_model(str(tmp_path), "qwen3")
    _triton_on_cpu(monkeypatch)
    real_plan = model_runner.warmup_plan
    monkeypatch.setattr(model_runner, "warmup_plan", lambda budget, *a: [s for s in real_plan(budget, *a)
                                                                        if s.new_tokens in (0, budget)])
    with LaunchKeys(run_kernels=False) as keys:
        llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_batched_tokens=64, max_model_len=160,
                  max_num_seqs=4, block_size=16)
        warm = set(keys.seen)
        _serve_everything(llm, max_tokens=2)
    new = {name for name, _ in keys.seen - warm}
    assert "_prefill_kernel" in new


# -- GPU: Triton's compile hook ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs METAINFER_TEST_GPU=1 and CUDA")
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2", "qwen3_moe"])
@pytest.mark.parametrize("dtype, kv_cache_dtype, graph_sizes, mixed_cap", [
    ("bfloat16", "auto", None, None), ("float32", "auto", None, None), ("bfloat16", "fp8", None, None),
    ("bfloat16", "auto", (1, 5, 12), None), ("bfloat16", "auto", None, 64)])
def test_no_triton_compile_while_serving_after_start_up(arch, dtype, kv_cache_dtype, graph_sizes, mixed_cap,
                                                       tmp_path):
    """mixed_cap: `serve`'s cap on a mixed step's prompt tokens (its steps differ from offline's); the last
    batch asks for what the server passes through (prompt logprobs, penalties, bias, seeds, n > 1)."""
    build_tiny_model(str(tmp_path), arch)
    start = time.perf_counter()
    llm = LLM(str(tmp_path), device="cuda", dtype=dtype, max_num_batched_tokens=256, max_model_len=512,
              max_num_seqs=16, kv_cache_dtype=kv_cache_dtype, cuda_graph_sizes=graph_sizes,
              max_mixed_prefill_tokens=mixed_cap)
    cold_start = time.perf_counter() - start
    print(f"\n{arch} {dtype} kv {kv_cache_dtype}: start-up {cold_start:.1f} s "
          f"(warm-up {llm.llm_engine.warmup_seconds:.1f} s, "
          f"{len(llm.llm_engine.runner.warmup_steps)} steps; Triton cache {os.environ.get('TRITON_CACHE_DIR')})")
    with CompileCounter() as compiles:
        kinds = _serve_everything(llm, max_tokens=24)
        llm.generate([{"prompt_token_ids": p} for p in make_prompts([3] * 16 + [300], seed=4)],
                     SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, logprobs=2), use_tqdm=False)
        outs, mixed_prompt_tokens = _serve_request_features(llm)
        torch.cuda.synchronize()
    assert "mixed" in kinds
    assert outs[0].prompt_logprobs and outs[3].prompt_logprobs and len(outs[1].outputs) == 2
    assert mixed_prompt_tokens and max(mixed_prompt_tokens) <= (mixed_cap or 256), mixed_prompt_tokens
    assert compiles.kernels == [], f"Triton compiled while serving: {compiles.kernels}"
    assert cold_start < 60
