"""Continuous-batching scheduler: one token budget a step shared by decodes and prefill chunks (vLLM v1).

A step first gives every running sequence one token (its decode row), then fills what is left of the
`max_num_batched_tokens` budget with waiting prompts in arrival order, the last one chunked to fit, so a long
prompt arriving never stalls the running streams: they get a token every step while it is prefilled in
chunks beside them. `max_mixed_prefill_tokens` (None: no cap) bounds the prompt tokens of a step that has
decode rows (Sarathi-Serve's stall-free budget), so each running stream's inter-token latency grows by at
most that much prefill work while prompts arrive; a step without decode rows takes the whole budget.
When blocks run out for a decode row, the most recently admitted running sequence is
preempted (blocks freed, recomputed later from its tokens), so nothing is lost and greedy output is unchanged;
a step that preempted (and still has decode rows) admits no waiting prompt. A prompt is admitted only if the
pool keeps room for what the running sequences may still generate (engine/kv_reserve.py), so requests that run
to their max_tokens are not preempted and recomputed over and over (vLLM admits greedily); below
kv_reserve_min_running running sequences only while their remaining lengths are spread. The samples of an
n > 1 request after the first wait until the first has computed (and the prefix cache registered) their common
prompt, so it is prefilled once. Three step kinds come out (`ScheduledBatch`): pure decode (rows longest
context first; the decode kernels and CUDA graphs), pure prefill, and mixed (decode rows first, then prefill
rows); the latter two run the prefill-with-context attention, a decode row being a 1-token query over its
context.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from metainfer.engine.block_manager import BlockManager
from metainfer.engine.kv_reserve import MIN_RUNNING, KVReserve
from metainfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class PromptLogprobRows:
    """The rows of a prefill step whose hidden states score the next prompt token (SamplingParams.prompt_logprobs):
    the token at position p + 1 is scored by row p's logits. Workers of a TP group get `rows` only (they take part
    in the LM head's gather; rank 0 alone reads the logprobs)."""

    rows: list[int]  # flat token rows of the step (a prefill step lays each sequence's new tokens out in order)
    targets: list[int]  # the scored prompt token of each row (rank 0)
    owners: list[tuple[Sequence, int]]  # (sequence, the scored token's position) of each row (rank 0)
    top_k: int  # the most top logprobs a scored sequence asks for (-1: the whole vocabulary)


def prompt_logprob_rows(seqs: list[Sequence]) -> PromptLogprobRows | None:
    """The scored rows of a prefill step over `seqs` (None when no sequence asks): positions p in the step's
    [first, first + n) with p + 1 < the prompt's length, i.e. the prompt's own tokens after the first."""
    rows, targets, owners, top_k, offset = [], [], [], 0, 0
    for seq in seqs:
        start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
        if seq.prompt_logprobs is not None:
            end = min(start + n, seq.num_prompt_tokens - 1)
            for p in range(start, end):
                rows.append(offset + p - start)
                targets.append(seq.token_ids[p + 1])
                owners.append((seq, p + 1))
            k = seq.params.prompt_logprobs
            top_k = -1 if -1 in (top_k, k) else max(top_k, k)
        offset += n
    return PromptLogprobRows(rows, targets, owners, top_k) if rows else None


