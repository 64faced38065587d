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
from collections import Counter

import torch

from metainfer.attention import forward_context
from metainfer.layers.linear import LinearBase
from metainfer.worker.step_inputs import graph_layout, pack_step

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then every multiple of 16, up to max_num_seqs (<= 512)."""
    max_bs = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs + 1, 16))
    return sizes if max_bs in sizes else sizes + [max_bs]


# a bucket is left out when a larger one's GEMMs take at least this much less time (cuBLAS timings repeat within ~1%)
SLOWER_BUCKET_MARGIN = 0.02


def decode_batch_sizes(max_num_seqs: int, model, gemm_rows_us: dict) -> list[int]:
    """The buckets captured: graph_batch_sizes, less each one whose GEMMs the GPU's measured `gemm_rows` table
    (kernels/tuned_configs.py) says run slower than a larger bucket's by SLOWER_BUCKET_MARGIN: its rows replay the
    larger graph. Why: cuBLAS's kernel choice is not monotone in the row count (run 127, H100: the Qwen3-8B decode
    set's GEMMs take 11.05 ms at 416 rows and 9.30 at 432); the padded rows add attention over no context and a few
    row-wise kernels. Only for the dense family, whose every GEMM in the graph is a measured linear layer (the MoE
    and MLA kernels are not in the table); every bucket where a shape or row count is not measured."""
    sizes = graph_batch_sizes(max_num_seqs)
    spec = model.spec
    if not gemm_rows_us or spec.moe_layers or spec.is_mla:
        return sizes
    cost = decode_gemm_us(linear_shape_counts(model.model), gemm_rows_us)
    kept, best_above = [], None
    for b in reversed(sizes):
        if b in cost and best_above is not None and best_above < cost[b] * (1 - SLOWER_BUCKET_MARGIN):
            continue
        kept.append(b)
        if b in cost:
            best_above = cost[b] if best_above is None else min(best_above, cost[b])
    return kept[::-1]


def linear_shape_counts(decoder) -> Counter:
    """{(N, K): how many} of the linear layers' weights under `decoder` (the LM head, outside the graph, is not)."""
    return Counter(tuple(m.weight.shape) for m in decoder.modules() if isinstance(m, LinearBase))


def decode_gemm_us(shape_counts: Counter, gemm_rows_us: dict) -> dict[int, float]:
    """{rows: us} of one step's GEMMs at each row count measured for every shape; {} if a shape is not in the table."""
    keys = {(n, k): f"{n}x{k}" for n, k in shape_counts}
    if any(key not in gemm_rows_us for key in keys.values()):
        return {}
    rows = set.intersection(*(set(map(int, gemm_rows_us[key])) for key in keys.values()))
    return {r: sum(count * gemm_rows_us[keys[shape]][str(r)] for shape, count in shape_counts.items())
            for r in sorted(rows)}


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
        self.max_num_seqs = runner.config.max_num_seqs
        self.gemm_rows_us = runner.tuned_configs["gemm_rows"]
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
        self.batch_sizes = decode_batch_sizes(self.max_num_seqs, self.model, self.gemm_rows_us)
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
