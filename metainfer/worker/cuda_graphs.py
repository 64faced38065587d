"""CUDA graphs of the decode forward, one per batch-size bucket.

A graph reads its inputs straight from the staging device buffer at the fixed offsets of its bucket's
layout (block tables padded to the full width) and prepares the step's ids and positions itself (the
step_inputs kernel, PENDING tokens from the runner's sampled ids): a replay is one upload and one
launch. Graphs share one memory pool and are captured largest first; each graph's output tensor is
where its replays leave the hidden states (the pool is shared, so it holds the latest replay only).
"""

from __future__ import annotations

import contextlib
import gc
import logging

import torch

from metainfer.attention import forward_context
from metainfer.worker.step_inputs import graph_layout, pack_step

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int, sizes: tuple[int, ...] | None = None) -> list[int]:
    """The buckets: `sizes` (EngineConfig.cuda_graph_sizes) or by default 1, 2, 4, 8, then every multiple of 16,
    those below max_num_seqs (<= 512) and that count itself, so every decode row count has a graph."""
    max_bs = min(max_num_seqs, MAX_GRAPH_BATCH)
    if sizes is None:
        sizes = (1, 2, 4, 8, *range(16, max_bs + 1, 16))
    return sorted({b for b in sizes if b < max_bs} | {max_bs})


@contextlib.contextmanager
def no_gc_during_capture():
    """Collect Python's cyclic garbage first, then keep the collector off while graphs are captured. Why: a
    collection inside a capture may free CUDA graphs that only a reference cycle kept (a dropped engine's, or a
    re-capture's old ones), and destroying a graph while a stream captures is not permitted: the capture is
    invalidated and the process aborts (an in-engine A/B of the GPU suite died of it, run 109)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class DecodeGraphs:
    def __init__(self, runner, capture: bool):
        """`runner`: the ModelRunner whose model, kernels, staging, backend and sampled ids the graphs read
        (taken here, not the runner itself: no reference cycle keeps a dropped engine's memory). Without
        `capture` (CPU, enforce_eager) nothing is captured and max_batch is 0: every step runs eagerly."""
        self.model, self.step_inputs, self.attn_backend = runner.model, runner.ops.step_inputs, runner.attn_backend
        self.staging, self.sampled_ids = runner.staging, runner.sampled_ids
        self.block_size, self.table_width = runner.block_size, runner.max_blocks_per_seq
        self.max_num_seqs, self.sizes = runner.config.max_num_seqs, runner.config.cuda_graph_sizes
        self.max_batch = 0
        self.batch_sizes: list[int] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        if capture:
            self._capture()

    def replay(self, batch) -> torch.Tensor:
        """Hidden states [len(batch.seqs), H] of a decode batch of at most max_batch rows."""
        n = len(batch.seqs)
        bucket = self._bucket_of[n]
        layout = pack_step(batch, bucket, self.staging.next_host_buffer(), self.block_size, self.table_width)
        self.staging.upload(layout.size)  # the captured graph reads its inputs there
        self.graphs[bucket].replay()
        return self.hidden[bucket][:n]

    def _capture(self) -> None:
        self.batch_sizes = graph_batch_sizes(self.max_num_seqs, self.sizes)
        dropped = [b for b in self.sizes or () if b > self.batch_sizes[-1]]
        if dropped:  # asked for, but above the largest batch (max_num_seqs, at most 512): that one takes their rows
            log.warning("cuda_graph_sizes %s are above the largest decode batch %d: not captured", dropped,
                        self.batch_sizes[-1])
        log.info("decode CUDA graphs at batch sizes %s", self.batch_sizes)
        pool = None
        with torch.inference_mode(), no_gc_during_capture():
            for bs in reversed(self.batch_sizes):
                views = self._idle_views(bs)
                graph = torch.cuda.CUDAGraph()
                self._forward(bs, views)  # warm-up (compiles, workspaces) outside the capture
                with torch.cuda.graph(graph, pool=pool):
                    self._forward(bs, views)
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.max_batch = self.batch_sizes[-1]
        self._bucket_of = [next(b for b in self.batch_sizes if b >= n) for n in range(self.max_batch + 1)]

    def _idle_views(self, bs: int) -> dict[str, torch.Tensor]:
        """The staging buffer's views for a `bs`-row decode step, filled with rows that store and attend
        to nothing (ids 0, slot -1, context 0, tables -1)."""
        views = graph_layout(bs, self.table_width).views(self.staging.device_buffer)
        for name, value in (("ids", 0), ("positions", 0), ("slots", -1), ("src", -1), ("context_lens", 0),
                            ("tables", -1)):
            views[name].fill_(value)
        return views

    def _forward(self, bs: int, views: dict[str, torch.Tensor]) -> None:
        ids, positions = self.step_inputs(views["ids"], views["src"], views["positions"], self.sampled_ids)
        with forward_context(self.attn_backend.build_metadata(False, views, positions, 1)):
            self.hidden[bs] = self.model(ids)
