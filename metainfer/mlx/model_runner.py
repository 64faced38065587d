"""MLXModelRunner: the ModelRunner contract (`num_blocks`, `execute(batch) -> SampledBatch | None`) with the
forward computed in MLX; LLMEngine builds it for `device="mlx"` and drives it like the torch runner.

A step: the scheduled batch's ints packed (decode: ids, positions and block tables, three small int32
arrays; the slots, gather indices and mask are computed from them inside the graph), one lazy MLX graph for
the whole forward (every layer's K/V stored into the paged pool in the same graph, paged_kv.py), one
`mx.eval`. A batch whose every row is greedy without penalties or logprobs (min_tokens allowed: its stop ids
are masked by an additive [rows, V] mask, cached per banned set) takes its argmax inside that graph, so the
step's one eval yields the token ids; any other batch goes to the engine's own torch Sampler on the logits
(fp32, moved through numpy without a copy), so every SamplingParams field behaves exactly as on the torch
path (the greedy rows stay in MLX because torch's sampler runs on OpenMP threads that contend with other
processes for a shared CPU).
No async scheduling: the next step's inputs need this step's tokens on the host.

Decode steps run one `mx.compile`d function (the whole forward: embedding to logits, the pools in and out, so
the K/V stores stay in the graph and in place) traced once per (batch rows, table-width bucket): tables are
padded to a power-of-two width, so a sequence growing to 1,024 tokens retraces 7 times, not 64. A tiny
model's decode step, profiled end to end: docs/results/mlx_decode_profile.json. `enforce_eager=True` (the
CUDA-graph switch's meaning: no captured/compiled step) runs the same forward eagerly. Prefill and mixed
steps run eagerly (their shapes change every step).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import torch

from metainfer.config import ConfigError, EngineConfig
from metainfer.engine.scheduler import PromptLogprobRows, ScheduledBatch
from metainfer.mlx.paged_kv import DecodeAttention, PagedKVPool, PrefillAttention
from metainfer.mlx.weights import load_model
from metainfer.worker.sampler import PROMPT_SCORE_ROWS, PromptScores, SampledBatch, Sampler

log = logging.getLogger("metainfer")


def _greedy_without_extras(seq) -> bool:
    p = seq.params
    return p.greedy and not p.has_penalties and not p.has_token_constraints and p.logprobs is None


class MLXModelRunner:
    def __init__(self, config: EngineConfig, eos_token_ids: tuple = ()):
        self.config, self.spec = config, config.spec
        self.block_size = config.block_size
        mx.random.seed(config.seed)
        torch.manual_seed(config.seed)
        self.model = load_model(config)
        self.dtype = self.model.dtype
        spec = self.spec
        self.num_blocks = self._decide_num_blocks()
        self.kv = PagedKVPool(spec.num_layers, self.num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim,
                              self.dtype)
        self.eos_token_ids = tuple(eos_token_ids)
        self.sampler = Sampler(spec.vocab_size, self.eos_token_ids, "cpu", seed=config.seed)
        self._decode_forward = self._decode_graph if config.enforce_eager else mx.compile(self._decode_graph)
        self._bans: dict = {}  # greedy masks: (rows, banned pairs) -> [rows, V]; rows -> zeros
        self.graph_batch_sizes: list[int] = []  # no CUDA graphs (the bench reports this field)
        self._prompt_scores: PromptScores | None = None  # the last prefill's scored prompt tokens (compute_logits)

    # -- one step ---------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch) -> SampledBatch | None:
        sampling = batch.sampling_seqs
        greedy = bool(sampling) and all(_greedy_without_extras(s) for s in sampling)
        prompt = None
        if batch.is_prefill:
            logits = self.compute_logits(batch)
            ids = self._argmax(logits, self._ban(sampling)) if greedy else None
            prompt = self._prompt_scores
        else:
            logits, ids = self._decode(batch, self._ban(sampling) if greedy else None)
        if not sampling:  # a chunk that samples nothing may still score prompt tokens
            return None if prompt is None else SampledBatch(torch.empty(0, dtype=torch.long), [], prompt=prompt)
        if greedy:
            return SampledBatch(torch.from_numpy(np.array(ids).astype(np.int64)), [None] * len(sampling),
                                prompt=prompt)
        with torch.inference_mode():
            sampled = self.sampler(torch.from_numpy(np.array(logits, copy=False)), sampling)
        sampled.prompt = prompt
        return sampled

    def _score_prompt(self, hidden: mx.array, scored: PromptLogprobRows) -> PromptScores:
        """The step's scored prompt tokens (SamplingParams.prompt_logprobs): the LM head over their rows of the
        evaluated hidden states in pieces of PROMPT_SCORE_ROWS rows, scored on the host as the torch path does."""
        rows, parts, piece = mx.array(scored.rows), [], PROMPT_SCORE_ROWS
        targets = torch.tensor(scored.targets, dtype=torch.long)
        for start in range(0, len(scored.rows), piece):
            logits = self.model.logits(hidden[rows[start:start + piece]])[:, : self.spec.vocab_size]
            mx.eval(logits)
            with torch.inference_mode():
                parts.append(PromptScores.of(torch.from_numpy(np.array(logits, copy=False)),
                                             targets[start:start + piece], scored.top_k))
        return PromptScores.cat(parts)

    def _ban(self, seqs) -> mx.array:
        """The additive [rows, V] mask of the greedy argmax: rows short of min_tokens get their stop ids (and
        EOS unless ignore_eos) at -inf, exactly as Sampler._mask_stop_tokens does. Built once per distinct
        set of banned (row, id) pairs and reused: a long min_tokens run bans the same ids every step."""
        pairs = []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                ids = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(self.eos_token_ids))
                pairs += [(row, i) for i in ids if 0 <= i < self.spec.vocab_size]
        if not pairs:
            return self._zero_ban(len(seqs))
        key = (len(seqs), tuple(pairs))
        ban = self._bans.get(key)
        if ban is None:
            host = np.zeros((len(seqs), self.spec.vocab_size), dtype=np.float32)
            for row, i in pairs:
                host[row, i] = -np.inf
            ban = self._bans[key] = mx.array(host)
            if len(self._bans) > 64:  # distinct sets are few (per batch size); bound it anyway
                self._bans.pop(next(iter(self._bans)))
        return ban

    def _argmax(self, logits: mx.array, ban: mx.array) -> mx.array:
        ids = mx.argmax(logits[:, : self.spec.vocab_size] + ban, axis=-1)
        mx.eval(ids)
        return ids

    def compute_logits(self, batch: ScheduledBatch) -> mx.array:
        """The forward of one batch: fp32 logits [sampling rows, V], evaluated (the pools with them). A prefill step
        that scores prompt tokens leaves their scores in `_prompt_scores` (execute reads them)."""
        if not batch.is_prefill:
            return self._decode(batch, None)[0]
        logits, hidden = self._prefill(batch)
        scored = batch.prompt_logprobs
        self._prompt_scores = self._score_prompt(hidden, scored) if scored is not None else None
        return logits

    def _prefill(self, batch: ScheduledBatch) -> tuple[mx.array, mx.array]:
        """A prefill or mixed step, one `mx.eval`: the sampling rows' logits and the step's hidden states (kept
        evaluated for the prompt tokens it scores)."""
        ids, positions, step, rows = self._prefill_inputs(batch)
        hidden = self.model.forward(mx.array(ids), mx.array(positions), step, self.kv)
        logits = self.model.logits(hidden[mx.array(rows)] if len(rows) != len(ids) else hidden)
        mx.eval(logits, hidden, self.kv.k, self.kv.v)
        return logits, hidden

    def _decode(self, batch: ScheduledBatch, ban: mx.array | None) -> tuple[mx.array, mx.array | None]:
        """One decode step, one `mx.eval`: (logits, the greedy ids with `ban` added); with `ban` None the
        logits are what is read (the argmax, over a cached zero mask, is left unevaluated)."""
        ids, positions, tables = self._decode_inputs(batch)
        wanted = ban
        if ban is None:
            ban = self._zero_ban(len(batch.seqs))
        pools = self._take_pools()
        try:
            outputs = self._decode_forward(ids, positions, tables, ban, *pools)
        except BaseException:
            self._put_pools((None, None, *pools))  # a failed trace leaves the pools as they were
            raise
        del pools
        logits, greedy = self._put_pools(outputs)
        mx.eval(greedy if wanted is not None else logits, self.kv.k, self.kv.v)
        return logits, (greedy if wanted is not None else None)

    def _zero_ban(self, rows: int) -> mx.array:
        ban = self._bans.get(rows)
        if ban is None:
            ban = self._bans[rows] = mx.zeros((rows, self.spec.vocab_size), dtype=mx.float32)
            mx.eval(ban)  # held across steps, which may run on another thread (the server's)
        return ban

    def _decode_graph(self, ids, positions, tables, ban, *pools):
        """The decode forward and its greedy argmax as a pure function of the inputs (what mx.compile
        traces): (logits, argmax(logits + ban), *pools)."""
        layers = len(self.model.layers)
        kv = PagedKVPool.of(list(pools[:layers]), list(pools[layers:]))
        step = DecodeAttention.from_tables(tables, positions, self.block_size, self.dtype)
        logits = self.model.logits(self.model.forward(ids, positions, step, kv))
        greedy = mx.argmax(logits[:, : self.spec.vocab_size] + ban, axis=-1)
        return (logits, greedy, *kv.k, *kv.v)

    def _take_pools(self) -> list[mx.array]:
        """Hand the pools to the step (no reference kept here, so MLX can update them in place)."""
        pools = self.kv.k + self.kv.v
        self.kv.k, self.kv.v = [], []
        return pools

    def _put_pools(self, outputs) -> tuple[mx.array, mx.array]:
        layers = len(self.model.layers)
        self.kv.k, self.kv.v = list(outputs[2:2 + layers]), list(outputs[2 + layers:])
        return outputs[0], outputs[1]

    def _decode_inputs(self, batch: ScheduledBatch):
        """ids, positions int32 [B]; block tables int32 [B, W], W padded to a power of two (few compiled shapes)."""
        seqs = batch.seqs
        positions = [s.num_computed_tokens for s in seqs]
        ids = [s.token_ids[p] for s, p in zip(seqs, positions)]
        longest = max(len(s.block_table) for s in seqs)
        width = 1 << (longest - 1).bit_length()
        tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
        return mx.array(ids, dtype=mx.int32), mx.array(positions, dtype=mx.int32), mx.array(tables, dtype=mx.int32)

    def _prefill_inputs(self, batch: ScheduledBatch):
        bs = self.block_size
        ids, positions, slots, spans, rows, row = [], [], [], [], [], 0
        for seq in batch.seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            ids.extend(seq.token_ids[start:start + n])
            pos = np.arange(start + n, dtype=np.int64)
            ctx_slots = (np.asarray(seq.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs).astype(np.int32)
            positions.append(pos[start:].astype(np.int32))
            slots.append(ctx_slots[start:])
            spans.append((row, n, ctx_slots))
            row += n
            if seq.will_sample:
                rows.append(row - 1)
        step = PrefillAttention(np.concatenate(slots), spans)
        return (np.asarray(ids, dtype=np.int32), np.concatenate(positions), step, np.asarray(rows, dtype=np.int32))

    # -- the KV pool ----------------------------------------------------------------------------
    def _decide_num_blocks(self) -> int:
        cfg, spec = self.config, self.spec
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        useful = cfg.max_num_seqs * -(-cfg.max_model_len // self.block_size)
        per_block = PagedKVPool.bytes_per_block(spec.num_layers, self.block_size, spec.num_kv_heads, spec.head_dim,
                                                self.dtype.size)
        blocks = min(int(cfg.cpu_kv_cache_gib * 2**30) // per_block, useful)
        if blocks < 1:
            raise ConfigError("cpu_kv_cache_gib leaves no room for one KV block; raise it or set num_kv_blocks")
        log.info("MLX KV pool: %d blocks of %d tokens (%.2f GiB)", blocks, self.block_size,
                 blocks * per_block / 2**30)
        return int(blocks)

    def decode_weight_bytes(self) -> int:
        """Bytes a batch-1 decode step reads: every weight array, the embedding table counted only as the
        tied LM head (an untied table is read one row a token)."""
        model = self.model
        table = model.embed.table.arrays()
        skip = {id(a) for a in table} if model.lm_head is not model.embed.table else set()
        return sum(a.nbytes for a in model.arrays() if id(a) not in skip)

    def close(self) -> None:
        pass
