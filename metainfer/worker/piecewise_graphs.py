"""Piecewise CUDA graphs for prefill and mixed steps: every layer's work but the attention itself captured per
token bucket, the attention run eagerly between the pieces (vLLM v1's piecewise graphs, without torch.compile).

Why: an eager step launches ~17 kernels a layer from Python (~30 us each: ~20 ms a step for 36 layers), more
than the GPU time of a mixed step of a few hundred tokens, so a mixed step (decode rows beside a new prompt's
prefill, issue 23's unified schedule) was host-bound: its inter-token gap twice a decode step's. Attention is
what cannot be captured for every step alike (its grid and lengths follow the batch's sequences); everything
else, the K/V store included, only depends on the token count, so each bucket of T_b tokens holds L + 1 graphs:

  piece 0      the step inputs (ids, positions; PENDING tokens from the sampled ids), embedding, layer 0's
               norm, q/k/v (or MLA q / latent) projections and K/V store (`backend.store`)
  piece i      layer i-1's o_proj, post-attention norm and MLP/MoE, layer i's norm, projections and store
  piece L      the last layer's o_proj, norm and MLP, the final norm -> `hidden` [T_b, H]

A bucket's steps are packed at one layout (`pack_step(token_rows=T_b)`: the token fields at fixed offsets of
the staging buffer, padded rows with slot -1), so the captured step inputs and stores read each replay's
values in place. Each piece ends by copying the store's query into one static buffer shared by every layer
and bucket; `backend.attend` runs eagerly on its first T rows under the step's metadata (prefill and decode
kernels only: two launches a layer for a dense mixed step; MLA adds its absorb / value-up GEMMs, the value-up
writing its rows in place) and writes into one static output the next piece reads.
Rows T..T_b are padding: their ids are 0, they store nothing and their attention output is whatever the buffer
held; rows never mix outside attention, so they cannot reach the real rows, and the logits are taken at the
real rows only.

Memory: the pieces have a pool of their own. A tensor made in piece i and read in piece i+1 (a layer's MLP
output) is released after piece i+1's capture and may be reused by later pieces, which is safe because a
bucket's pieces always replay in capture order, one bucket at a time. Each bucket keeps its final `hidden`
[T_b, H] (sum of the buckets' rows x H: ~186 MiB at Qwen3-8B dims in bf16). Capture runs a throw-away prefill
of T_b tokens over real KV blocks (worker/warmup.py's) that stores nothing (slots -1: a re-capture on a serving
engine, `ModelRunner.swap_kernels`, must not overwrite cached K/V), largest bucket first.
Multi-GPU TP inside the pieces (its all-reduces captured; NCCL above the custom all-reduce's size) has not run on
a GPU yet.
"""

from __future__ import annotations

import torch

from metainfer.attention import forward_context, get_attention_metadata
from metainfer.engine.scheduler import ScheduledBatch
from metainfer.worker.cuda_graphs import no_gc_during_capture
from metainfer.worker.step_inputs import pack_step
from metainfer.worker.warmup import BlockCycle, WarmupStep, warmup_batch


def piecewise_buckets(max_tokens: int) -> list[int]:
    """Token buckets: 16 .. 128 by 16, 160 .. 512 by 32, 576 .. 1,024 by 64, 1,152 .. 2,048 by 128, then by 256
    (padding at most 1/4 above 128 tokens, 1/8 above 512), cut at `max_tokens` (which is added as the last bucket)."""
    sizes = [*range(16, 129, 16), *range(160, 513, 32), *range(576, 1025, 64), *range(1152, 2049, 128),
             *range(2304, max_tokens + 1, 256)]
    out = [b for b in sizes if b < max_tokens]
    return out + [max_tokens] if max_tokens > 0 else []


def _capture_batch(num_tokens: int, max_len: int, blocks: BlockCycle, block_size: int) -> ScheduledBatch:
    """A throw-away prefill of `num_tokens` tokens over real KV blocks, in prompts of at most `max_len` tokens
    (positions stay inside the rotary table)."""
    seqs = []
    for start in range(0, num_tokens, max_len):
        step = WarmupStep("prefill", min(max_len, num_tokens - start))
        seqs += warmup_batch(step, blocks, block_size).seqs
    return ScheduledBatch(seqs, is_prefill=True)


