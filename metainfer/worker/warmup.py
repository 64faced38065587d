"""Warm-up at build: run one step of every shape class the engine can launch, so that every Triton kernel
variant is compiled (or loaded from Triton's on-disk cache) before the engine reports ready and serving never
JIT-compiles (a prefix hit's first 16-token prefill compiled the prefill kernel's BLOCK_M 16 variant mid-run:
954 ms against 48.6 ms for the repeat, H200).

A Triton kernel compiles one variant per distinct specialisation: its constexprs (here chosen on the host from
shapes: the prefill attention's BLOCK_M from the longest query, the fused MoE's launch config from its token
bucket, the skinny GEMM's BLOCK_M from the row count, the decode attention's split layout from batch and table
width) and each non-constexpr int's class (1, a multiple of 16, other) and pointer's 16-byte alignment. All of
them are functions of a step's token count T, its longest query, its sampling rows and (eager decode) its rows
and table width, so the warm-up runs (`warmup_plan`):
  prefill    one sequence of n new tokens, for n in `warmup_lengths` (1, every power of two up to the token
             budget and each one plus one, ...: every T class in every MoE bucket and prefill BLOCK_M);
  prefix     the same n after a cached context (a prefix hit, a later chunk; MLA keeps these absorbed);
  chunk      the same n, not sampling (a chunked prompt's non-final chunk: no logits);
  mixed      a decode row beside a prefill of n (the unified schedule's steps);
  decode     every decode row count in `decode_row_counts` (each CUDA-graph bucket and the count after it:
             the LM head's and the sampler's row classes), replaying the graphs; where a decode runs eagerly
             (enforce_eager, rows above the largest graph) also every power-of-two table width.
The steps go through `ModelRunner.execute` (under TP the workers run them too) with throw-away sequences over
real KV blocks (their contents are overwritten before any request reads them; nothing is hashed). The sampler's
fused kernel compiles its own variants at construction (kernels/sampling.py). On the CPU (torch references)
nothing compiles and the model runner skips the warm-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from metainfer.engine.scheduler import ScheduledBatch
from metainfer.engine.sequence import Sequence, SequenceStatus
from metainfer.sampling_params import SamplingParams

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def warmup_lengths(max_tokens: int) -> list[int]:
    """1, then 2^k and 2^k + 1 up to `max_tokens`, `max_tokens` itself and the largest multiple of 16 below it
    (the last, partial power-of-two bucket's two int classes)."""
    out, p = {1, max_tokens} | ({max_tokens // 16 * 16} if max_tokens >= 16 else set()), 2
    while p <= max_tokens:
        out.update(n for n in (p, p + 1) if n <= max_tokens)
        p *= 2
    return sorted(out)


def decode_row_counts(max_num_seqs: int, graph_sizes: list[int]) -> list[int]:
    """Every graph bucket and the count after it (a bucket's padded rows are not the LM head's), and the
    `warmup_lengths` classes up to max_num_seqs (the eager rows above the largest bucket, or all without graphs)."""
    counts = {n for b in graph_sizes for n in (b, b + 1) if n <= max_num_seqs}
    return sorted(counts | set(warmup_lengths(max_num_seqs)))


@dataclass(frozen=True)
class WarmupStep:
    """One step to run: `kind` (prefill, prefix, chunk, mixed, decode), its prefill rows' new tokens and context
    before them, its decode rows and their table width in blocks (0: just what the context needs)."""

    kind: str
    new_tokens: int = 0
    context: int = 0
    decode_rows: int = 0
    table_width: int = 0


def warmup_plan(max_num_batched_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int,
                graph_sizes: list[int], eager_decode_rows: int) -> list[WarmupStep]:
    """The steps of every shape class (module docstring). `graph_sizes`: the captured decode buckets;
    decode row counts above `eager_decode_rows` (the largest bucket; 0 without graphs) run eagerly and are
    also run at each power-of-two table width."""
    steps = []
    for n in warmup_lengths(min(max_num_batched_tokens, max_model_len)):
        steps.append(WarmupStep("prefill", n))
        if n + block_size <= max_model_len:
            steps.append(WarmupStep("prefix", n, context=block_size))
        if n < max_model_len:  # a chunk leaves at least one token for a later step
            steps.append(WarmupStep("chunk", n))
        if n < max_num_batched_tokens and max_num_seqs > 1:
            steps.append(WarmupStep("mixed", n, decode_rows=1))
    full_width = -(-max_model_len // block_size)
    widths = sorted({w for w in warmup_lengths(full_width) if w & (w - 1) == 0} | {full_width})
    for rows in decode_row_counts(max_num_seqs, graph_sizes):
        for width in (widths if rows > eager_decode_rows else [0]):
            steps.append(WarmupStep("decode", decode_rows=rows, table_width=width))
    return steps


class BlockCycle:
    """Block ids for throw-away sequences: the pool's blocks in turn (reused when the pool is small)."""

    def __init__(self, num_blocks: int):
        self.num_blocks, self.next = num_blocks, 0

    def take(self, n: int) -> list[int]:
        out = [(self.next + i) % self.num_blocks for i in range(n)]
        self.next = (self.next + n) % self.num_blocks
        return out


def _sequence(blocks: BlockCycle, block_size: int, computed: int, scheduled: int, width: int = 0) -> Sequence:
    """A sequence with `computed` tokens in its cache and `scheduled` more to run (token id 0 throughout)."""
    total = computed + scheduled
    seq = Sequence("warmup", 0, [0] * total, _GREEDY)
    seq.block_table = blocks.take(max(-(-total // block_size), width))
    seq.num_computed_tokens, seq.num_scheduled_tokens = computed, scheduled
    seq.status = SequenceStatus.RUNNING
    return seq


def warmup_batch(step: WarmupStep, blocks: BlockCycle, block_size: int) -> ScheduledBatch:
    """The ScheduledBatch of one warm-up step."""
    decodes = [_sequence(blocks, block_size, 1 + i % block_size, 1, step.table_width)
               for i in range(step.decode_rows)]
    if step.kind == "decode":
        return ScheduledBatch(decodes, is_prefill=False, num_decode_rows=len(decodes))
    prefill = _sequence(blocks, block_size, step.context, step.new_tokens)
    if step.kind == "chunk":  # one more prompt token left for a later step: this chunk samples nothing
        prefill.token_ids.append(0)
    return ScheduledBatch(decodes + [prefill], is_prefill=True, num_decode_rows=len(decodes))


def run_warmup(runner, steps: list[WarmupStep], synchronize=None) -> float:
    """Run every step through `runner.execute` (rank 0: the workers follow); returns the seconds taken."""
    start = time.perf_counter()
    blocks = BlockCycle(runner.num_blocks)
    for step in steps:
        batch = warmup_batch(step, blocks, runner.block_size)
        runner.execute(batch)
        for seq in batch.seqs:
            seq.status = SequenceStatus.FINISHED  # a TP step encoder forgets them at the next step
    if synchronize is not None:
        synchronize()
    return time.perf_counter() - start
