"""Mixed batches (issue 23, item 3): one step carries the running sequences' decode tokens and prefill chunks
under one token budget (vLLM v1's unified scheduling), so a long prompt arriving never stalls running streams.

Scheduler on its own: running sequences get a token every step while a long prompt is chunked beside them.
End to end on the CPU in fp32: greedy output equals HF transformers for a dense model (Qwen3), DeepSeek-V2 (MLA:
a mixed step runs the absorbed prefill) and Qwen3-MoE, with prompts arriving while others decode, a tiny token
budget (prompts chunk), preemption (few KV blocks) and async scheduling; penalties, seeded sampling, stops and
logprobs equal the unmixed schedule's (every request submitted at once with a budget that never chunks; logprob
values to fp32 rounding).
"""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from metainfer.engine.block_manager import BlockManager
from metainfer.engine.scheduler import Scheduler
from metainfer.engine.sequence import Sequence
from tests.helpers.engine_checks import assert_drained
from tests.helpers.tiny_models import assert_matches_hf, hf_greedy, hf_reference, make_prompts

NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


# -- the scheduler ---------------------------------------------------------------------------------
def _run_steps(sched, num_steps, arrivals=None):
    """Schedule and 'run' steps (advance, append a token for each sampling row); returns the batches."""
    batches = []
    for step in range(num_steps):
        for seq in (arrivals or {}).get(step, []):
            sched.add(seq)
        batch = sched.schedule()
        batches.append([(s, s.num_scheduled_tokens) for s in batch.seqs] if batch else [])
        if batch is None:
            continue
        sampling = batch.sampling_seqs
        sched.after_step(batch)
        for seq in sampling:
            seq.token_ids.append(7)
    return batches


def test_a_long_prompt_does_not_stop_running_sequences_from_getting_a_token_each_step():
    sched = Scheduler(BlockManager(256, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=16,
                      max_model_len=1024)
    running = [Sequence(f"r{i}", 0, list(range(1, 6)), SamplingParams(max_tokens=200)) for i in range(3)]
    long = Sequence("long", 0, list(range(1, 101)), SamplingParams(max_tokens=200))
    batches = _run_steps(sched, 14, arrivals={0: running, 2: [long]})
    seen_at = {seq.request_id: [i for i, rows in enumerate(batches) if any(s is seq for s, _ in rows)]
               for seq in running}
    for rid, steps in seen_at.items():
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        assert gaps and set(gaps) == {1}, f"{rid} skipped a step: {steps}"
    # from step 2 the long prompt is chunked into what the 3 decode tokens leave of the budget: 13 a step
    chunks = [n for rows in batches[2:] for s, n in rows if s is long]
    assert chunks[:7] == [13] * 7 and sum(chunks[:8]) == 100 and chunks[8:] == [1] * (len(chunks) - 8)
    for rows in batches[2:9]:
        assert [n for _, n in rows] == [1, 1, 1, 13] or rows[-1][1] == 9, rows  # decode rows first
        assert sum(n for _, n in rows) <= 16


def test_step_kinds_and_their_counts():
    sched = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=32,
                      max_model_len=512)
    a = Sequence("a", 0, [1, 2, 3], SamplingParams(max_tokens=50))
    sched.add(a)
    first = sched.schedule()
    assert first.is_prefill and not first.is_mixed and first.num_decode_rows == 0 and first.num_prefill_tokens == 3
    sched.after_step(first)
    a.token_ids.append(7)
    b = Sequence("b", 0, [4, 5, 6, 7, 8], SamplingParams(max_tokens=50))
    sched.add(b)
    mixed = sched.schedule()
    assert mixed.is_mixed and mixed.seqs == [a, b] and (mixed.num_decode_rows, mixed.num_prefill_tokens) == (1, 5)
    sched.after_step(mixed)
    a.token_ids.append(7)
    b.token_ids.append(7)
    decode = sched.schedule()
    assert not decode.is_prefill and not decode.is_mixed and decode.num_decode_rows == 2
    assert decode.num_prefill_tokens == 0


