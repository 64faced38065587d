"""The adversarial suite, on both backends (torch CPU and MLX): the engine under the inputs and loads that
break engines, each checked against an independent reference (HF transformers' greedy output, or HF's
teacher-forced argmax) or an invariant that a wrong engine violates.

determinism (10 runs identical, greedy and seeded sampling), long-sequence decay (2,000 generated tokens, no
NaN, HF's argmax agrees), long-prefill cost linear in length, KV block boundaries (block_size - 1 / block_size /
block_size + 1 prompts), KV full (preemption and recovery, nothing lost), latency jitter (p99/p50 of per-token
time reported), edge cases (1-token prompt, max_tokens=1, empty stop lists, unicode), multi-turn chat with
prefix-cache hits. Figures a test measures are printed (`-s` shows them). Tests over ~5 s on 2 busy cores (the
torch CPU path's determinism, KV-full and jitter runs took 25-32 s at a load of 8) are marked slow.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import BACKENDS, assert_drained, generate_ids
from tests.helpers.tiny_models import assert_matches_hf, build_tiny_model, hf_greedy, make_prompts

BLOCK = 16


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A tiny Qwen3 whose positions reach past 2,000 tokens, and HF's model of it."""
    folder = str(tmp_path_factory.mktemp("adversarial-qwen3"))
    model = build_tiny_model(folder, "qwen3", max_position_embeddings=4096)
    return folder, model


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, reference):
    folder, _ = reference
    llm = LLM(folder, device=request.param, dtype="float32", max_model_len=4096, num_kv_blocks=512)
    yield llm
    assert_drained(llm)


def _greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.slow
def test_determinism_ten_runs_identical(engine):
    prompts = make_prompts([7, 23, 40], seed=11)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    first_greedy = generate_ids(engine, prompts, _greedy(24))
    first_sampled = generate_ids(engine, prompts, sampled)
    for _ in range(9):
        engine.llm_engine.block_manager.hash_to_block.clear()  # each run computes, not only reads the cache
        assert generate_ids(engine, prompts, _greedy(24)) == first_greedy
        assert generate_ids(engine, prompts, sampled) == first_sampled
    assert first_sampled != first_greedy  # the seeded runs really sampled


@pytest.mark.slow
def test_long_sequence_decay_2000_tokens_agrees_with_hf_teacher_forced(engine, reference):
    """2,000 greedy tokens: every logprob finite, and HF's argmax over our own sequence (one teacher-forced
    forward) equals our token at >= 99% of steps, every disagreement a near-tie (no drift, no collapse)."""
    _, model = reference
    prompt = make_prompts([12], seed=5)[0]
    out = engine.generate({"prompt_token_ids": prompt}, _greedy(2000, logprobs=0), use_tqdm=False)[0].outputs[0]
    tokens = out.token_ids
    assert len(tokens) == 2000
    assert all(math.isfinite(lp[t]) for lp, t in zip(out.logprobs, tokens))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1)
    ours = torch.tensor(tokens)
    disagree = (top2.indices[:, 0] != ours).nonzero().flatten()
    margins = (top2.values[:, 0] - top2.values[:, 1])[disagree]
    print(f"\n[{engine.llm_engine.config.device}] decay: {len(disagree)} of 2000 steps differ from HF's argmax, "
          f"{len(set(tokens))} distinct tokens")
    assert len(disagree) <= 20, f"{len(disagree)} of 2000 steps disagree with HF's argmax"
    assert (margins < 1e-3).all(), f"a disagreement with a clear HF margin: {margins.max().item():.3g}"
    assert all(t in top2.indices[i].tolist() for i, t in zip(disagree.tolist(), ours[disagree].tolist()))


