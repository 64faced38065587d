"""Model runner: builds the model and KV pool, turns a scheduled batch into flat tensors,
runs the forward pass and returns logits for the sequences that sample this step.

Flat, unpadded batches (docs/CONTRACTS.md): input_ids/positions int64 [T], slot_mapping
int32 [T], cu_seqlens_q int32 [B+1], context_lens int32 [B], block_tables int32 [B, M]
padded with -1. Host lists become one tensor each, copied to the device once per step.
"""

from __future__ import annotations

import logging

import torch

from metainfer.config import EngineConfig
from metainfer.engine.scheduler import ScheduledBatch
from metainfer.engine.sequence import Sequence
from metainfer.kernels import select_ops
from metainfer.layers.attention import AttentionMetadata, forward_context
from metainfer.loader import load_weights
from metainfer.models.registry import model_class

log = logging.getLogger("metainfer")


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.spec = config.spec
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.model = self._build_model()
        self.attention_layers = self.model.attention_layers()
        self.num_kv_heads = self.attention_layers[0].num_kv_heads
        self.num_blocks = self._decide_num_blocks()
        self._allocate_kv_cache(self.num_blocks)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pin = self.device.type == "cuda"
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_cudagraphs()

    # -- construction -----------------------------------------------------------------
    def _build_model(self):
        ops = select_ops(self.device)
        cls = model_class(self.spec)
        with torch.device(self.device):
            model = cls(self.spec, ops, dtype=self.dtype, max_position=self.config.max_model_len)
        for module in model.modules():  # bind the device's GEMM once, at build time
            if hasattr(module, "matmul"):
                module.matmul = ops.linear
        model.eval()
        self._load(model)
        return model

    def _load(self, model) -> None:
        cfg = self.config
        if cfg.load_format == "dummy":
            from metainfer.loader.dummy import fill_dummy_weights
            fill_dummy_weights(model, seed=cfg.seed)
        elif cfg.gguf_file is not None:
            from metainfer.loader.gguf import iterate_gguf
            load_weights(model, iterate_gguf(cfg.gguf_file))
        else:
            from metainfer.loader.safetensors import iterate_safetensors
            load_weights(model, iterate_safetensors(cfg.model_dir))

    def _bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.spec.num_layers * self.block_size * self.num_kv_heads * self.spec.head_dim * elem

    def _decide_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        useful = cfg.max_num_seqs * -(-cfg.max_model_len // self.block_size)
        if self.device.type == "cuda":
            budget = self._profile_free_bytes()
        else:
            budget = int(cfg.cpu_kv_cache_gib * 2**30)
        blocks = min(budget // self._bytes_per_block(), useful)
        if blocks < 1:
            raise ValueError("no memory left for the KV cache; lower max_num_batched_tokens or raise "
                             "gpu_memory_utilization")
        return int(blocks)

    @torch.inference_mode()
    def _profile_free_bytes(self) -> int:
        """Run one prefill at the maximum batched tokens; KV budget = util * total - peak - others."""
        cfg = self.config
        tokens = cfg.max_num_batched_tokens
        seq_len = min(tokens, cfg.max_model_len)
        num_seqs = -(-tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        self._allocate_kv_cache(num_seqs * blocks_per_seq)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        ids = torch.zeros(sum(lens), dtype=torch.long, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        tables = torch.arange(len(lens) * blocks_per_seq, dtype=torch.int32,
                              device=self.device).view(len(lens), blocks_per_seq)
        slots = torch.cat([tables[i].repeat_interleave(self.block_size)[:n] * self.block_size
                           + torch.arange(n, device=self.device) % self.block_size
                           for i, n in enumerate(lens)]).to(torch.int32)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(True, slots, torch.tensor(lens, dtype=torch.int32, device=self.device),
                                 tables, cu, max(lens))
        with forward_context(meta):
            hidden = self.model(ids, positions)
        self.model.compute_logits(hidden[cu[1:].long() - 1])
        torch.cuda.synchronize()
        activation_peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        self._release_kv_cache()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # everything held now (weights, other engines, non-torch memory) plus the forward's transient peak
        used = total - free
        budget = int(total * cfg.gpu_memory_utilization) - used - activation_peak
        peak, non_torch = activation_peak, used - torch.cuda.memory_reserved()
        log.info("profile: peak %.2f GiB, non-torch %.2f GiB, KV budget %.2f GiB",
                 peak / 2**30, non_torch / 2**30, budget / 2**30)
        return budget

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, self.spec.num_layers, num_blocks, self.block_size, self.num_kv_heads, self.spec.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def _release_kv_cache(self) -> None:
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = None

    # -- one step ---------------------------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        bs = self.block_size
        input_ids, positions, slots, cu, context_lens, logit_rows = [], [], [], [0], [], []
        for seq in batch.seqs:
            start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
            input_ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            cu.append(cu[-1] + n)
            context_lens.append(start + n)
            if seq.will_sample:
                logit_rows.append(cu[-1] - 1)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [-1] * (width - len(s.block_table)) for s in batch.seqs]
        dev, pin = self.device, self.pin

        def to_dev(values, dtype):
            host = torch.tensor(values, dtype=dtype)
            return (host.pin_memory() if pin else host).to(dev, non_blocking=True)

        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=to_dev(slots, torch.int32),
            context_lens=to_dev(context_lens, torch.int32),
            block_tables=to_dev(tables, torch.int32),
            cu_seqlens_q=to_dev(cu, torch.int32),
            max_seqlen_q=max(s.num_scheduled_tokens for s in batch.seqs),
        )
        return to_dev(input_ids, torch.long), to_dev(positions, torch.long), meta, to_dev(logit_rows, torch.long)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward one batch; returns logits [num sampling seqs, V] (maybe zero rows).

        Decode batches that fit a captured bucket replay its CUDA graph; everything else
        (prefill, CPU, enforce_eager) runs eagerly.
        """
        input_ids, positions, meta, logit_rows = self.prepare(batch)
        num_seqs = len(batch.seqs)
        if not batch.is_prefill and num_seqs <= self.max_graph_batch:
            return self.model.compute_logits(self._replay(input_ids, positions, meta, num_seqs))
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden[logit_rows])

    # -- CUDA graphs (decode) ---------------------------------------------------------------
    max_graph_batch = 0

    def _capture_cudagraphs(self) -> None:
        """Capture the decode forward for each batch bucket, largest first, one memory pool."""
        cfg = self.config
        max_bs = min(cfg.max_num_seqs, 512)
        self.graph_batch_sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs + 1, 16))
        if max_bs not in self.graph_batch_sizes:
            self.graph_batch_sizes.append(max_bs)
        max_blocks = -(-cfg.max_model_len // self.block_size)
        dev = self.device
        self.static = {
            "input_ids": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "positions": torch.zeros(max_bs, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((max_bs,), -1, dtype=torch.int32, device=dev),
            "context_lens": torch.zeros(max_bs, dtype=torch.int32, device=dev),
            "block_tables": torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=dev),
        }
        self.static_hidden = torch.zeros(max_bs, self.spec.hidden_size, dtype=self.dtype, device=dev)
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.graph_batch_sizes):
                meta = self._static_meta(bs)
                graph = torch.cuda.CUDAGraph()
                with forward_context(meta):
                    self.static_hidden[:bs] = self.model(self.static["input_ids"][:bs], self.static["positions"][:bs])
                    with torch.cuda.graph(graph, pool=pool):
                        self.static_hidden[:bs] = self.model(self.static["input_ids"][:bs],
                                                             self.static["positions"][:bs])
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.max_graph_batch = max_bs
        self._bucket_of = [next(b for b in self.graph_batch_sizes if b >= n) for n in range(max_bs + 1)]

    def _static_meta(self, bs: int) -> AttentionMetadata:
        s = self.static
        return AttentionMetadata(False, s["slot_mapping"][:bs], s["context_lens"][:bs], s["block_tables"][:bs])

    def _replay(self, input_ids, positions, meta: AttentionMetadata, num_seqs: int) -> torch.Tensor:
        bucket, s = self._bucket_of[num_seqs], self.static
        s["slot_mapping"].fill_(-1)
        s["context_lens"].zero_()
        s["input_ids"][:num_seqs].copy_(input_ids)
        s["positions"][:num_seqs].copy_(positions)
        s["slot_mapping"][:num_seqs].copy_(meta.slot_mapping)
        s["context_lens"][:num_seqs].copy_(meta.context_lens)
        s["block_tables"][:num_seqs, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        self.graphs[bucket].replay()
        return self.static_hidden[:num_seqs]

    @staticmethod
    def sampling_seqs(batch: ScheduledBatch) -> list[Sequence]:
        return [s for s in batch.seqs if s.will_sample]
