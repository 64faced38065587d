"""Piecewise CUDA graphs for prefill and mixed steps: every layer's non-attention work captured per token
bucket, the attention run eagerly between the pieces (vLLM v1's piecewise graphs, without torch.compile).

Why: an eager step launches ~17 kernels a layer from Python (~30 us each: ~20 ms a step for 36 layers), more
than the GPU time of a mixed step of a few hundred tokens, so a mixed step (decode rows beside a new prompt's
prefill, issue 23's unified schedule) was host-bound: its inter-token gap twice a decode step's. Attention is
what cannot be captured for every step alike (its grid and lengths follow the batch's sequences), and
everything else only depends on the token count, so each bucket of T_b tokens holds L + 1 graphs:

  piece 0      embedding, layer 0's norm and q/k/v (or MLA q / latent) projections
  piece i      layer i-1's o_proj, post-attention norm and MLP/MoE, layer i's norm and projections
  piece L      the last layer's o_proj, norm and MLP, the final norm -> `hidden` [T_b, H]

Between pieces the attention layer's inputs are copied (inside the piece) into static buffers shared by every
layer and bucket; `backend.forward` runs eagerly on their first T rows under the step's metadata (K/V store,
prefill / decode kernels); its output is copied into one static buffer the next piece reads. Rows T..T_b are
padding: their ids are stale (valid) ids of earlier steps and their attention output whatever the buffer held
(zeros at first); rows never mix outside attention, so they cannot reach the real rows, and the logits are
taken at the real rows only.

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

from metainfer.attention import forward_context
from metainfer.engine.scheduler import ScheduledBatch
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
    """Stands in for the attention backend while a bucket is captured: at each attention call, copies the
    arguments into the static buffers (inside the current piece), ends the piece, runs the attention segment
    eagerly (recording it for the replays) and begins the next piece. `probing`: the uncaptured run before a
    bucket's capture (compiles; sizes the static buffers), which calls the backend directly."""

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

    def forward(self, layer, *args):
        owner = self.owner
        if self.probing:
            out = owner.real_backend.forward(layer, *args)
            owner.static_inputs(args)
            owner.static_output(out.shape, out.dtype)
            return out
        statics, copies = owner.static_inputs(args)
        for static, source in copies:
            static.copy_(source)
        owner.segments.append(self.end())
        attention = _EagerAttention(owner, layer, statics)
        attention()  # at capture the statics hold earlier values (the piece was recorded, not run): shapes only
        owner.segments.append(attention)
        self.begin()
        return attention.static_out


