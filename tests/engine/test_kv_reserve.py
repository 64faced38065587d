"""The KV reserve (engine/kv_reserve.py): what a prompt's admission leaves free for the running sequences'
future tokens. The estimate's arithmetic; the learned ratios (bounded and open requests apart, window, aborts
ignored); the plan's peak against a step-by-step walk of the same model; and the scheduler driven as the engine
drives it: a pool that greedy admission (ratio 0, vLLM's) fills and then preempts is admitted so that every
request that runs to its max_tokens finishes without a preemption, with prefix caching (shared prompt blocks,
n samples), chunked prompts and the server's mixed-step cap; an idle engine still admits a request larger than
its reserve; a preempted sequence never blocks a prompt part-way through its chunks. Below the threshold
(kv_reserve_min_running) the reserve applies while the running sequences' steps left are spread (hand-computed
coefficients of variation and peaks), greedy admission when they end together and for a model with routed experts."""

from __future__ import annotations

import math
import random

import pytest

from metainfer.engine.block_manager import BlockManager
from metainfer.engine.kv_reserve import CLIP_TOKENS, INITIAL_RATIO, MIN_RUNNING, WINDOW, KVReserve, ReservePlan
from metainfer.engine.scheduler import Scheduler
from metainfer.engine.sequence import Sequence
from metainfer.sampling_params import SamplingParams


def _seq(prompt, max_tokens, name="r", index=0, n=1):
    ids = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    return Sequence(name, index, ids, SamplingParams(max_tokens=max_tokens, n=n))


def _finished(reserve, generated, max_tokens, prompt_len=4):
    seq = _seq(prompt_len, max_tokens)
    seq.token_ids += [7] * generated
    reserve.record_finished(seq)


def test_allowed_tokens_is_max_tokens_left_within_the_context_and_the_clip():
    r = KVReserve(block_size=4, max_model_len=10_000)
    seq = _seq(10, 30)
    seq.token_ids += [7] * 12
    assert r.allowed_tokens(seq) == 18
    assert r.allowed_tokens(_seq(10, None)) == CLIP_TOKENS  # no max_tokens: the context left, clipped
    assert KVReserve(4, 100).allowed_tokens(_seq(90, 50)) == 10  # the context left
    done = _seq(10, 3)
    done.token_ids += [7] * 3
    assert r.allowed_tokens(done) == 0


def test_learned_ratios_are_generated_over_allowed_per_class_over_the_last_window():
    r = KVReserve(block_size=16, max_model_len=100_000)
    assert r.ratio_of(True) == INITIAL_RATIO[True] == 1.0 and r.ratio_of(False) == INITIAL_RATIO[False]
    _finished(r, 25, 100)
    _finished(r, 75, 100)
    assert r.ratio == r.ratio_of(True) == pytest.approx(0.5)
    _finished(r, 400, None)  # an open request (no max_tokens): allowed the clip, its own ratio
    _finished(r, 600, 2 * CLIP_TOKENS)  # a max_tokens past the clip counts as open too
    assert r.ratio_of(True) == pytest.approx(0.5)
    assert r.ratio_of(False) == pytest.approx(1000 / (2 * CLIP_TOKENS))
    assert r.estimate(_seq(4, None)) == math.ceil(1000 / (2 * CLIP_TOKENS) * CLIP_TOKENS)
    for _ in range(WINDOW):
        _finished(r, 10, 40)
    assert r.ratio == pytest.approx(0.25)  # the first two left the window
    fixed = KVReserve(16, 100_000, ratio=0.3)
    _finished(fixed, 1, 100)
    assert fixed.ratio_of(True) == fixed.ratio_of(False) == 0.3
    assert not KVReserve(16, 100, ratio=0.0).enabled
    with pytest.raises(ValueError, match="kv_reserve_ratio"):
        KVReserve(16, 100, ratio=1.5)


def _fits_step_by_step(seqs, reserve, block_size, capacity):
    """Independent reference for unshared sequences: walk every future step and sum the blocks (tokens / block
    size + 1, one token a step) of the sequences still running."""
    ends = [reserve.estimate(s) for s in seqs]
    for step in range(max(ends, default=0) + 2):
        held = sum(s.num_tokens / block_size + 1 + min(step, end) / block_size
                   for s, end in zip(seqs, ends) if step <= end)
        if held > capacity + 1e-9:
            return False
    return True


