"""Paged KV block allocator with reference counts and prefix caching.

A full block is identified by a chained hash: hash(previous block's hash, its tokens), so
equal hashes mean equal prefixes. Freed blocks keep their hash and stay findable until
the allocator hands them out again (least recently freed first). A hit also compares the
stored tokens, which guards against hash collisions. At least one prompt token is always
recomputed so the last position has logits.
"""

from __future__ import annotations

from metainfer.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(prev_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((prev_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: dict[int, None] = dict.fromkeys(range(num_blocks))  # insertion-ordered set
        self.hash_to_block: dict[int, int] = {}
        # vLLM's prefix-cache stats: prompt tokens looked up / found at a request's admission, only where the cache
        # applies (on, and the request does not score its prompt); a preempted request's re-admission is counted
        # apart, so recomputation under memory pressure does not read as lookups that missed
        self.prefix_hit_tokens = 0
        self.prefix_query_tokens = 0
        self.preempted_hit_tokens = 0
        self.preempted_query_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix matching -------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids whose contents equal the sequence's leading full blocks, short of the block holding its
        last token: that token is always recomputed (its logits start the output), and recomputing it into a
        shared block would write into another sequence's cache (a block-aligned prompt: as vLLM, its last
        block is computed afresh)."""
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:  # those score every prompt token
            return []
        hits, prev = [], None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.block_tokens(i, self.block_size))
            prev = chain_hash(prev, tokens)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def blocks_to_allocate(self, seq: Sequence, hits: list[int] | None = None) -> int:
        """Free blocks `allocate` would take: all the sequence's blocks less its cached ones still in use
        (a freed cached block is taken from the free list). `hits`: cached_prefix(seq), if already found."""
        hits = self.cached_prefix(seq) if hits is None else hits
        in_use = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_needed(seq.num_tokens) - in_use

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_to_allocate(seq) <= len(self.free)

    def allocate(self, seq: Sequence, hits: list[int] | None = None) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached ones (`hits`: cached_prefix(seq),
        if already found; nothing may be allocated or freed in between)."""
        assert not seq.block_table, "sequence already has blocks"
        hits = self.cached_prefix(seq) if hits is None else hits
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(self.blocks_needed(seq.num_tokens) - len(hits)):
            seq.block_table.append(self._take_free_block())
        cached = len(hits) * self.block_size
        seq.num_computed_tokens = cached
        if not self.enable_prefix_caching or seq.prompt_logprobs is not None:
            return
        if seq.num_preemptions:
            self.preempted_hit_tokens += cached
            self.preempted_query_tokens += seq.num_tokens
        else:
            self.prefix_hit_tokens += cached
            self.prefix_query_tokens += seq.num_tokens

    def _take_free_block(self) -> int:
        block_id = next(iter(self.free))
        del self.free[block_id]
        block = self.blocks[block_id]
        if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
            del self.hash_to_block[block.hash]
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block_id

    # -- decode growth ---------------------------------------------------------------
    def can_append(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        extra = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return extra <= len(self.free)

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> None:
        while len(seq.block_table) < self.blocks_needed(seq.num_computed_tokens + num_new_tokens):
            seq.block_table.append(self._take_free_block())

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: hash blocks whose tokens are now all in the cache."""
        if not self.enable_prefix_caching:
            return
        bs, start = self.block_size, seq.num_hashed_blocks
        full = min(seq.num_computed_tokens, seq.num_known_tokens) // bs  # never hash a PENDING token
        prev = self.blocks[seq.block_table[start - 1]].hash if start else None
        for i in range(start, full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = tuple(seq.block_tokens(i, bs))
                block.hash, block.token_ids = chain_hash(prev, tokens), tokens
                self.hash_to_block.setdefault(block.hash, block.block_id)
            prev = block.hash
        seq.num_hashed_blocks = max(start, full)

    def free_sequence(self, seq: Sequence) -> None:
        """Register every full block the sequence computed (its last step's too: a finished request's
        prompt and reply stay findable for the same prompt or the next chat turn; a preempted one finds its
        own), then release in reverse so a prefix's tail is evicted before its head."""
        self.register_full_blocks(seq)
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