def _attention_op(engine, n: int):
    """One layer's attention of an n-token prefill, as a callable: the backend's own op at the model's shapes
    (torch: the paged prefill reference over a pool; MLX: the context K/V gathered from a pool, then
    mx.fast.scaled_dot_product_attention with a causal mask)."""
    spec = engine.llm_engine.config.spec
    scale = spec.head_dim ** -0.5
    if engine.llm_engine.config.device == "mlx":
        import mlx.core as mx

        q = mx.random.normal((1, spec.num_heads, n, spec.head_dim))
        pool = mx.random.normal((n, spec.num_kv_heads, spec.head_dim))
        slots = mx.arange(n)
        mx.eval(q, pool, slots)

        def attend():
            k = pool[slots].transpose(1, 0, 2)[None]
            v = pool[slots].transpose(1, 0, 2)[None]
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal"))
    else:
        from metainfer.kernels import paged_prefill_attention_ref

        q = torch.randn(n, spec.num_heads, spec.head_dim)
        cache = torch.randn(n // BLOCK, BLOCK, spec.num_kv_heads, spec.head_dim)
        lens = torch.tensor([0, n], dtype=torch.int32)
        table = torch.arange(n // BLOCK, dtype=torch.int32)[None]

        def attend():
            paged_prefill_attention_ref(q, cache, cache, lens, lens[1:], table, n, scale)
    return attend


PREFILL_LENGTHS = (256, 512, 1024, 2048)
PREFILL_REPEATS = 5


@pytest.mark.slow
def test_long_prefill_cost_is_linear_in_length(engine):
    """Prefill time per prompt token at 256 .. 2,048 tokens (max_tokens=1), less what the attention op itself
    costs at the same shapes: attention's T^2 work is real on both backends at these dims (64 wide, 2 layers): on
    torch about half of a 2,048-token prefill on 2 threads, ~70% on one (the CI run that counted it as 0 failed at
    2.01x); on MLX ~7x the linear layers' at 2,048 (docs/PERFORMANCE.md). What attention does not explain may
    grow, from 256 to 2,048 tokens, by at most 2x the 256-token cost a token (3x in all); on MLX the whole cost a
    token may also at most double from 1,024 to 2,048 tokens (+50% for shared-core noise).

    On shared cores a run is only ever slowed, so each figure is the fastest of PREFILL_REPEATS (the median of 3
    failed once at 2,048 tokens beside the suite's other worker, 3.2x, and passed alone), and the runs are
    interleaved: every round times each length's prefill and then its attention op back to back (the lengths in
    turn forward, then backward), so a burst of load slows some run of each figure rather than every run of one.
    The figures used to be taken length by length (the prefill's 3 runs, then the op's): the difference of two
    large numbers (on MLX attention is ~90% of a 2,048-token prefill) took a burst that fell on one of them
    whole, and failed at 3.53x under load. Torch runs one thread here: with its 2 threads on 2 cores that other
    processes keep busy, a 256-token prefill took 800-1,200 us a token against ~15 alone (each op's threads wait
    for the one descheduled), in bursts no length escapes; on one thread, under the same load, single runs took
    12-49 us a token. The linear-or-not question does not depend on the thread count. METAINFER_PREFILL_JSON
    names a file to record the figures in."""
    device = engine.llm_engine.config.device
    layers = engine.llm_engine.config.spec.num_layers
    prompts = {n: make_prompts([n], seed=n)[0] for n in PREFILL_LENGTHS}
    attend = {n: _attention_op(engine, n) for n in PREFILL_LENGTHS}
    prefill_s = {n: [] for n in PREFILL_LENGTHS}
    attention_s = {n: [] for n in PREFILL_LENGTHS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the docstring: torch's threads on busy cores wait on each other, not on work
    try:
        for n in PREFILL_LENGTHS:  # warm each shape
            engine.generate({"prompt_token_ids": prompts[n]}, _greedy(1), use_tqdm=False)
            attend[n]()
        for r in range(PREFILL_REPEATS):
            for n in PREFILL_LENGTHS if r % 2 == 0 else PREFILL_LENGTHS[::-1]:
                engine.llm_engine.block_manager.hash_to_block.clear()  # each run computes, not only reads the cache
                start = time.perf_counter()
                engine.generate({"prompt_token_ids": prompts[n]}, _greedy(1), use_tqdm=False)
                prefill_s[n].append(time.perf_counter() - start)
                start = time.perf_counter()
                attend[n]()
                attention_s[n].append((time.perf_counter() - start) * layers)
    finally:
        torch.set_num_threads(threads)
    per_token = {n: min(prefill_s[n]) / n for n in PREFILL_LENGTHS}
    attention = {n: min(attention_s[n]) / n for n in PREFILL_LENGTHS}
    ratio = per_token[2048] / per_token[256]
    # growth of the cost a token from 256 to 2,048 tokens that the attention op does not explain, measured against
    # the 256-token cost a token, so the subtraction's noise on busy cores cannot make a ratio of noise. What the
    # bound still catches: a cost quadratic in the length T (a per-token loop over the prompt, a copy of it per
    # token) is c*T a token, 8x as much at 2,048 as at 256, so it grows by 7x its own 256-token share q. A
    # quadratic part beyond attention breaks the bound of 2 once q > 2/7 (29% of the 256-token cost a token); the
    # non-attention cost quadratic as a whole gives 7 * (1 - attention's share at 256): ~5x on torch (one thread:
    # attention ~28% of the 256-token cost) and ~3x on MLX (~55%). A sleep of q=0.5 added to each request, in
    # proportion to T^2, measured 2.8x (torch) and 3.1x (MLX) at a load of 3 on 2 cores; the engine as it is,
    # -0.3x to +0.25x there.
    unexplained = (per_token[2048] - per_token[256]) - (attention[2048] - attention[256])
    print(f"\n[{device}] prefill us/token: " + ", ".join(f"{n}: {t * 1e6:.1f}" for n, t in per_token.items())
          + f"; 2048/256 ratio {ratio:.2f}; attention op us/token: "
          + ", ".join(f"{n}: {t * 1e6:.1f}" for n, t in attention.items())
          + f"; growth not explained by attention {unexplained / per_token[256]:.2f}x the 256-token cost")
    path = os.environ.get("METAINFER_PREFILL_JSON")  # a record of the figures (docs/results/ cites one)
    if path:
        record = json.load(open(path)) if os.path.exists(path) else {}
        record[device] = {"prompt_tokens": list(per_token), "us_per_token": [t * 1e6 for t in per_token.values()],
                          "attention_op_us_per_token": [t * 1e6 for t in attention.values()],
                          "ratio_2048_over_256": ratio, "unexplained_over_256_cost": unexplained / per_token[256],
                          "load_1min": os.getloadavg()[0]}
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    assert unexplained < 2.0 * per_token[256], (
        f"prefill cost per token grew by {unexplained / per_token[256]:.2f}x the 256-token cost beyond attention")
    if device == "mlx":
        doubling = per_token[2048] / per_token[1024]
        assert doubling < 3.0, f"prefill cost per token grew {doubling:.2f}x from 1024 to 2048 tokens"


def test_kv_block_boundaries(engine, reference):
    """Prompts of block_size - 1, block_size and block_size + 1 tokens (and 2 blocks exactly), decoding across
    the next boundary, equal HF; so does the same prompt again (a prefix-cache hit)."""
    _, model = reference
    prompts = make_prompts([BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK], seed=21)
    expected = hf_greedy(model, prompts, 20)
    for _ in range(2):
        got = generate_ids(engine, prompts, _greedy(20))
        assert_matches_hf(model, prompts, got, expected)


@pytest.mark.slow
def test_kv_full_preempts_and_recovers_with_nothing_lost(reference, engine):
    """8 sequences of 40 + 40 tokens in a pool of 12 blocks (5 per sequence at the end): the scheduler must
    preempt and recompute; every output equals HF's and every block comes back."""
    folder, model = reference
    device = engine.llm_engine.config.device
    tight = LLM(folder, device=device, dtype="float32", max_model_len=256, num_kv_blocks=12,
                kv_reserve_ratio=0.0)
    prompts = make_prompts([40] * 8, seed=31)
    got = generate_ids(tight, prompts, _greedy(40))
    assert tight.llm_engine.scheduler.num_preemptions > 0
    assert_matches_hf(model, prompts, got, hf_greedy(model, prompts, 40))
    assert_drained(tight)
    again = generate_ids(tight, prompts[:2], _greedy(40))  # the engine keeps serving after the squeeze
    assert again == got[:2]


@pytest.mark.slow
def test_latency_jitter_p99_over_p50_is_reported(engine):
    """Per-token decode times of one 200-token stream: p50, p99 and p99/p50 of wall time and of the process's
    CPU time printed. The bound (10x) is on CPU time: a stall of the engine's own making (a per-step
    recompile, a pool copy, a leak that grows the step) shows there, while waiting for the shared cores
    (other processes) does not."""
    llm = engine.llm_engine
    llm.add_request("jitter", {"prompt_token_ids": make_prompts([16], seed=41)[0]}, _greedy(200))
    wall, cpu = [], []
    while llm.has_unfinished_requests():
        llm.step()
        wall.append(time.perf_counter())
        cpu.append(time.process_time())

    def p50_p99(stamps):
        gaps = sorted(b - a for a, b in zip(stamps[1:], stamps[2:]))  # decode steps (the first is prefill)
        return gaps[len(gaps) // 2], gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))]

    (w50, w99), (c50, c99) = p50_p99(wall), p50_p99(cpu)
    print(f"\n[{llm.config.device}] per-token wall p50 {w50 * 1e3:.3f} ms p99 {w99 * 1e3:.3f} ms (p99/p50 "
          f"{w99 / w50:.2f}); cpu p50 {c50 * 1e3:.3f} ms p99 {c99 * 1e3:.3f} ms (p99/p50 {c99 / max(c50, 1e-9):.2f})")
    path = os.environ.get("METAINFER_JITTER_JSON")  # a record of the figures (docs/results/ cites one)
    if path:
        record = json.load(open(path)) if os.path.exists(path) else {}
        record[llm.config.device] = {"decode_steps": len(wall) - 1, "wall_p50_ms": w50 * 1e3, "wall_p99_ms": w99 * 1e3,
                                     "wall_p99_over_p50": w99 / w50, "cpu_p50_ms": c50 * 1e3, "cpu_p99_ms": c99 * 1e3,
                                     "cpu_p99_over_p50": c99 / max(c50, 1e-9), "load_1min": os.getloadavg()[0]}
        with open(path, "w") as f:
            json.dump(record, f, indent=1)
    assert c99 / max(c50, 1e-6) < 10.0


def test_edge_cases(engine, reference):
    """A 1-token prompt, max_tokens=1, empty stop lists."""
    _, model = reference
    one = [[7]]
    assert_matches_hf(model, one, generate_ids(engine, one, _greedy(9)), hf_greedy(model, one, 9))
    prompts = make_prompts([5, 30], seed=51)
    first = generate_ids(engine, prompts, _greedy(1))
    assert [len(t) for t in first] == [1, 1]
    assert first == [t[:1] for t in hf_greedy(model, prompts, 1)]
    empty = generate_ids(engine, prompts, _greedy(6, stop=[], stop_token_ids=[]))
    assert empty == generate_ids(engine, prompts, _greedy(6))
    assert_matches_hf(model, prompts, empty, hf_greedy(model, prompts, 6))


def test_unicode_text_in_and_out(tmp_path):
    """Unicode prompt text through the real Qwen3 tokenizer (a model with its whole vocabulary): the prompt
    ids are the tokenizer's, the reply equals HF's and decodes to text that round-trips its ids."""
    folder = str(tmp_path)
    model = build_tiny_model(folder, "qwen3", vocab_size=151936, num_hidden_layers=1)
    text = "héllo wörld — 你好，世界 🙂 ∑x²"
    for device in [p if isinstance(p, str) else p.values[0] for p in BACKENDS]:
        if device == "mlx" and __import__("importlib").util.find_spec("mlx") is None:
            continue
        llm = LLM(folder, device=device, dtype="float32", max_model_len=128, num_kv_blocks=16)
        out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                skip_special_tokens=False), use_tqdm=False)[0]
        ids = llm.get_tokenizer().encode(text)
        assert out.prompt_token_ids == ids and len(out.outputs[0].token_ids) == 8
        assert_matches_hf(model, [ids], [out.outputs[0].token_ids], hf_greedy(model, [ids], 8))
        reply = out.outputs[0]
        assert reply.text == llm.get_tokenizer().decode(reply.token_ids, skip_special_tokens=False)


def test_multi_turn_chat_hits_the_prefix_cache(engine, reference):
    """Three turns, each prompt = the history so far + a new message: turns 2 and 3 reuse the cached history
    (num_cached_tokens > 0) and every reply equals HF's on the full prompt."""
    _, model = reference
    history = make_prompts([37], seed=61)[0]
    for turn, (user_len, reply_len) in enumerate([(0, 12), (11, 5), (5, 20)]):
        prompt = history + (make_prompts([user_len], seed=70 + turn)[0] if user_len else [])
        out = engine.generate({"prompt_token_ids": prompt}, _greedy(reply_len), use_tqdm=False)[0]
        reply = out.outputs[0].token_ids
        if turn:
            assert out.num_cached_tokens >= len(history) // BLOCK * BLOCK - BLOCK
            assert out.num_cached_tokens > 0
        assert_matches_hf(model, [prompt], [reply], hf_greedy(model, [prompt], reply_len))
        history = prompt + reply
