"""KV room a prompt's admission leaves for the running sequences' future tokens.

vLLM admits a waiting prompt whenever its prompt fits, and when the pool later runs out for a decode row it
preempts the newest sequence and recomputes it from scratch. When requests run to their max_tokens together
that repeats all along the run: the 1,000 x 1,000 protocol at the H200's bf16 pool (49,601 blocks) preempts 200
times and recomputes 330k prompt tokens, a third of its prompts again (`tools/schedule_sim.py`). SGLang keeps
room for what the running requests may still generate (its new-token ratio); so does this, with the demand's
peak instead of its sum: a prompt is admitted only if the pool holds the running sequences and it at every
step until each has generated its estimate (ReservePlan), so one that ends early frees room for the rest.
A sequence's estimate is `ratio` x the tokens it may still generate: its max_tokens left, at most the
context left and at most CLIP_TOKENS (a request without max_tokens would otherwise claim the whole context).
`ratio` is fixed (`EngineConfig.kv_reserve_ratio`; 0 is vLLM's greedy admission) or learned, apart for
requests with a max_tokens within the clip and for the others: tokens generated over tokens allowed by the
last WINDOW of each that finished (stop or length), INITIAL_RATIO before one has. Requests that run to
max_tokens are then not preempted (checked with prefix sharing, n samples and chunked prompts in
tests/engine/test_kv_reserve.py); a chat whose replies stop early is estimated by what its replies take.
Preemption stays the fallback when an estimate is short.

The reserve always applies while MIN_RUNNING or more sequences run. A decode step's GEMMs cost the same at any
row count below the GPU's ridge (bf16 FLOPs over copy rate: ~184 rows on an H200, ~200 on an H100), so there a
fuller batch pays for the recompute its preemptions cost, and a reserve that admits requests in waves of what
fits at their full length loses: at pools far smaller than the demand `tools/schedule_sim` gave -19.5%
(Qwen3-30B-A3B, 1,000 x 1,000, the H100's 8,222 blocks) and -6.5% (Qwen3-8B, 4,096 blocks) with the reserve from
the first running sequence. Above the ridge each row adds its own time, and a preemption's recompute is pure loss.
Below MIN_RUNNING the reserve applies only while the running sequences' estimated remaining lengths are spread
(the coefficient of variation of their estimated steps left, ReservePlan.spread, at least MIN_SPREAD): sequences
that end at different steps free their blocks for the rest, so the reserve admits about what greedy admission
would hold and saves its preemptions; sequences that end together (a wave) would be held to what fits at their
full length, so admission is greedy then. The spread is the estimates', not the lengths the requests will reach: a
request without max_tokens is estimated at ratio x CLIP_TOKENS while more context than that is left, so two
open-ended requests look alike, and typical chat serving without max_tokens stays greedy below MIN_RUNNING.
Not for a model with routed experts (ModelSpec.moe_layers): its decode step reads every expert from a few dozen
rows while a recomputed token computes top_k of them (at the floor's prices a 64-row step costs what ~1,800 prompt
tokens cost on Qwen3-30B-A3B, ~1,160 on DeepSeek-V2-Lite, 184 on Qwen3-8B), so the rows greedy admission keeps
are worth its recompute, and it admits greedily below MIN_RUNNING (the spread rule cost it 1-2% on nano-vllm, 9%
on 1,000 x 1,000 at 16,384 blocks). Simulated against greedy
admission below MIN_RUNNING (`docs/results/schedule_sim_spread_cpu.json`, 19 cases and 28 more): Qwen3-8B
nano-vllm at 6,192 blocks +7.7%, 1,000 x 1,000 at 12,385 / 4,096 blocks +5.8% / +4.1%, the large pools and the
MoE models unchanged, worst -0.1%.
"""

from __future__ import annotations

import math
from collections import deque

from metainfer.engine.sequence import Sequence