class _EagerAttention:
    """One attention call between two pieces: the backend on the static inputs' first T rows (the step's
    real tokens, `owner.num_tokens`), its output copied into the shared static output's first T rows."""

    def __init__(self, owner: PiecewiseGraphs, layer, statics):
        self.owner, self.layer, self.statics = owner, layer, statics
        self.rows = next(s.shape[0] for s in statics if s is not None)
        self.static_out: torch.Tensor | None = None

    def __call__(self) -> None:
        n = self.owner.num_tokens
        out = self.owner.real_backend.forward(self.layer, *[None if s is None else s[:n] for s in self.statics])
        if self.static_out is None:
            self.static_out = self.owner.static_output(torch.Size((self.rows, *out.shape[1:])), out.dtype)
        self.static_out[:n].copy_(out)


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
        self.num_tokens = 0  # the replaying step's real tokens (read by _EagerAttention)
        self._statics: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._out: torch.Tensor | None = None
        self._ids = torch.zeros(0, dtype=torch.long)
        self.segments: list = []
        cfg = runner.config
        max_tokens = min(max_tokens, cfg.max_num_batched_tokens, cfg.max_num_seqs * cfg.max_model_len)
        if capture and max_tokens > 0:
            self._capture(runner, max_tokens)

    # -- static buffers shared by every layer and bucket (sized by the largest bucket, captured first) --
    def static_inputs(self, args) -> tuple[list[torch.Tensor | None], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Static stand-ins for the attention call's tensor arguments, and the (static, source) copies that fill
        them. Arguments viewing one tensor (q, k, v as column slices of the packed projection) share one static
        copy of the rows they span, with their column offsets and strides kept (the paged backend reads them
        as one packed tensor)."""
        groups: dict[int, list[int]] = {}
        for position, arg in enumerate(args):
            if arg is not None:
                groups.setdefault(arg.untyped_storage().data_ptr(), []).append(position)
        statics: list[torch.Tensor | None] = [None] * len(args)
        copies = []
        for index, positions in enumerate(groups.values()):
            members = [args[p] for p in positions]
            first = members[0]
            row_stride, rows = first.stride(0), first.shape[0]
            lo = min(a.storage_offset() for a in members)
            hi = max(a.storage_offset() + sum((n - 1) * st for n, st in zip(a.shape[1:], a.stride()[1:])) + 1
                     for a in members)
            width = hi - lo
            if any(a.shape[0] != rows or a.stride(0) != row_stride for a in members) or width > row_stride:
                raise ValueError("attention arguments must be row-major views of [tokens, ...] tensors")
            source = torch.as_strided(first, (rows, width), (row_stride, 1), lo)
            key = (index, first.dtype)
            buf = self._statics.get(key)
            if buf is None or buf.numel() < rows * width:
                buf = self._statics[key] = torch.zeros(rows * width, dtype=first.dtype, device=first.device)
            static = buf[: rows * width].view(rows, width)
            copies.append((static, source))
            for p, a in zip(positions, members):
                statics[p] = torch.as_strided(static, a.shape, (width, *a.stride()[1:]), a.storage_offset() - lo)
        return statics, copies

    def static_output(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The one output buffer every attention call writes (piece i+1 has read it before call i+1 runs)."""
        numel = shape.numel()
        if self._out is None or self._out.numel() < numel or self._out.dtype != dtype:
            self._out = torch.zeros(numel, dtype=dtype, device=self._ids.device)
        return self._out[:numel].view(shape)

    # -- replay -----------------------------------------------------------------------------------
    def covers(self, num_tokens: int) -> bool:
        return num_tokens <= self.max_tokens

    def run(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, H] of a step of T <= max_tokens tokens (prefill, mixed, or a decode batch above the
        largest decode graph), and its sampled rows."""
        layout = pack_step(batch, len(batch.seqs), self.staging.next_host_buffer(), self.block_size)
        views = layout.views(self.staging.upload(layout.size))
        ids, positions = self.step_inputs(views["ids"], views["src"], views["positions"], self.sampled_ids)
        n = ids.shape[0]
        bucket = self._bucket_of[n]
        self._ids[:n].copy_(ids)
        self.num_tokens = n
        meta = self.real_backend.build_metadata(
            batch.is_prefill, views, positions, max(s.num_scheduled_tokens for s in batch.seqs),
            tuple((s.num_scheduled_tokens, s.num_computed_tokens + s.num_scheduled_tokens) for s in batch.seqs)
            if batch.is_prefill else None, batch.num_decode_rows if batch.is_prefill else 0)
        with forward_context(meta):
            for piece in self.pieces[bucket]:
                piece()
        return self.hidden[bucket][:n], views["rows"]

    # -- capture ----------------------------------------------------------------------------------
    def _capture(self, runner, max_tokens: int) -> None:
        self.buckets = piecewise_buckets(max_tokens)
        blocks = BlockCycle(runner.num_blocks)
        max_len = runner.config.max_model_len
        device = runner.device
        self._ids = torch.zeros(self.buckets[-1], dtype=torch.long, device=device)
        split = _Split(self)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(stream), self._split_attention(split):
            for bucket in reversed(self.buckets):
                batch = _capture_batch(bucket, max_len, blocks, self.block_size)
                layout = pack_step(batch, len(batch.seqs), self.staging.next_host_buffer(), self.block_size)
                views = layout.views(self.staging.upload(layout.size))
                views["slots"].fill_(-1)  # store nothing: the blocks may hold a serving engine's K/V
                _, positions = self.step_inputs(views["ids"], views["src"], views["positions"], self.sampled_ids)
                lens = tuple((s.num_scheduled_tokens, s.num_scheduled_tokens) for s in batch.seqs)
                meta = self.real_backend.build_metadata(True, views, positions, max(n for n, _ in lens), lens)
                self.num_tokens = bucket
                with forward_context(meta):
                    split.probing = True
                    self.model(self._ids[:bucket])
                    split.probing = False
                    self.segments = []
                    split.begin()
                    self.hidden[bucket] = self.model(self._ids[:bucket])
                    self.segments.append(split.end())
                self.pieces[bucket], self.segments = self.segments, []
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
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