class _Split:
    """Stands in for the attention backend while a bucket is captured: at each attention call, runs the store
    and copies its query into the static query buffer (inside the current piece), ends the piece, runs the
    attention segment eagerly (recording it for the replays) and begins the next piece. `probing`: the
    uncaptured run before a bucket's capture (compiles; sizes the static buffers), which attends directly."""

    def __init__(self, owner: PiecewiseGraphs):
        self.owner = owner
        self.probing = False
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool = None

    def begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool)

    def end(self):
        """End the current piece; what a replay calls to run it."""
        self.graph.capture_end()
        if self.pool is None:
            self.pool = self.graph.pool()
        return self.graph.replay

    def forward(self, layer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
        owner = self.owner
        q = owner.real_backend.store(layer, q, k, v, get_attention_metadata())  # the piece's store
        rows = q.shape[0]
        if self.probing:
            out = owner.real_backend.attend(layer, q, owner.meta)
            owner.size_statics(q, out)
            return out
        owner.static_q[:rows].copy_(q)
        owner.segments.append(self.end())
        attention = _EagerAttention(owner, layer)
        attention()  # at capture the static query holds earlier values (the piece was recorded, not run)
        owner.segments.append(attention)
        self.begin()
        return owner.static_out[:rows]


class _EagerAttention:
    """One attention call between two pieces: the backend's attend on the static query's first T rows (the
    step's real tokens) under the step's metadata, into the static output's first T rows."""

    def __init__(self, owner: PiecewiseGraphs, layer):
        self.owner, self.layer = owner, layer

    def __call__(self) -> None:
        owner = self.owner
        owner.real_backend.attend(self.layer, owner.q_rows, owner.meta, owner.out_rows)


class PiecewiseGraphs:
    def __init__(self, runner, max_tokens: int, capture: bool):
        """`runner`: the ModelRunner whose model, backend, staging, step_inputs and sampled ids this keeps (the
        runner itself is not kept: no reference cycle). Steps of up to `max_tokens` tokens (capped by the token
        budget and by what max_num_seqs prompts of max_model_len can hold) that no decode graph takes run here;
        none without `capture` (CPU, enforce_eager, max_tokens 0)."""
        self.model, self.step_inputs = runner.model, runner.ops.step_inputs
        self.real_backend, self.staging = runner.attn_backend, runner.staging
        self.sampled_ids, self.block_size = runner.sampled_ids, runner.block_size
        self.attention_layers = runner.attention_layers
        self.buckets: list[int] = []
        self.max_tokens = 0
        self.pieces: dict[int, list] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        # the static query and output every layer and bucket share (sized by the largest bucket, probed first)
        self.static_q: torch.Tensor | None = None
        self.static_out: torch.Tensor | None = None
        # the replaying step's metadata and its real rows of the statics (read by _EagerAttention)
        self.meta = None
        self.q_rows = self.out_rows = None
        self.segments: list = []
        cfg = runner.config
        max_tokens = min(max_tokens, cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        if capture and max_tokens > 0:
            self._capture(runner, max_tokens)

    def size_statics(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """Allocate the static query [T, *q's head dims] and output [T, width] once, at the largest bucket."""
        if self.static_q is None or self.static_q.shape[0] < q.shape[0]:
            self.static_q = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
            self.static_out = torch.zeros(out.shape, dtype=out.dtype, device=out.device)

    # -- replay -----------------------------------------------------------------------------------
    def covers(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def run(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, H] of a step of T <= max_tokens tokens (prefill, mixed, or a decode batch above the
        largest decode graph), and its sampled rows."""
        n = batch.num_tokens
        bucket = self._bucket_of[n]
        layout = pack_step(batch, len(batch.seqs), self.staging.next_host_buffer(), self.block_size,
                           token_rows=bucket)
        views = layout.views(self.staging.upload(layout.size))  # the captured pieces read the token fields here
        self.meta = self._attention_metadata(batch, views)
        self.q_rows, self.out_rows = self.static_q[:n], self.static_out[:n]
        for piece in self.pieces[bucket]:
            piece()
        return self.hidden[bucket][:n], views["rows"]

    def _attention_metadata(self, batch, views):
        """What the eager attention reads: the step's sequences (lengths, tables; `positions` only feed the store,
        which reads the captured ones)."""
        prefill = batch.is_prefill
        return self.real_backend.build_metadata(
            prefill, views, views["positions"], max(s.num_scheduled_tokens for s in batch.seqs),
            tuple((s.num_scheduled_tokens, s.num_computed_tokens + s.num_scheduled_tokens) for s in batch.seqs)
            if prefill else None, batch.num_decode_rows if prefill else 0)

    def forward_bucket(self, views) -> torch.Tensor:
        """The bucket's forward as its pieces hold it: step inputs from the staging buffer, then the model, under
        the metadata the stores read (slots and positions at the bucket's fixed offsets)."""
        ids, positions = self.step_inputs(views["ids"], views["src"], views["positions"], self.sampled_ids)
        with forward_context(self.real_backend.build_metadata(True, views, positions, 1)):
            return self.model(ids)

    # -- capture ----------------------------------------------------------------------------------
    def _capture(self, runner, max_tokens: int) -> None:
        self.buckets = piecewise_buckets(max_tokens)
        blocks = BlockCycle(runner.num_blocks)
        max_len = runner.config.max_model_len
        device = runner.device
        split = _Split(self)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), no_gc_during_capture(), torch.cuda.stream(stream), self._split_attention(split):
            for bucket in reversed(self.buckets):
                batch = _capture_batch(bucket, max_len, blocks, self.block_size)
                layout = pack_step(batch, len(batch.seqs), self.staging.next_host_buffer(), self.block_size,
                                   token_rows=bucket)
                views = layout.views(self.staging.upload(layout.size))
                views["slots"].fill_(-1)  # store nothing: the blocks may hold a serving engine's K/V
                self.meta = self._attention_metadata(batch, views)
                split.probing = True
                self.forward_bucket(views)
                split.probing = False
                self.q_rows, self.out_rows = self.static_q[:bucket], self.static_out[:bucket]
                self.segments = []
                split.begin()
                self.hidden[bucket] = self.forward_bucket(views)
                self.segments.append(split.end())
                self.pieces[bucket], self.segments = self.segments, []
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        self.meta = self.q_rows = self.out_rows = None
        self.max_tokens = self.buckets[-1]
        self._bucket_of = [next(b for b in self.buckets if b >= n) for n in range(self.max_tokens + 1)]

    def _split_attention(self, split: _Split):
        """Every attention layer calls `split` instead of the backend while a bucket is captured."""
        layers, backend = self.attention_layers, self.real_backend

        class _Swap:
            def __enter__(self_inner):
                for layer in layers:
                    layer.backend = split

            def __exit__(self_inner, *exc):
                for layer in layers:
                    layer.backend = backend

        return _Swap()