def test_max_mixed_prefill_tokens_caps_prompt_tokens_beside_decodes_only():
    """Sarathi-Serve's stall-free budget: with decode rows in the step, at most max_mixed_prefill_tokens prompt
    tokens (a prompt chunked to it, the next one not admitted past it); with none, the whole budget."""
    sched = Scheduler(BlockManager(256, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=1024, max_mixed_prefill_tokens=10)
    first = Sequence("first", 0, list(range(1, 41)), SamplingParams(max_tokens=200))
    later = [Sequence(f"p{i}", 0, list(range(1, 26)), SamplingParams(max_tokens=200)) for i in range(2)]
    kinds = []
    for step in range(8):
        for seq in {0: [first], 1: later}.get(step, []):
            sched.add(seq)
        batch = sched.schedule()
        kinds.append((batch.num_decode_rows, batch.num_prefill_tokens))
        assert first in batch.seqs, "the running stream gets its token every step"
        sampling = batch.sampling_seqs
        sched.after_step(batch)
        for seq in sampling:
            seq.token_ids.append(7)
    assert kinds[0] == (0, 40), "no decode rows: the 40-token prompt runs whole (budget 64)"
    # p0 (25 tokens) in chunks of 10, 10, then its last 5 + p1's first 5 in one step, then p1's 10, 10
    assert kinds[1:7] == [(1, 10), (1, 10), (1, 10), (2, 10), (2, 10), (3, 0)], kinds


def test_max_mixed_prefill_tokens_below_one_is_refused():
    from metainfer.config.engine_config import ConfigError

    with pytest.raises(ConfigError, match="max_mixed_prefill_tokens"):
        LLM(model=None, device="cpu", max_mixed_prefill_tokens=0)


# -- end to end --------------------------------------------------------------------------------------
def _staggered(llm, prompts, params, every=2, record=None):
    """Submit prompts[0], then one more every `every` steps while the others run; outputs by index."""
    engine, done, step = llm.llm_engine, {}, 0
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        if record is not None and batch is not None:
            record.append((batch.is_mixed, batch.num_decode_rows, batch.num_tokens))
        return batch

    engine.scheduler.schedule = recording
    queue = list(enumerate(prompts))
    params = params if isinstance(params, list) else [params] * len(prompts)
    while queue or engine.has_unfinished_requests():
        if queue and step % every == 0:
            i, prompt = queue.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": prompt}, params[i])
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        step += 1
    return [done[i] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=["qwen3", "deepseek_v2", "qwen3_moe"])
def reference(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp(f"mixed-{request.param}"))
    model, prompts, expected = hf_reference(folder, request.param, [5, 70, 9, 45, 2, 33], NEW_TOKENS)
    return request.param, folder, model, prompts, expected


@pytest.mark.slow
@pytest.mark.parametrize("engine_kw", [
    dict(max_num_batched_tokens=16, async_scheduling=False),
    dict(max_num_batched_tokens=16, async_scheduling=True),
    dict(max_num_batched_tokens=24, num_kv_blocks=14, kv_reserve_ratio=0.0, async_scheduling=True),
    dict(max_num_batched_tokens=64, max_mixed_prefill_tokens=7, async_scheduling=True),
], ids=["chunked-sync", "chunked-async", "preempt-async", "mixed-cap-async"])
def test_greedy_with_mixed_steps_matches_hf(reference, engine_kw):
    arch, folder, model, prompts, expected = reference
    llm = LLM(folder, device="cpu", dtype="float32", block_size=8, **engine_kw)
    record: list = []
    outs = _staggered(llm, prompts, GREEDY, record=record)
    assert_matches_hf(model, prompts, [o.outputs[0].token_ids for o in outs], expected)
    assert sum(mixed for mixed, _, _ in record) >= 5, "the arrivals must make mixed steps"
    assert all(n <= engine_kw["max_num_batched_tokens"] for _, _, n in record)
    cap = engine_kw.get("max_mixed_prefill_tokens")
    if cap:
        assert all(n - rows <= cap for mixed, rows, n in record if mixed)
    if "num_kv_blocks" in engine_kw:
        assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.stats["prompt_tokens"] >= sum(map(len, prompts))
    assert_drained(llm)


def _summary(outs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


def _logprobs(outs):
    """Logprob values in token order (a decode row in a mixed step runs the prefill attention: fp32 rounding
    differs from the decode kernel's in the last digits, the chosen tokens do not)."""
    return [v for o in outs for c in o.outputs for step in (c.logprobs or []) for v in step.values()]


@pytest.mark.slow
def test_sampling_features_in_mixed_steps_equal_the_unmixed_schedule(tmp_path):
    folder = str(tmp_path)
    _, prompts, expected = hf_reference(folder, "qwen3", [5, 70, 9, 45, 2, 33], NEW_TOKENS)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=1.0, seed=11, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[expected[3][6]]),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, min_tokens=12,
                             stop_token_ids=[expected[5][3]])]
    unmixed = LLM(folder, device="cpu", dtype="float32", max_num_batched_tokens=512)
    want = unmixed.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for async_scheduling in (False, True):
        llm = LLM(folder, device="cpu", dtype="float32", max_num_batched_tokens=16, async_scheduling=async_scheduling)
        record: list = []
        got = _staggered(llm, prompts, params, record=record)
        assert any(mixed for mixed, _, _ in record)
        assert _summary(got) == _summary(want)
        assert _logprobs(got) == pytest.approx(_logprobs(want), rel=1e-5, abs=1e-5) and _logprobs(want)
        assert_drained(llm)
    assert want[3].outputs[0].finish_reason == "stop"


def test_a_prefix_hit_arriving_mid_decode_runs_in_a_mixed_step(tmp_path):
    folder = str(tmp_path)
    model, _, _ = hf_reference(folder, "qwen3", [], 1)
    shared = make_prompts([40], seed=4)[0]
    prompts = [shared + [3, 4], make_prompts([6], seed=5)[0], shared + [9]]
    llm = LLM(folder, device="cpu", dtype="float32", async_scheduling=True)
    record: list = []
    outs = _staggered(llm, prompts, GREEDY, every=3, record=record)
    assert outs[2].num_cached_tokens == 32
    assert any(mixed for mixed, _, _ in record)
    assert_matches_hf(model, prompts, [o.outputs[0].token_ids for o in outs], hf_greedy(model, prompts, NEW_TOKENS))
    assert_drained(llm)