@dataclass
class ScheduledBatch:
    """One step's rows. `is_prefill`: the step runs the prefill-with-context path (any prefill row; a mixed
    step's decode rows are 1-token queries there); False: a pure decode step. The first `num_decode_rows` rows
    are decode rows (running sequences' next token), the rest prefill rows (prompt chunks, recomputations)."""

    seqs: list[Sequence]
    is_prefill: bool
    num_decode_rows: int = 0
    prompt_logprobs: PromptLogprobRows | None = None  # set by the scheduler (prompt_logprob_rows) on prefill steps

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_rows if self.is_prefill else 0

    @property
    def is_mixed(self) -> bool:
        return self.is_prefill and self.num_decode_rows > 0

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample a token this step (a chunked prefill's non-final chunks do not)."""
        return [s for s in self.seqs if s.will_sample]

    def subset(self, seqs: list[Sequence]) -> ScheduledBatch:
        """Some of these rows (their order kept, so decode rows stay first) as a batch of their own."""
        decode_rows = {id(s) for s in self.seqs[: self.num_decode_rows]}
        num_decode = sum(id(s) in decode_rows for s in seqs)
        prefill = num_decode < len(seqs)
        return replace(self, seqs=seqs, is_prefill=prefill, num_decode_rows=num_decode,
                       prompt_logprobs=prompt_logprob_rows(seqs) if prefill else None)


def _longest_first(seqs: list[Sequence]) -> list[Sequence]:
    return sorted(seqs, key=lambda seq: seq.num_tokens, reverse=True)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, max_mixed_prefill_tokens: int | None = None,
                 kv_reserve_ratio: float | None = None, kv_reserve_min_running: int = MIN_RUNNING,
                 routed_experts: bool = False):
        self.block_manager = block_manager
        # routed_experts: the model's (ModelSpec.moe_layers): below kv_reserve_min_running it admits greedily
        self.kv_reserve = KVReserve(block_manager.block_size, max_model_len, kv_reserve_ratio, kv_reserve_min_running,
                                    routed_experts)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_mixed_prefill_tokens = max_mixed_prefill_tokens or max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch | None:
        """Decode rows for the running sequences, then prefill rows in the budget left (see the module doc)."""
        preempted_before = self.num_preemptions
        decodes = self._schedule_decodes()
        budget = self.max_num_batched_tokens - len(decodes)
        if decodes:
            budget = min(budget, self.max_mixed_prefill_tokens)
        # a step that preempted a running sequence for blocks admits no prompt (it would take them back)
        admit = not decodes or self.num_preemptions == preempted_before
        prefills = self._schedule_prefills(budget) if admit else []
        if prefills:
            seqs = decodes + prefills
            return ScheduledBatch(seqs, is_prefill=True, num_decode_rows=len(decodes),
                                  prompt_logprobs=prompt_logprob_rows(seqs))
        if not decodes:
            return None
        # rows longest context first (the running order, which preemption follows, is kept): the decode
        # attention starts its programs in row order, so the longest ones stay out of the launch's last
        # wave (ragged contexts ran 7% below uniform ones, docs/PERFORMANCE.md)
        return ScheduledBatch(_longest_first(decodes), is_prefill=False, num_decode_rows=len(decodes))

    def _schedule_prefills(self, budget: int) -> list[Sequence]:
        scheduled: list[Sequence] = []
        bm, reserve = self.block_manager, None  # the running sequences' future demand (kv_reserve.ReservePlan)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                if self._sibling_prefilling(seq, scheduled):
                    break
                hits = bm.cached_prefix(seq)
                if bm.blocks_to_allocate(seq, hits) > bm.num_free_blocks:
                    break
                # the reserve from kv_reserve_min_running running sequences, and below while their remaining
                # lengths are spread (KVReserve.applies; no plan below for a model with routed experts); greedy
                # admission (vLLM's) otherwise and at ratio 0; an idle engine admits whatever fits (a reserve larger
                # than the pool waits on nothing). A prompt admitted greedily joins the plan unchecked, so the
                # spread and the admissions checked after it count it.
                if self.running and self.kv_reserve.enabled and (
                        not self.kv_reserve.routed_experts or len(self.running) >= self.kv_reserve.min_running):
                    if reserve is None:
                        prompt_budget = min(self.max_num_batched_tokens - len(self.running),
                                            self.max_mixed_prefill_tokens)
                        reserve = self.kv_reserve.plan(self.running, [s for s in self.waiting if s.block_table],
                                                       bm, prompt_budget)
                    if not reserve.admit(seq, hits, check=self.kv_reserve.applies(reserve, len(self.running))):
                        break
                bm.allocate(seq, hits)
                if seq.num_preemptions == 0 and seq.num_output_tokens == 0:
                    seq.num_cached_prompt_tokens = seq.num_computed_tokens
            remaining = seq.num_tokens - seq.num_computed_tokens
            seq.num_scheduled_tokens = min(remaining, budget)
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < remaining:
                break  # chunked: the rest of this prompt runs in later steps
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled

    def _sibling_prefilling(self, seq: Sequence, scheduled: list[Sequence]) -> bool:
        """A fresh sample of an n > 1 request waits while an earlier sample of it computes their common
        prompt, whose full blocks it then finds in the prefix cache (hashed when that step is read back):
        the prompt is prefilled once, not n times, for a step or two of the later samples' first token."""
        bm = self.block_manager
        shareable = (seq.num_prompt_tokens - 1) // bm.block_size
        if seq.index == 0 or not bm.enable_prefix_caching or not shareable or seq.num_output_tokens:
            return False
        return any(other.request_id == seq.request_id and other.num_hashed_blocks < shareable
                   for other in (*self.running, *scheduled) if other.block_table)

    def _schedule_decodes(self) -> list[Sequence]:
        """One token for each running sequence (running order), at most the token budget of them."""
        scheduled: list[Sequence] = []
        done: list[Sequence] = []  # last token in flight (async scheduling); finishes on read-back
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)  # one token per sequence
        while self.running and len(scheduled) < limit:
            seq = self.running.popleft()
            if seq.reached_length_limit(self.max_model_len):
                done.append(seq)
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                self.block_manager.append_slots(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled + done))
        return scheduled

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and queue it first, after a prompt part-way through its chunks: that one
        holds blocks and needs none to go on, while the preempted one may not fit until it finishes (ahead of
        it, neither would ever run)."""
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(1 if self.waiting and self.waiting[0].block_table else 0, seq)

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance computed counts once the step is launched (its K/V will be in the cache
        before any later step runs). Prefix-cache hashing waits for the tokens' values:
        LLMEngine calls BlockManager.register_full_blocks when it reads the step back."""
        for seq in batch.seqs:
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks (registered first: free_sequence)."""
        seq.status = SequenceStatus.FINISHED
        seq.drop_pending()
        if seq.finish_reason in ("stop", "length"):
            self.kv_reserve.record_finished(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.block_manager.free_sequence(seq)
