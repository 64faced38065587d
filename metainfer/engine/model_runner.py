"""Model runner: builds the model and KV pool, turns a scheduled batch into flat tensors,
runs the forward pass and returns logits for the sequences that sample this step.

Flat, unpadded batches (docs/CONTRACTS.md): input_ids/positions int64 [T], slot_mapping
int32 [T], cu_seqlens_q int32 [B+1], context_lens int32 [B], block_tables int32 [B, M]
padded with -1. All of a step's int fields are packed into one staging buffer and copied to
the device once; a token still PENDING on the host (async scheduling) is taken from the
previous step's sampled ids on the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from metainfer.config import ConfigError, EngineConfig, env_switch
from metainfer.engine.scheduler import ScheduledBatch
from metainfer.engine.sequence import PENDING, Sequence
from metainfer.kernels import pdl_supported, select_ops
from metainfer.kernels.attention import decode_workspace_numel_for
from metainfer.kernels.kv_cache import FP8_KV_DTYPE, token_major_v_cache
from metainfer.layers.attention import AttentionMetadata, forward_context
from metainfer.layers.linear import bind_kernel_linears
from metainfer.loader import load_weights
from metainfer.models.registry import model_class

log = logging.getLogger("metainfer")


@dataclass(frozen=True)
class StepLayout:
    """Where each field of one step sits in the packed int32 staging buffer.

    Every field starts on a 16-byte boundary: Triton specialises a kernel on whether each pointer
    argument is 16-byte aligned, so unaligned views would compile a new variant of the prefill
    kernels for each alignment pattern the batch sizes happen to produce (seconds, mid-run)."""

    num_tokens: int
    num_seqs: int
    table_width: int
    num_sampling: int

    ALIGN = 4  # int32 elements: 16 bytes

    @property
    def sizes(self) -> dict[str, int]:
        t, b, w = self.num_tokens, self.num_seqs, self.table_width
        return {"ids": t, "positions": t, "slots": t, "src": t, "context_lens": b, "cu": b + 1,
                "tables": b * w, "rows": self.num_sampling}

    @property
    def offsets(self) -> dict[str, int]:
        out, at = {}, 0
        for name, n in self.sizes.items():
            out[name] = at
            at += -(-n // self.ALIGN) * self.ALIGN
        out["end"] = at
        return out

    @property
    def size(self) -> int:
        return self.offsets["end"]

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        o = self.offsets
        v = {name: buf[o[name]:o[name] + n] for name, n in self.sizes.items()}
        v["tables"] = v["tables"].view(self.num_seqs, self.table_width)
        return v


class StepStaging:
    """Host buffer(s) a step is packed into, and the device buffer they are copied to.

    CUDA: two pinned host buffers used in turn (a step may be packed while the previous
    one's upload is still queued behind the GPU work in flight); an event per buffer says
    when its upload has run. CPU: the host buffer is the model's input itself.
    """

    def __init__(self, capacity: int, device: torch.device):
        on_cuda = device.type == "cuda"
        self._host = [torch.zeros(capacity, dtype=torch.int32, pin_memory=on_cuda) for _ in range(2 if on_cuda else 1)]
        self._views = [h.numpy() for h in self._host]
        self._uploaded = [torch.cuda.Event() if on_cuda else None for _ in self._host]
        self._current = 0
        self._device = torch.zeros(capacity, dtype=torch.int32, device=device) if on_cuda else self._host[0]
        self.device_buffer = self._device  # what every upload writes (CUDA graphs read it in place)
        self.upload = self._upload_cuda if on_cuda else self._upload_cpu  # chosen once

    def next_host_buffer(self) -> np.ndarray:
        self._current = (self._current + 1) % len(self._host)
        if self._uploaded[self._current] is not None:
            self._uploaded[self._current].synchronize()  # its previous upload has been read
        return self._views[self._current]

    def _upload_cuda(self, size: int) -> torch.Tensor:
        self._device[:size].copy_(self._host[self._current][:size], non_blocking=True)
        self._uploaded[self._current].record()
        return self._device

    def _upload_cpu(self, size: int) -> torch.Tensor:
        return self._device


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.spec = config.spec
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.kv_dtype = config.torch_kv_cache_dtype
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        self.model = self._build_model()
        self.attention_layers = self.model.attention_layers()
        self.num_kv_heads = self.attention_layers[0].num_kv_heads
        if self.ops.backend == "triton":
            self._bind_decode_workspace()
        self.num_blocks = self._decide_num_blocks()
        self._allocate_kv_cache(self.num_blocks)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._init_step_buffers()
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_cudagraphs()

    # -- construction -----------------------------------------------------------------
    def _build_model(self):
        gpu_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        # PDL on Hopper and later; METAINFER_DISABLE_PDL=1 turns it off (an A/B switch, read once here)
        pdl = pdl_supported(self.device) and not env_switch("METAINFER_DISABLE_PDL")
        # METAINFER_FUSED_DECODE_PREP=1: q/k prep inside the decode attention launch (an A/B switch;
        # off by default: slower on the H200, run 18)
        fuse_prep = env_switch("METAINFER_FUSED_DECODE_PREP")
        # METAINFER_SKINNY_GEMM=0: no tensor-core skinny GEMM for the 3-16-row GEMMs its tuned table lists (the A/B)
        skinny = env_switch("METAINFER_SKINNY_GEMM")
        self.ops = ops = select_ops(self.device, gpu_name=gpu_name, pdl=pdl, fuse_decode_prep=fuse_prep,
                                    skinny_gemm=skinny)
        cls = model_class(self.spec)
        with torch.device(self.device):
            model = cls(self.spec, ops, dtype=self.dtype, max_position=self.config.max_model_len)
        bind_kernel_linears(model, ops)  # the device's GEMMs, once, at build time
        model.eval()
        self._load(model)
        return model

    def _bind_decode_workspace(self) -> None:
        """One split-KV scratch for every decode launch this engine can make (before the KV pool
        is sized, so the profile sees it)."""
        cfg, layer = self.config, self.attention_layers[0]
        table_tokens = -(-cfg.max_model_len // self.block_size) * self.block_size
        numel = decode_workspace_numel_for(cfg.max_num_seqs, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                           table_tokens)
        self.decode_workspace = torch.empty(max(numel, 1), dtype=torch.float32, device=self.device)
        for attn in self.attention_layers:
            attn.bind_decode_workspace(self.decode_workspace)

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
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
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
            raise ConfigError("no memory left for the KV cache; lower max_num_batched_tokens or raise "
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
        del hidden
        # the sampler's fp32 temporaries for a full decode batch (logits, probabilities, noise)
        sampler_peak = [torch.empty(cfg.max_num_seqs, self.spec.vocab_size, dtype=torch.float32,
                                    device=self.device) for _ in range(3)]
        torch.cuda.synchronize()
        del sampler_peak
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
        self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        # an fp8 cache keeps V token-major (kernels/kv_cache.py: why; run 35: decode attention 118 against
        # 135 us at 256 ragged rows); METAINFER_FP8_V_TOKEN_MAJOR=0 keeps it head-major (the A/B, read once here)
        token_major = self.kv_dtype == FP8_KV_DTYPE and env_switch("METAINFER_FP8_V_TOKEN_MAJOR")
        v_view = token_major_v_cache if token_major else (lambda memory: memory)
        for i, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], v_view(self.kv_cache[1, i])

    def _release_kv_cache(self) -> None:
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = torch.empty(0)
        self.kv_cache = None

    # -- one step ---------------------------------------------------------------------
    def _init_step_buffers(self) -> None:
        """Pre-allocated staging for a step's inputs: every int field of a batch is packed
        into one int32 host buffer and reaches the device with one copy (see StepStaging)."""
        cfg = self.config
        self.max_blocks_per_seq = -(-cfg.max_model_len // self.block_size)
        max_tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        capacity = StepLayout(max_tokens, cfg.max_num_seqs, self.max_blocks_per_seq, cfg.max_num_seqs).size
        self.staging = StepStaging(capacity, self.device)
        # The last launched step's sampled ids; a PENDING input token reads its row here.
        self.sampled_ids = torch.zeros(cfg.max_num_seqs, dtype=torch.long, device=self.device)

    def record_sampled(self, token_ids: torch.Tensor) -> None:
        self.sampled_ids[: token_ids.shape[0]].copy_(token_ids)

    def _pack(self, batch: ScheduledBatch, num_rows: int, view: np.ndarray, graph: bool = False) -> StepLayout:
        """Fill a host buffer with the batch's fields; decode batches are padded to
        `num_rows` (a CUDA-graph bucket: padded rows store nothing and attend to nothing). With
        `graph` the layout is the bucket's captured one (_graph_layout: tables at full width),
        else tables are as wide as the longest one."""
        seqs, bs = batch.seqs, self.block_size
        width = self.max_blocks_per_seq if graph else max(len(s.block_table) for s in seqs)
        sampling_rows: list[int] = []
        if batch.is_prefill:
            ids, pos, cu, ctx, src = [], [], [0], [], []
            slot_parts = []
            for seq in seqs:
                start, n = seq.num_computed_tokens, seq.num_scheduled_tokens
                ids.extend(seq.token_ids[start:start + n])
                p = np.arange(start, start + n, dtype=np.int64)
                pos.append(p)
                slot_parts.append(np.asarray(seq.block_table, dtype=np.int64)[p // bs] * bs + p % bs)
                cu.append(cu[-1] + n)
                ctx.append(start + n)
                if seq.will_sample:
                    sampling_rows.append(cu[-1] - 1)
            num_tokens, positions, slots = cu[-1], np.concatenate(pos), np.concatenate(slot_parts)
            src = [-1] * num_tokens  # prefill tokens are always known
            num_seqs = len(seqs)
        else:
            ids, positions, slots, src, ctx = [], [], [], [], []
            for seq in seqs:
                p = seq.num_computed_tokens
                token = seq.token_ids[p:p + 1][0]
                ids.append(max(token, 0))
                src.append(seq.sample_row if token == PENDING else -1)
                positions.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
                ctx.append(p + 1)
            pad = num_rows - len(seqs)
            ids += [0] * pad
            src += [-1] * pad
            positions += [0] * pad
            slots += [-1] * pad
            ctx += [0] * pad
            num_tokens = num_seqs = num_rows
            cu = range(num_rows + 1)
            sampling_rows = list(range(len(seqs)))
        layout = self._graph_layout(num_rows) if graph else StepLayout(num_tokens, num_seqs, width, len(sampling_rows))
        o = layout.offsets
        view[o["ids"]:o["ids"] + num_tokens] = ids
        view[o["positions"]:o["positions"] + num_tokens] = positions
        view[o["slots"]:o["slots"] + num_tokens] = slots
        view[o["src"]:o["src"] + num_tokens] = src
        view[o["context_lens"]:o["context_lens"] + num_seqs] = ctx
        view[o["cu"]:o["cu"] + num_seqs + 1] = cu
        tables = view[o["tables"]:o["tables"] + num_seqs * width].reshape(num_seqs, width)
        tables.fill(-1)
        for row, seq in enumerate(seqs):
            tables[row, :len(seq.block_table)] = seq.block_table
        view[o["rows"]:o["rows"] + len(sampling_rows)] = sampling_rows
        return layout

    def prepare(self, batch: ScheduledBatch, num_rows: int | None = None):
        """(input_ids i64[T], positions i64[T], AttentionMetadata, logit_rows i64[L]) on the device.

        A PENDING input (async scheduling) takes its id from `sampled_ids`, on the device."""
        host = self.staging.next_host_buffer()
        layout = self._pack(batch, num_rows or len(batch.seqs), host)
        v = layout.views(self.staging.upload(layout.size))
        meta = AttentionMetadata(
            is_prefill=batch.is_prefill,
            slot_mapping=v["slots"],
            context_lens=v["context_lens"],
            block_tables=v["tables"],
            cu_seqlens_q=v["cu"],
            max_seqlen_q=max(s.num_scheduled_tokens for s in batch.seqs),
        )
        return *self._step_inputs(v), meta, v["rows"].long()

    def _step_inputs(self, views: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's int64 token ids and positions: a PENDING row (src >= 0) reads the previous step's
        sampled id (one launch on CUDA: kernels/step_inputs.py)."""
        return self.ops.step_inputs(views["ids"], views["src"], views["positions"], self.sampled_ids)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward one batch; returns logits [num sampling seqs, V] (maybe zero rows).

        Decode batches that fit a captured bucket replay its CUDA graph; everything else
        (prefill, CPU, enforce_eager) runs eagerly.
        """
        num_seqs = len(batch.seqs)
        if not batch.is_prefill and num_seqs <= self.max_graph_batch:
            bucket = self._bucket_of[num_seqs]
            host = self.staging.next_host_buffer()
            layout = self._pack(batch, bucket, host, graph=True)
            self.staging.upload(layout.size)  # the captured graph reads its inputs there
            self.graphs[bucket].replay()
            return self.model.compute_logits(self.graph_hidden[bucket][:num_seqs])
        input_ids, positions, meta, logit_rows = self.prepare(batch)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden[logit_rows])

    # -- CUDA graphs (decode) ---------------------------------------------------------------
    max_graph_batch = 0

    def _capture_cudagraphs(self) -> None:
        """Capture the decode forward for each batch bucket, largest first, one memory pool. A
        graph reads its inputs straight from the staging device buffer, at the fixed offsets of its
        bucket's layout (block tables padded to the full width), and does the step's input
        preparation itself: a replay is one upload and one launch."""
        cfg = self.config
        max_bs = min(cfg.max_num_seqs, 512)
        self.graph_batch_sizes = [b for b in (1, 2, 4, 8) if b < max_bs] + list(range(16, max_bs + 1, 16))
        if max_bs not in self.graph_batch_sizes:
            self.graph_batch_sizes.append(max_bs)
        self.graph_hidden: dict[int, torch.Tensor] = {}  # each graph's output, where its replays leave it
        pool = None
        with torch.inference_mode():
            for bs in reversed(self.graph_batch_sizes):
                views = self._idle_step_inputs(bs)
                meta = AttentionMetadata(False, views["slots"], views["context_lens"], views["tables"])
                graph = torch.cuda.CUDAGraph()
                with forward_context(meta):
                    self._graph_forward(bs, views)  # warm-up (compiles, workspaces) outside the capture
                    with torch.cuda.graph(graph, pool=pool):
                        self._graph_forward(bs, views)
                pool = graph.pool() if pool is None else pool
                self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.max_graph_batch = max_bs
        self._bucket_of = [next(b for b in self.graph_batch_sizes if b >= n) for n in range(max_bs + 1)]

    def _idle_step_inputs(self, bs: int) -> dict[str, torch.Tensor]:
        """The staging device buffer's views for a `bs`-row decode step, filled with rows that
        store and attend to nothing (ids 0, slot -1, context 0, tables -1)."""
        views = self._graph_layout(bs).views(self.staging.device_buffer)
        for name, value in (("ids", 0), ("positions", 0), ("slots", -1), ("src", -1), ("context_lens", 0),
                            ("tables", -1)):
            views[name].fill_(value)
        return views

    def _graph_layout(self, bs: int) -> StepLayout:
        """The one layout a `bs`-row graph step is captured with and packed at (fixed offsets)."""
        return StepLayout(bs, bs, self.max_blocks_per_seq, bs)

    def _graph_forward(self, bs: int, views: dict[str, torch.Tensor]) -> None:
        """The decode forward of a `bs`-row bucket. Its output tensor is kept as the graph's output: a
        replay rewrites it in place (the graphs share one pool, so it holds the latest replay's rows only)."""
        self.graph_hidden[bs] = self.model(*self._step_inputs(views))

    @staticmethod
    def sampling_seqs(batch: ScheduledBatch) -> list[Sequence]:
        return [s for s in batch.seqs if s.will_sample]