@pytest.mark.parametrize("ratio", [1.0, 0.5])
def test_plan_admits_exactly_when_every_future_step_fits(ratio):
    rng = random.Random(3)
    for _ in range(300):
        bs = rng.choice([1, 4, 16])
        running = []
        for i in range(rng.randint(1, 6)):
            max_tokens = rng.randint(1, 80)
            seq = _seq(range(100 * i, 100 * i + rng.randint(1, 60)), max_tokens, name=f"r{i}")
            seq.token_ids += [7] * rng.randint(0, max_tokens)
            running.append(seq)
        new = _seq(range(9000, 9000 + rng.randint(1, 60)), rng.randint(1, 80), name="new")
        held = sum(-(-s.num_tokens // bs) for s in running)
        bm = BlockManager(held + rng.randint(0, 40 + -(-new.num_tokens // bs)), bs, enable_prefix_caching=False)
        for seq in running:
            bm.allocate(seq)
        reserve = KVReserve(block_size=bs, max_model_len=400, ratio=ratio)
        plan = reserve.plan(running, [], bm, prompt_budget=1 << 20)
        expected = _fits_step_by_step(running + [new], reserve, bs, bm.num_free_blocks + held)
        assert plan.admit(new, bm.cached_prefix(new)) == expected


def test_a_sequence_that_ends_early_makes_room_the_sum_of_final_sizes_would_not():
    # block size 1: a sequence of n tokens holds n + 1 blocks in the model (the +1: a partial block). Running:
    # A and B of 10 tokens, A ends after 2 more, B after 20; a new prompt N of 10 tokens with 10 to go. Held: 39
    # blocks at step 2 (13 each), 42 at step 10 (B 21, N 21), 31 at step 20 (B): the peak is 42, while their
    # final sizes sum to 13 + 31 + 21 = 65. The running two hold 20 blocks now.
    def plan_with_pool(pool):
        running = [_seq(range(1, 11), 2, "A"), _seq(range(101, 111), 20, "B")]
        bm = BlockManager(pool, 1, enable_prefix_caching=False)
        for seq in running:
            bm.allocate(seq)
        return KVReserve(block_size=1, max_model_len=400).plan(running, [], bm, prompt_budget=1024), bm

    for pool, max_tokens, fits in ((50, 10, True), (41, 10, False), (41, 9, True)):  # the last peaks at 40
        plan, bm = plan_with_pool(pool)
        new = _seq(range(201, 211), max_tokens, "N")
        assert plan.admit(new, bm.cached_prefix(new)) is fits, (pool, max_tokens)


def _drive(sched, arrivals, stop_after=None):
    """The engine's loop, tokens read back at once: arrivals {step: [seqs]}; the full blocks hashed on read-back
    (prefix caching); a sequence stops ("stop") after stop_after tokens if given (a number, or a function of the
    sequence), else at its max_tokens.
    Returns the most sequences that ran together; fails if the scheduler stops making progress."""
    seqs, step, most = [], 0, 0
    bm = sched.block_manager
    while True:
        for seq in arrivals.get(step, []):
            sched.add(seq)
            seqs.append(seq)
        batch = sched.schedule()
        step += 1
        assert step < 100_000
        if batch is None:
            if any(k >= step for k in arrivals):
                continue
            break
        sampling = batch.sampling_seqs
        sched.after_step(batch)
        most = max(most, len(sched.running))
        for seq in sampling:
            seq.token_ids.append(7)
        for seq in batch.seqs:
            bm.register_full_blocks(seq)
        for seq in sampling:
            limit = stop_after(seq) if callable(stop_after) else stop_after or seq.params.max_tokens
            if seq.num_output_tokens >= limit:
                seq.finish_reason = "stop" if stop_after else "length"
                sched.finish(seq)
    assert all(s.is_finished for s in seqs), "a request never ran: the scheduler stalled"
    assert bm.num_free_blocks == bm.num_blocks
    return most


def _scheduler(num_blocks, ratio=None, block_size=4, prefix_caching=False, **kw):
    kw = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, "kv_reserve_min_running": 1, **kw}
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching),
                     kv_reserve_ratio=ratio, **kw)


def test_requests_that_run_to_max_tokens_are_not_preempted():
    # 4-token blocks, 8 prompts of 8 tokens, 24 out: 8 blocks each at the end, 64 against a pool of 20.
    # Greedy admission takes all 8 prompts (16 blocks) and must preempt as they grow; the reserve admits two
    # at a time (each peaks at 8 + 1 partial block in its model) and the rest as they finish.
    greedy = _scheduler(20, ratio=0.0)
    assert _drive(greedy, {0: [_seq(8, 24, f"g{i}") for i in range(8)]}) > 2
    assert greedy.num_preemptions > 0
    reserved = _scheduler(20)
    assert _drive(reserved, {0: [_seq(8, 24, f"r{i}") for i in range(8)]}) == 2
    assert reserved.num_preemptions == 0
    assert reserved.kv_reserve.ratio == 1.0


def test_below_min_running_prompts_that_end_together_are_admitted_greedily():
    # the same 8 prompts and pool as above: from 3 running sequences on the reserve applies, so 3 run together
    # (admitted greedily while fewer ran: they end together) where the reserve from the first sequence runs 2 and
    # greedy admission 8; three do not fit at their full 8 blocks each, so one is preempted when the pool runs out
    at_three = _scheduler(20, kv_reserve_min_running=3)
    assert _drive(at_three, {0: [_seq(8, 24, f"t{i}") for i in range(8)]}) == 3
    assert at_three.num_preemptions > 0
    with pytest.raises(ValueError, match="kv_reserve_min_running"):
        KVReserve(4, 256, None, 0)


def _after_one_step(pool, running_max_tokens, **kw):
    """Block size 1, the engine's threshold (192): the running sequences (10-token prompts, these max_tokens) after
    their prefill step, each with its first token sampled: 11 tokens, 10 computed, 11 blocks once the next step's
    decode slot is taken. In the plan each holds base 11 + 1 (its model's partial block) = 12 blocks and has
    max_tokens - 1 steps left; a waiting 10-token prompt holds 10 + 1 = 11 and has its max_tokens left."""
    sched = Scheduler(BlockManager(pool, 1, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64,
                      max_model_len=400, **kw)
    running = [_seq(range(100 * i + 1, 100 * i + 11), m, f"run{i}") for i, m in enumerate(running_max_tokens)]
    for seq in running:
        sched.add(seq)
    batch = sched.schedule()
    assert batch.seqs == running
    sched.after_step(batch)
    for seq in running:
        seq.token_ids.append(7)
    return sched


def _admitted(sched, *prompts):
    """The waiting prompts the next step admits (its decode rows are the running sequences)."""
    for seq in prompts:
        sched.add(seq)
    return [seq.request_id for seq in sched.schedule().seqs if seq.num_output_tokens == 0]


def test_below_min_running_the_reserve_applies_while_remaining_lengths_are_spread():
    # steps left (a, b) of the two running sequences; N: 10 tokens, 10 to go. Coefficient of variation of two
    # values: |a - b| / (a + b); the reserve applies below 192 running sequences from 0.2.
    # (2, 20): 18 / 22 = 0.82, spread. Peak (block counts above): before A ends (step 2) 14 + 14 + 13 = 41, before
    # N ends (step 10) B 22 + N 21 = 43, then B alone 32: 43 > a pool of 42, so N waits (it needs 10 of the 20 free
    # blocks: greedy admission took it); a pool of 43 holds it.
    sched = _after_one_step(42, (3, 21))
    plan = sched.kv_reserve.plan(sched.running, [], sched.block_manager, prompt_budget=62)
    assert plan.spread == pytest.approx(18 / 22)
    assert _admitted(sched, _seq(range(1001, 1011), 10, "N")) == []
    assert sched.num_preemptions == 0
    assert _admitted(_after_one_step(43, (3, 21)), _seq(range(1001, 1011), 10, "N")) == ["N"]
    # (6, 10): 4 / 16 = 0.25, spread: peak before A ends (step 6) 18 + 18 + 17 = 53 > 52, N waits.
    assert _admitted(_after_one_step(52, (7, 11)), _seq(range(1001, 1011), 10, "N")) == []
    # (7, 10): 3 / 17 = 0.18, about to end together: greedy, N is admitted though its peak (step 7: 19 + 19 + 18
    # = 56) passes the pool of 52.
    assert _admitted(_after_one_step(52, (8, 11)), _seq(range(1001, 1011), 10, "N")) == ["N"]
    # (10, 11): 0.05, a wave: greedy; N1 (30 to go) is admitted and joins the plan, which makes the steps left
    # (10, 11, 30) spread: mean 17, standard deviation sqrt((49 + 36 + 169) / 3) = 9.2, 0.54. N2 (30 to go) is then
    # checked with N1 in the plan: peak before A ends (step 10) 22 + 22 + 21 + 21 = 86 > 70 (without N1 65: it
    # would fit), so N2 waits, where greedy admission took both (20 of 48 free blocks).
    sched = _after_one_step(70, (11, 12))
    assert _admitted(sched, _seq(range(1001, 1011), 30, "N1"), _seq(range(2001, 2011), 30, "N2")) == ["N1"]


def test_a_model_with_routed_experts_admits_greedily_below_min_running():
    # the first case above (steps left 2 and 20, spread; N's peak 43 against 42 blocks): an MoE model admits N
    # below min_running, and from min_running (here 2) the reserve applies as for any model
    moe = _after_one_step(42, (3, 21), routed_experts=True)
    assert _admitted(moe, _seq(range(1001, 1011), 10, "N")) == ["N"]
    at_two = _after_one_step(42, (3, 21), routed_experts=True, kv_reserve_min_running=2)
    assert _admitted(at_two, _seq(range(1001, 1011), 10, "N")) == []


@pytest.mark.parametrize("arch, routed", [("qwen3", False), ("qwen3_moe", True), ("deepseek_v2", True)])
def test_the_engine_tells_the_scheduler_whether_the_model_routes_experts(tmp_path, arch, routed):
    from metainfer import LLM
    from tests.helpers.tiny_models import build_tiny_model

    folder = str(tmp_path / arch)
    hf = build_tiny_model(folder, arch)
    # the checkpoint's own config: Qwen3-MoE names its experts num_experts, DeepSeek-V2 n_routed_experts (its
    # first layer dense: first_k_dense_replace)
    config = hf.config
    assert bool(getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0)) is routed
    if arch == "deepseek_v2":
        assert config.first_k_dense_replace == 1 < config.num_hidden_layers
    llm = LLM(folder, device="cpu", dtype="float32", num_kv_blocks=32)
    try:
        assert llm.llm_engine.scheduler.kv_reserve.routed_experts is routed
    finally:
        llm.close()


def test_the_engine_default_threshold_is_the_reserves(tmp_path):
    from metainfer.config import ConfigError, EngineConfig
    from metainfer.engine.llm_engine import resolve_config
    from tests.helpers.tiny_models import build_tiny_model

    assert EngineConfig("m").kv_reserve_min_running == MIN_RUNNING
    folder = str(tmp_path / "tiny")
    build_tiny_model(folder, "qwen3")
    with pytest.raises(ConfigError, match="kv_reserve_min_running"):
        resolve_config(EngineConfig(folder, device="cpu", kv_reserve_min_running=0))


def test_a_reserve_learned_from_early_stops_admits_more():
    # replies stop after 6 of their 24 allowed tokens: the learned ratio falls to 0.25 and later prompts
    # are admitted beside more running ones than at ratio 1 (2 at a time)
    sched = _scheduler(20)
    seqs = [_seq(8, 24, f"r{i}") for i in range(12)]
    _drive(sched, {0: seqs[:2]}, stop_after=6)
    assert sched.kv_reserve.ratio == pytest.approx(0.25)
    assert _drive(sched, {0: seqs[2:]}, stop_after=6) > 2
    assert sched.num_preemptions == 0


def test_n_samples_share_their_prompt_blocks_in_the_plan():
    # 4 samples of a 256-token prompt (16 shared blocks of 16) with 64 tokens out each: prompt once + 4 x 5
    # blocks = 36 fit a pool of 40, while counting the prompt per sample (4 x 21 = 84) would run them one at a
    # time; greedy admission's figures are the comparison
    runs = {}
    for ratio in (None, 0.0):
        sched = _scheduler(40, ratio, block_size=16, prefix_caching=True, max_num_batched_tokens=1024,
                           max_model_len=1024)
        samples = [_seq(256, 64, "req", index=i, n=4) for i in range(4)]
        runs[ratio] = (_drive(sched, {0: samples}), sched.num_preemptions)
    assert runs[None] == (4, 0) and runs[0.0][0] == 4


def test_shared_prefix_blocks_stay_counted_until_their_last_holder_ends():
    # prefix caching on, every request runs to its max_tokens: with shared prompt blocks counted once and held
    # to the end, random mixes of shared prefixes, n samples and arrivals never preempt (the peak ignored
    # sharing before: a shared block looked free once its first holder ended)
    rng = random.Random(7)
    for _ in range(400):
        bs = rng.choice([1, 2, 4])
        pool = rng.randint(20, 80)
        prefixes = [list(range(1000 * k, 1000 * k + rng.randint(0, 24))) for k in (1, 2)] + [[]]
        arrivals = {}
        for i in range(rng.randint(2, 8)):
            prompt = rng.choice(prefixes) + [50_000 + 100 * i + j for j in range(rng.randint(1, 12))]
            max_tokens = rng.randint(1, 30)
            if len(prompt) + max_tokens > pool * bs:
                continue
            n = rng.choice([1, 1, 2, 3])
            arrivals.setdefault(rng.randint(0, 20), []).extend(
                _seq(prompt, max_tokens, f"r{i}", index=k, n=n) for k in range(n))
        sched = _scheduler(pool, 1.0, block_size=bs, prefix_caching=True, max_num_seqs=16,
                           max_num_batched_tokens=rng.choice([8, 1024]), max_model_len=pool * bs)
        _drive(sched, arrivals)
        assert sched.num_preemptions == 0


def _check_plans_against_rebuilt(sched):
    """After every allocation of a schedule call that built a plan, the plan as its admissions left it must equal
    one built anew from the block manager (the running sequences, the prompt just allocated, the waiting ones
    holding blocks): the same capacity, entries and spread. Returns a counter of the comparisons and of the
    admissions that took over blocks a single sequence held (a hit with reference count 1)."""
    bm, reserve = sched.block_manager, sched.kv_reserve
    state = {"plan": None, "budget": None}
    counts = {"compared": 0, "took_over": 0}
    schedule, plan, allocate = sched.schedule, reserve.plan, bm.allocate

    def traced_schedule():
        state["plan"] = None
        return schedule()

    def traced_plan(running, waiting_with_blocks, block_manager, prompt_budget):
        state["plan"], state["budget"] = plan(running, waiting_with_blocks, block_manager, prompt_budget), prompt_budget
        return state["plan"]

    def traced_allocate(seq, hits=None):
        counts["took_over"] += any(bm.blocks[b].ref_count == 1 for b in hits or [])
        allocate(seq, hits)
        if state["plan"] is None:
            return
        now = state["plan"]
        waiting = [s for s in sched.waiting if s.block_table and s is not seq]
        rebuilt = ReservePlan(reserve, [*sched.running, seq], waiting, bm, state["budget"])
        assert now.capacity == rebuilt.capacity
        assert now.final_total == pytest.approx(rebuilt.final_total, abs=1e-9)
        flat = [[value for entry in sorted(map(tuple, p.entries)) for value in entry] for p in (now, rebuilt)]
        assert flat[0] == pytest.approx(flat[1], abs=1e-9)
        assert now.spread == pytest.approx(rebuilt.spread, abs=1e-12)
        counts["compared"] += 1

    sched.schedule, reserve.plan, bm.allocate = traced_schedule, traced_plan, traced_allocate
    return counts


def test_a_second_takeover_of_a_sequences_blocks_in_one_call_leaves_the_capacity():
    # block size 4, prefix caching: X (a 25-token prompt, 7 blocks) has run its prefill and sampled a token (26
    # tokens, 6 full blocks hashed). In one schedule call Y (10 tokens: X's first 2 blocks + 1 fresh) and then Z
    # (26 tokens: X's first 6 blocks + 1 fresh) are admitted. X then holds alone only its 7th block: capacity =
    # free 200 - 7 - 1 - 1 = 191 + X's 1 + Y's 1 + Z's 1 = 194. Bases (blocks held alone + tokens / 4 + 1 - table
    # length): X 1 + 26 / 4 + 1 - 7 = 1.5, Y 1 + 10 / 4 + 1 - 3 = 1.5, Z 1 + 26 / 4 + 1 - 7 = 1.5. (The plan
    # counted X's blocks 3-6 too, 198: Z's hits on them were not traced to X once Y had taken its first two.)
    sched = _scheduler(200, prefix_caching=True, max_num_batched_tokens=256)
    counts = _check_plans_against_rebuilt(sched)
    prompt = list(range(1, 25))
    x = _seq(prompt + [99], 50, "X")
    sched.add(x)
    sched.after_step(sched.schedule())
    x.token_ids.append(7)
    sched.block_manager.register_full_blocks(x)
    y, z = _seq(prompt[:8] + [98, 97], 50, "Y"), _seq(prompt + [96, 95], 50, "Z")
    sched.add(y)
    sched.add(z)
    plans = []
    plan = sched.kv_reserve.plan
    sched.kv_reserve.plan = lambda *args: plans.append(plan(*args)) or plans[-1]
    assert [s.request_id for s in sched.schedule().seqs] == ["X", "Y", "Z"]
    bm = sched.block_manager
    assert [bm.blocks[b].ref_count for b in x.block_table] == [3, 3, 2, 2, 2, 2, 1]
    assert bm.num_free_blocks == 191
    assert plans[0].capacity == 194
    assert [base for _, base in plans[0].entries] == [1.5, 1.5, 1.5]  # X, Y, Z
    assert counts == {"compared": 2, "took_over": 2}


@pytest.mark.parametrize("seed", range(24))
def test_the_plan_after_each_admission_equals_one_built_anew(seed):
    # random arrivals with shared prefixes, n samples, chunked prompts and early stops: whichever the admissions
    # of a schedule call (checked or greedy, refused, taking over blocks a running sequence or an earlier prompt
    # of the call held alone), the plan they leave is the plan the block manager's state gives
    rng = random.Random(seed)
    sched = _scheduler(rng.randint(30, 120), prefix_caching=True, max_num_seqs=16,
                       max_num_batched_tokens=rng.choice([10, 64]))
    counts = _check_plans_against_rebuilt(sched)
    # two shared texts, each prompt opens with 0-6 blocks of one: a prompt may hit the leading blocks of one that
    # another prompt of the same call hits further
    texts = [[rng.randint(1, 50) for _ in range(24)] for _ in range(2)]
    arrivals, stops = {}, {}
    for i in range(40):
        prompt = rng.choice(texts)[:4 * rng.randint(0, 6)] + [rng.randint(51, 99) for _ in range(rng.randint(1, 20))]
        n = rng.randint(1, 3)
        max_tokens = rng.choice([rng.randint(2, 60), None]) if rng.random() < 0.2 else rng.randint(2, 60)
        for k in range(n):
            seq = _seq(prompt, max_tokens, f"r{i}", index=k, n=n)
            stops[id(seq)] = rng.randint(1, max_tokens or 80)
            arrivals.setdefault(rng.randint(0, 200), []).append(seq)
    _drive(sched, arrivals, stop_after=lambda seq: stops[id(seq)])
    assert counts["compared"] > 50 and counts["took_over"] > 0


def test_a_chunked_prompt_counts_the_steps_before_its_first_token():
    # the server's cap (256 prompt tokens a step beside decodes): 12 streams of 128 + 256 tokens run; a
    # 4,000-token prompt arriving at step 40 takes 16 steps of chunks, while every stream grows 16 tokens the
    # admission must have counted
    rng = random.Random(0)
    for pool in range(300, 420, 8):
        sched = _scheduler(pool, 1.0, block_size=16, max_num_seqs=64, max_num_batched_tokens=8192,
                           max_model_len=8192, max_mixed_prefill_tokens=256)
        streams = [_seq([rng.randint(1, 30_000) for _ in range(128)], 256, f"s{i}") for i in range(12)]
        long = _seq([rng.randint(1, 30_000) for _ in range(4000)], 16, "long")
        _drive(sched, {0: streams, 40: [long]})
        assert sched.num_preemptions == 0, pool


def test_a_preempted_sequence_queues_behind_a_prompt_part_way_through_its_chunks():
    # block size 1, 8 tokens a step, greedy admission: A (4 + 80 tokens) runs; B's 140-token prompt arrives and
    # takes blocks chunk by chunk until A cannot grow and preempts itself. Queued ahead of B, A needed blocks B
    # held, and B never ran again (a stall); behind B, B finishes its prompt, runs, and A follows.
    for ratio in (0.0, None):
        sched = _scheduler(150, ratio, block_size=1, max_num_batched_tokens=8, max_model_len=150)
        _drive(sched, {0: [_seq(range(1, 5), 80, "A")], 2: [_seq(range(100, 240), 1, "B")]})


def test_an_idle_engine_admits_a_request_larger_than_its_reserve():
    # 8 + 200 tokens would need 52 blocks of a pool of 20 (the engine caps max_model_len at the pool, so this
    # only shows the rule): nothing runs, so it is admitted rather than waiting for room that cannot come
    sched = _scheduler(20)
    seq = _seq(8, 200)
    sched.add(seq)
    plan = sched.kv_reserve.plan([], [], sched.block_manager, prompt_budget=64)
    assert not plan.admit(seq, []), "its reserve alone does not fit the pool"
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [seq]


def test_aborted_sequences_teach_the_ratio_nothing():
    sched = _scheduler(20)
    seq = _seq(8, 24)
    sched.add(seq)
    sched.after_step(sched.schedule())
    seq.finish_reason = "abort"
    sched.finish(seq)
    assert sched.kv_reserve.ratio == 1.0 and not sched.kv_reserve._finished[True]