CLIP_TOKENS = 4096  # most future tokens counted for one sequence (SGLang clips its estimate alike)
WINDOW = 256  # finished sequences each learned ratio averages over
# Learned ratios start here: a request with max_tokens (at most CLIP_TOKENS) is assumed to use all of it, as
# benchmark clients and chat clients that set it do; one without starts at SGLang's initial new-token ratio
INITIAL_RATIO = {True: 1.0, False: 0.7}
MIN_RUNNING = 192  # from this many running sequences the reserve always applies (module docstring)
# below MIN_RUNNING the reserve applies while the running sequences' steps left have at least this coefficient of
# variation: ends uniform over [0, R] give 0.58 (outputs uniform over [100, 1,024], the nano-vllm protocol's, 0.47), a
# wave admitted over a few steps ~0.01; in between, a wave part-preempted and recomputed. 0.15-0.25 simulate
# alike (schedule_sim_spread_cpu.json's scan); 0.1 and below lose up to 7% where requests end together
MIN_SPREAD = 0.2


class KVReserve:
    """The estimate: how many tokens each sequence may still generate. Requests with a max_tokens within the
    clip ("bounded") and without ("open": no max_tokens, or one past the clip) learn separate ratios, so a
    chat's early stops do not shrink the estimate of requests that run to their max_tokens."""

    def __init__(self, block_size: int, max_model_len: int, ratio: float | None = None,
                 min_running: int = MIN_RUNNING, routed_experts: bool = False):
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"kv_reserve_ratio must be in [0, 1], got {ratio}")
        if min_running < 1:
            raise ValueError(f"kv_reserve_min_running must be >= 1, got {min_running}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.fixed_ratio = ratio
        self.min_running = min_running
        self.routed_experts = routed_experts  # the model has routed experts: greedy below min_running
        self._finished = {bounded: deque(maxlen=WINDOW) for bounded in (True, False)}  # (generated, allowed)
        self._sums = {bounded: [0, 0] for bounded in (True, False)}

    @staticmethod
    def bounded(seq: Sequence) -> bool:
        return seq.params.max_tokens is not None and seq.params.max_tokens <= CLIP_TOKENS

    def ratio_of(self, bounded: bool) -> float:
        if self.fixed_ratio is not None:
            return self.fixed_ratio
        generated, allowed = self._sums[bounded]
        return generated / allowed if allowed else INITIAL_RATIO[bounded]

    @property
    def ratio(self) -> float:
        """The bounded requests' ratio (the one a throughput protocol uses); 0 only when fixed at 0."""
        return self.ratio_of(True)

    @property
    def enabled(self) -> bool:
        return self.fixed_ratio != 0.0

    def reported_ratios(self) -> tuple[float, float]:
        """(bounded, open) as the metrics report them: both 0 when the ratio is fixed at 0; otherwise the ratios the
        reserve would use, also while fewer than min_running sequences run (where it applies only while their
        remaining lengths are spread, `applies`)."""
        return (self.ratio_of(True), self.ratio_of(False)) if self.enabled else (0.0, 0.0)

    def allowed_tokens(self, seq: Sequence) -> int:
        """Tokens the sequence may still generate: its max_tokens left, the context left, at most CLIP_TOKENS."""
        left = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return max(0, min(left, CLIP_TOKENS))

    def estimate(self, seq: Sequence) -> int:
        """Tokens the sequence is expected to generate still: its ratio x its allowed tokens."""
        return math.ceil(self.ratio_of(self.bounded(seq)) * self.allowed_tokens(seq))

    def applies(self, plan: ReservePlan, num_running: int) -> bool:
        """Whether admission checks the plan (module docstring): from min_running running sequences, or below
        while their remaining lengths are spread (a model without routed experts); greedy otherwise."""
        return num_running >= self.min_running or (not self.routed_experts and plan.spread >= MIN_SPREAD)

    def plan(self, running, waiting_with_blocks, block_manager, prompt_budget: int) -> ReservePlan:
        """The demand of the running sequences (and of a waiting one that already holds blocks: a chunked
        prompt, a preempted one ahead of it), for the admissions of one schedule call."""
        return ReservePlan(self, running, waiting_with_blocks, block_manager, prompt_budget)

    def record_finished(self, seq: Sequence) -> None:
        """A sequence that stopped or reached its length: what it generated against what it was allowed."""
        if self.fixed_ratio is not None:
            return
        allowed = min(CLIP_TOKENS, self.max_model_len - seq.num_prompt_tokens)
        if seq.params.max_tokens is not None:
            allowed = min(allowed, seq.params.max_tokens)
        if allowed <= 0:
            return
        bounded = self.bounded(seq)
        window, sums = self._finished[bounded], self._sums[bounded]
        generated = min(seq.num_known_output_tokens, allowed)
        if len(window) == window.maxlen:
            old_generated, old_allowed = window[0]
            sums[0] -= old_generated
            sums[1] -= old_allowed
        window.append((generated, allowed))
        sums[0] += generated
        sums[1] += allowed


class ReservePlan:
    """Blocks the running sequences will hold over their remaining steps, so a prompt is admitted only if the
    pool never runs out before they finish. Blocks a sequence holds alone (reference count 1) and its growth,
    one token a step until its estimate, go when it ends; blocks shared by several (prefix-cache hits, the
    common prompt of n samples) are counted as held to the end, and left out of the capacity with everything
    held by sequences outside the plan. Sequence i then holds base_i + t / block_size blocks t steps from now,
    base_i = its own blocks + the unfilled share of its last block's successor (tokens / block_size + 1 - table
    length), until its estimate e_i; the demand peaks just before one of them ends, so the peak is the largest,
    over k, of the sum over sequences with e_i >= e_k of base_i + e_k / block_size. A prompt computed in D
    chunks starts generating D - 1 steps later: its estimate is pushed back by that much (its growth counted
    from now: a few blocks too many). A sequence that ends early frees its blocks for the rest: that is what
    lets a mix of lengths run more sequences than the sum of their final sizes would (the nano-vllm protocol at
    Qwen3-30B-A3B's H100 pool: 71 rows a step with the final sizes against 83 with greedy admission), while
    requests that all end together (the 1,000 x 1,000 protocol) are admitted only as far as they all fit."""

    def __init__(self, reserve: KVReserve, running, waiting_with_blocks, block_manager, prompt_budget: int):
        self.reserve = reserve
        self.block_manager = block_manager
        self.block_size = bs = reserve.block_size
        self.prompt_budget = max(1, prompt_budget)
        blocks = block_manager.blocks
        self.entries: list[list[float]] = []  # [steps left, base blocks] a sequence
        # a sequence's first block held alone (the one after its leading run of shared blocks) -> (its entry, its
        # block table, that block's index): a prompt of this call that takes it over extends the run (admit)
        self.owner_of: dict[int, tuple[list[float], list[int], int]] = {}
        capacity = block_manager.num_free_blocks
        # reserve.estimate and _prefill_steps_left inlined: this loop runs every step a prompt waits
        ratio = {True: reserve.ratio_of(True), False: reserve.ratio_of(False)}
        clip, max_len, budget = CLIP_TOKENS, reserve.max_model_len, self.prompt_budget
        for seq in (*running, *waiting_with_blocks):
            table = seq.block_table
            shared = 0  # sharing is a prefix property: a leading run of blocks with other holders
            while shared < len(table) and blocks[table[shared]].ref_count > 1:
                shared += 1
            own = len(table) - shared
            tokens = len(seq.token_ids)
            allowed = max_len - tokens
            max_tokens = seq.params.max_tokens
            if max_tokens is not None:
                allowed = min(allowed, max_tokens - tokens + seq.num_prompt_tokens)
            left = math.ceil(ratio[max_tokens is not None and max_tokens <= clip] * max(0, min(allowed, clip)))
            prompt_left = tokens - seq.num_computed_tokens
            if prompt_left > budget:
                left += -(-prompt_left // budget) - 1
            entry = [left, own + tokens / bs + 1 - len(table)]
            self.entries.append(entry)
            if own:
                self.owner_of[table[shared]] = (entry, table, shared)
            capacity += own
        self.capacity = capacity
        self.final_total = sum(base + left / bs for left, base in self.entries)
        # the planned sequences' steps left: count, sum and sum of squares (ReservePlan.spread)
        self._steps = [len(self.entries), sum(e[0] for e in self.entries), sum(e[0] ** 2 for e in self.entries)]

    @property
    def spread(self) -> float:
        """How spread the planned sequences' ends are: the coefficient of variation (population standard
        deviation over mean) of their steps left, the prompts admitted so far included; 0 for no sequence, for
        one, or when all end now."""
        n, total, squares = self._steps
        if not n or total <= 0:
            return 0.0
        mean = total / n
        return math.sqrt(max(0.0, squares / n - mean * mean)) / mean

    def admit(self, seq: Sequence, hits: list[int], check: bool = True) -> bool:
        """Whether the pool holds the planned sequences and this one (its prefix-cache `hits`, as
        BlockManager.cached_prefix found them) at every step until they finish; if so it joins the plan.
        check=False: it joins unchecked (a prompt admitted greedily, for the admissions after it). The plan
        after it equals one built anew once it is allocated (the blocks it shares counted as in __init__)."""
        bs, blocks = self.block_size, self.block_manager.blocks
        # its leading run of hits other sequences hold: shared once it is allocated; the rest of its blocks are its
        # own (the revived cached ones and the fresh ones), as __init__ counts them
        lead = 0
        while lead < len(hits) and blocks[hits[lead]].ref_count:
            lead += 1
        in_use = lead + sum(1 for b in hits[lead:] if blocks[b].ref_count)  # not taken from the free list
        # a sequence whose first block held alone it hits: its leading shared run now runs on over every block
        # held by another too (a later prompt of this call that hits its next blocks finds it by the new first)
        moves, shift, taken = [], 0, None
        for b in hits:
            if blocks[b].ref_count == 1 and b in self.owner_of:
                if taken is None:
                    taken = set(hits)
                owner, table, first = self.owner_of[b]
                end = first + 1
                while end < len(table) and (blocks[table[end]].ref_count > 1 or table[end] in taken):
                    end += 1
                moves.append((b, owner, table, first, end))
                owner[1] -= end - first
                shift += end - first
        computed = len(hits) * bs  # after allocation
        chunks_left = max(0, -(-(seq.num_tokens - computed) // self.prompt_budget) - 1)
        entry = [self.reserve.estimate(seq) + chunks_left, seq.num_tokens / bs + 1 - lead]
        capacity = self.capacity + in_use - lead - shift
        final_total = self.final_total + entry[1] + entry[0] / bs - shift
        self.entries.append(entry)
        if check and final_total > capacity:  # the quick check: fits even if every sequence ran to its end
            self.entries.sort(key=lambda e: e[0], reverse=True)
            held, count, per_step = 0.0, 0, 1.0 / bs
            for left, base in self.entries:
                held += base
                count += 1
                if held + count * left * per_step > capacity:
                    # by identity: another sequence's entry may hold the same values
                    del self.entries[next(i for i, e in enumerate(self.entries) if e is entry)]
                    for _, owner, _, first, end in moves:
                        owner[1] += end - first
                    return False
        for b, owner, table, _, end in moves:
            del self.owner_of[b]
            if end < len(table):
                self.owner_of[table[end]] = (owner, table, end)
        # its first block held alone after allocation, if another prompt of this call may hit it: a cached block it
        # revives (fresh blocks are not hashed before the step is read back)
        if lead < len(hits):
            self.owner_of[hits[lead]] = (entry, hits, lead)
        self.capacity, self.final_total = capacity, final_total
        self._steps[0] += 1
        self._steps[1] += entry[0]
        self._steps[2] += entry[0] ** 2
        return True
