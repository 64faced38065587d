"""KV room a prompt's admission leaves for the running sequences' future tokens.

vLLM admits a waiting prompt whenever its prompt fits, and when the pool later runs out for a decode row it
preempts the newest sequence and recomputes it from scratch. When requests run to their max_tokens together
that repeats all along the run: the 1,000 x 1,000 protocol at the H200's bf16 pool (49,601 blocks) preempts 200
times and recomputes 330k prompt tokens, a third of its prompts again (`tools/schedule_sim.py`). SGLang keeps
room for what the running requests may still generate (its new-token ratio); so does this, with the demand's
peak instead of its sum: a prompt is admitted only if the pool holds the running sequences and it at every
step until each has generated its estimate (ReservePlan), so one that ends early frees room for the rest.
A sequence's estimate is `ratio` x the tokens it may still generate: its max_tokens left, at most the
context left and at most CLIP_TOKENS (a request without max_tokens would otherwise claim the whole
context). `ratio` is fixed (`EngineConfig.kv_reserve_ratio`; 0 is vLLM's greedy admission) or learned: tokens
generated over tokens allowed by the last WINDOW sequences that finished (stop or length), 1.0 before one has.
Requests that run to max_tokens are then never preempted; a chat whose replies stop early is estimated by what
its replies take. Preemption stays the fallback when the estimate is short.
"""

from __future__ import annotations

import math
from collections import deque

from metainfer.engine.sequence import Sequence

CLIP_TOKENS = 4096  # most future tokens counted for one sequence (SGLang clips its estimate alike)
WINDOW = 256  # finished sequences the learned ratio averages over


class KVReserve:
    def __init__(self, block_size: int, max_model_len: int, ratio: float | None = None):
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(f"kv_reserve_ratio must be in [0, 1], got {ratio}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.fixed_ratio = ratio
        self._finished: deque[tuple[int, int]] = deque(maxlen=WINDOW)  # (generated, allowed)
        self._generated = 0
        self._allowed = 0

    @property
    def ratio(self) -> float:
        if self.fixed_ratio is not None:
            return self.fixed_ratio
        return self._generated / self._allowed if self._allowed else 1.0

    def allowed_tokens(self, seq: Sequence) -> int:
        """Tokens the sequence may still generate: its max_tokens left, the context left, at most CLIP_TOKENS."""
        left = self.max_model_len - seq.num_tokens
        if seq.params.max_tokens is not None:
            left = min(left, seq.params.max_tokens - seq.num_output_tokens)
        return max(0, min(left, CLIP_TOKENS))

    def plan(self, running, free_blocks: int) -> ReservePlan:
        """The running sequences' future demand, for the admissions of one schedule call."""
        return ReservePlan(self, running, free_blocks)

    def record_finished(self, seq: Sequence) -> None:
        """A sequence that stopped or reached its length: what it generated against what it was allowed."""
        if self.fixed_ratio is not None:
            return
        allowed = min(CLIP_TOKENS, self.max_model_len - seq.num_prompt_tokens)
        if seq.params.max_tokens is not None:
            allowed = min(allowed, seq.params.max_tokens)
        if allowed <= 0:
            return
        generated = min(seq.num_known_output_tokens, allowed)
        if len(self._finished) == self._finished.maxlen:
            old_generated, old_allowed = self._finished[0]
            self._generated -= old_generated
            self._allowed -= old_allowed
        self._finished.append((generated, allowed))
        self._generated += generated
        self._allowed += allowed


class ReservePlan:
    """Blocks the running sequences will hold over their remaining steps, so a prompt is admitted only if the
    pool never runs out before they finish. Sequence i holds about (tokens_i + t) / block_size + 1 blocks t
    steps from now, until it has generated its estimate ratio x allowed_i; the demand peaks just before one
    of them ends, so the peak is the largest, over the estimates e_k, of the sum over sequences still running
    at e_k of their blocks then. A sequence that ends early frees its blocks for the rest: that is what lets a
    mix of lengths run more sequences than the sum of their final sizes would (the nano-vllm protocol at
    Qwen3-30B-A3B's H100 pool: 71 rows a step with the final sizes against 83 with greedy admission), while
    requests that all end together (the 1,000 x 1,000 protocol) are admitted only as far as they all fit."""

    def __init__(self, reserve: KVReserve, running, free_blocks: int):
        self.block_size = bs = reserve.block_size
        self.reserve = reserve
        self.ratio = ratio = reserve.ratio
        # (steps left, blocks now) of each running sequence, as _entry; inlined: this runs every step a prompt waits
        clip, max_len = CLIP_TOKENS, reserve.max_model_len
        entries, held = [], 0
        for seq in running:
            tokens = len(seq.token_ids)
            left = max_len - tokens
            max_tokens = seq.params.max_tokens
            if max_tokens is not None:
                left = min(left, max_tokens - tokens + seq.num_prompt_tokens)
            entries.append((math.ceil(ratio * max(0, min(left, clip))), tokens / bs + 1))
            held += len(seq.block_table)
        self.capacity = free_blocks + held
        self.entries = entries
        self.final_total = sum(blocks for _, blocks in entries) + sum(left for left, _ in entries) / bs

    def _entry(self, seq: Sequence) -> tuple[int, float]:
        return math.ceil(self.ratio * self.reserve.allowed_tokens(seq)), seq.num_tokens / self.block_size + 1

    def admit(self, seq: Sequence) -> bool:
        """Whether the pool holds the running sequences and this one at every step until they finish; if so
        it is counted with them for the next prompt of this call."""
        entry = self._entry(seq)
        final = entry[1] + entry[0] / self.block_size
        self.entries.append(entry)
        if self.final_total + final > self.capacity:  # the quick check: fits even if every sequence ran to its end
            self.entries.sort(reverse=True)  # by steps left; after the first, one insertion: timsort's linear case
            held, count, per_step = 0.0, 0, 1.0 / self.block_size
            for left, blocks in self.entries:
                held += blocks
                count += 1
                if held + count * left * per_step > self.capacity:
                    self.entries.remove(entry)
                    return False
        self.final_total += final
        return True
