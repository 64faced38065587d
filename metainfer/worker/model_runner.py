"""Model runner: one per rank. Builds the model, the attention backend and its KV pool; runs a
scheduled batch and, on rank 0, samples it.

`execute(batch)` is the whole step: (TP rank 0) publish the step to the workers, pack the batch's
inputs (worker/step_inputs.py, one upload), run the forward (a captured CUDA graph for decode
batches that fit one, else eager), the LM head, then sample (rank 0 only) and keep the sampled ids on
the device, where the next step's PENDING inputs (async scheduling) read them. Prefill and mixed steps of
up to `max_piecewise_graph_tokens` run as per-layer graphs around eager attention
(worker/piecewise_graphs.py). Every choice — kernels, attention backend, graphs or eager, sampler,
whether this rank samples or publishes — is made here, once, at build.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from metainfer.attention import forward_context
from metainfer.config import ConfigError, EngineConfig
from metainfer.engine.scheduler import PromptLogprobRows, ScheduledBatch
from metainfer.kernels import pdl_supported, select_ops
from metainfer.loader import load_model_weights
from metainfer.models.registry import build_attention_backend, model_class
from metainfer.models.shape_contract import check_param_shapes
from metainfer.worker.cuda_graphs import DecodeGraphs
from metainfer.worker.piecewise_graphs import PiecewiseGraphs
from metainfer.worker.sampler import PROMPT_SCORE_ROWS, PromptScores, SampledBatch, Sampler, row_uploader
from metainfer.worker.step_inputs import StepLayout, StepStaging, pack_step
from metainfer.worker.tp.protocol import LOCAL, RankLink
from metainfer.worker.warmup import run_warmup, warmup_plan

log = logging.getLogger("metainfer")


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1, eos_token_ids: tuple = (),
                 link: RankLink = LOCAL):
        """`link` reaches the other TP ranks (worker/tp/protocol.py): build agreements (every rank
        loaded; the smallest KV pool fits every rank), and on rank 0 each step's publication."""
        self.config, self.spec = config, config.spec
        self.rank, self.world_size = rank, world_size
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.block_size = config.block_size
        self._link = link
        agree = link.agree
        # wall seconds of each start-up phase (where a cold start's time goes; the engine logs them)
        self.startup_seconds: dict[str, float] = {}
        lap = _Laps(self.startup_seconds)
        torch.manual_seed(config.seed)
        gpu_name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None
        # before any GEMM runs or is captured (graphs keep the kernels chosen then); LLMEngine.close undoes it
        if self.device.type == "cuda" and config.enable_cublaslt:
            torch.backends.cuda.preferred_blas_library("cublaslt")
        self.ops = select_ops(self.device, gpu_name=gpu_name, pdl=config.enable_pdl and pdl_supported(self.device),
                              skinny_gemm=config.enable_skinny_gemm, fused_sampler=config.enable_fused_sampler)
        with sizes_must_fit(config):
            self.attn_backend = build_attention_backend(config, self.ops)
        with torch.device(self.device):
            self.model = model_class(self.spec)(self.spec, self.ops, self.attn_backend, dtype=self.dtype,
                                                max_position=config.max_model_len)
        self.model.eval()
        load_model_weights(self.model, config)
        if world_size > 1:
            check_param_shapes(self.model, self.spec, world_size, rank)
        agree(1)  # "built": every rank loaded its shards
        lap("build_and_load")
        self.attention_layers = self.model.attention_layers()
        self.num_blocks = agree(self._decide_num_blocks())
        with sizes_must_fit(config):
            self.attn_backend.allocate(self.attention_layers, self.num_blocks, self.block_size)
            lap("kv_pool")
            self.max_blocks_per_seq = -(-config.max_model_len // self.block_size)
            max_tokens = max(config.max_num_batched_tokens, config.max_num_seqs)
            self.staging = StepStaging(StepLayout(max_tokens, config.max_num_seqs, self.max_blocks_per_seq,
                                                  config.max_num_seqs).size, self.device)
            # the last launched step's sampled ids; a PENDING input token reads its row here
            self.sampled_ids = torch.zeros(config.max_num_seqs, dtype=torch.long, device=self.device)
        self.sampler = None
        self._sample = self._no_sample
        if rank == 0:  # the LM head gathers the logits to rank 0, which alone samples
            fused = None
            if self.ops.gumbel_sampler is not None:
                fused = self.ops.gumbel_sampler(config.max_num_seqs, self.spec.vocab_size, self.device,
                                                warmup_dtype=self.dtype)
            self.sampler = Sampler(self.spec.vocab_size, tuple(eos_token_ids), self.device, fused=fused,
                                   seed=config.seed)
            self._sample = self._sample_rows
        self._upload = row_uploader(self.device)  # host lists to the device without waiting for it
        self._prompt_scores: PromptScores | None = None  # the last forward's scored prompt tokens (compute_logits)
        lap("sampler")
        graphs = self.device.type == "cuda" and not config.enforce_eager
        self.graphs = DecodeGraphs(self, capture=graphs)
        lap("decode_graphs")
        self.piecewise = PiecewiseGraphs(self, config.max_piecewise_graph_tokens, graphs)
        lap("piecewise_graphs")
        # one step of every shape class, so every Triton variant is compiled before serving (worker/warmup.py);
        # rank 0 drives it (the workers run what it publishes); the torch references compile nothing
        self.warmup_steps = warmup_plan(config.max_num_batched_tokens, config.max_model_len, config.max_num_seqs,
                                        self.block_size, self.graphs.batch_sizes, self.graphs.max_batch) \
            if self.ops.backend == "triton" and rank == 0 else []

    def warm_up(self) -> float:
        """Run the warm-up steps (none on the torch references); the seconds taken. LLMEngine calls it once the
        runner (and under TP every worker) is built, before the engine takes requests."""
        seconds = 0.0
        if self.warmup_steps:
            seconds = run_warmup(self, self.warmup_steps,
                                 torch.cuda.synchronize if self.device.type == "cuda" else None)
            log.info("warm-up: %d steps in %.1f s", len(self.warmup_steps), seconds)
        self.startup_seconds["warm_up"] = seconds
        log.info("start-up by phase: %s", ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_seconds.items()))
        return seconds

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> SampledBatch | None:
        """Run one scheduled batch; rank 0 returns its sampled ids and scored prompt tokens (still on the device),
        else None."""
        try:
            self._link.publish(batch)
            logits = self.compute_logits(batch)
            return self._sample(logits, batch, self._prompt_scores)
        except BaseException as exc:
            self._link.step_failed(exc)
            raise

    @torch.inference_mode()
    def compute_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """The forward of one batch: logits [sampling rows, V] (rank 0; a shard elsewhere). A step that scores prompt
        tokens leaves their scores in `_prompt_scores` for `execute` (the one forward entry point: the GPU suite's
        profiles time it by wrapping it)."""
        hidden, rows = self._hidden(batch)
        scored = batch.prompt_logprobs
        self._prompt_scores = self._score_prompt(hidden, scored) if scored is not None else None
        return self.model.compute_logits(hidden if rows is None else hidden[rows.long()])

    def _hidden(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward's hidden states and the sampling rows among them (None: a decode graph's output, which is
        those rows already)."""
        if not batch.is_prefill and len(batch.seqs) <= self.graphs.max_batch:
            return self.graphs.replay(batch), None
        if self.piecewise.covers(batch.num_tokens):
            return self.piecewise.run(batch)
        host = self.staging.next_host_buffer()
        layout = pack_step(batch, len(batch.seqs), host, self.block_size)
        views = layout.views(self.staging.upload(layout.size))
        ids, positions = self.ops.step_inputs(views["ids"], views["src"], views["positions"], self.sampled_ids)
        seq_lens = tuple((s.num_scheduled_tokens, s.num_computed_tokens + s.num_scheduled_tokens)
                         for s in batch.seqs) if batch.is_prefill else None
        meta = self.attn_backend.build_metadata(batch.is_prefill, views, positions,
                                                max(s.num_scheduled_tokens for s in batch.seqs), seq_lens,
                                                batch.num_decode_rows if batch.is_prefill else 0)
        with forward_context(meta):
            hidden = self.model(ids)
        return hidden, views["rows"]

    def _score_prompt(self, hidden: torch.Tensor, scored: PromptLogprobRows) -> PromptScores | None:
        """The logprobs of the prompt tokens the step scores, through the LM head in pieces of PROMPT_SCORE_ROWS
        rows; every rank runs the head (its gather is collective), rank 0 alone reads the logprobs."""
        rows = self._upload(scored.rows, torch.long)
        targets = self._upload(scored.targets, torch.long) if self.sampler is not None else None
        parts, piece, vocab = [], PROMPT_SCORE_ROWS, self.spec.vocab_size
        for start in range(0, len(scored.rows), piece):
            logits = self.model.compute_logits(hidden[rows[start:start + piece]])
            if targets is not None:
                parts.append(PromptScores.of(logits[:, :vocab], targets[start:start + piece], scored.top_k))
        return PromptScores.cat(parts) if parts else None

    def _sample_rows(self, logits: torch.Tensor, batch: ScheduledBatch,
                     prompt: PromptScores | None = None) -> SampledBatch | None:
        sampling = batch.sampling_seqs
        if not sampling:  # a chunk that samples nothing may still score prompt tokens
            return None if prompt is None else SampledBatch(self.sampled_ids[:0], [], prompt=prompt)
        sampled = self.sampler(logits, sampling)
        self.sampled_ids[: len(sampling)].copy_(sampled.token_ids)
        sampled.prompt = prompt
        return sampled

    @staticmethod
    def _no_sample(logits: torch.Tensor, batch: ScheduledBatch, prompt: PromptScores | None = None) -> None:
        return None

    @property
    def graph_batch_sizes(self) -> list[int]:
        return self.graphs.batch_sizes

    def swap_kernels(self, ops) -> None:
        """Bind another kernel set to every layer and the attention backend and re-capture the CUDA
        graphs (in-engine A/B for tools/gpu_suite; the engine itself never calls it)."""
        self.ops = ops
        for module in [*self.model.modules(), self.attn_backend]:
            if hasattr(module, "bind_ops"):
                module.bind_ops(ops)
        self.graphs = DecodeGraphs(self, capture=bool(self.graphs.max_batch))
        self.piecewise = PiecewiseGraphs(self, self.piecewise.max_tokens, bool(self.piecewise.max_tokens))

    # -- the KV pool ----------------------------------------------------------------------------
    def _decide_num_blocks(self) -> int:
        cfg = self.config
        per_block = self.attn_backend.bytes_per_block(len(self.attention_layers), self.block_size)
        on_gpu = self.device.type == "cuda"
        if cfg.num_kv_blocks is not None:  # checked before it is allocated: a CPU pool past RAM is not refused there
            have = (torch.cuda.mem_get_info(self.device)[0] if on_gpu
                    else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
            need = cfg.num_kv_blocks * per_block
            if need > have:
                raise ConfigError(f"num_kv_blocks ({cfg.num_kv_blocks}) needs {need / 2**30:.1f} GiB for the KV cache; "
                                  f"the {self.device.type} has {have / 2**30:.1f} GiB {'free' if on_gpu else 'in all'}")
            return cfg.num_kv_blocks
        useful = cfg.max_num_seqs * -(-cfg.max_model_len // self.block_size)
        budget = self._profile_free_bytes() if on_gpu else int(cfg.cpu_kv_cache_gib * 2**30)
        blocks = min(budget // per_block, useful)
        if blocks < 1:
            raise ConfigError(
                f"no memory left for the KV cache (a block of block_size={self.block_size} tokens takes {per_block} B);"
                + (" lower max_num_batched_tokens or block_size, or raise gpu_memory_utilization" if on_gpu else
                   f" raise cpu_kv_cache_gib ({cfg.cpu_kv_cache_gib}) or lower block_size"))
        return int(blocks)

    @torch.inference_mode()
    def _profile_free_bytes(self) -> int:
        """Run one prefill at the maximum batched tokens; KV budget = util * total - peak - others."""
        cfg = self.config
        tokens = cfg.max_num_batched_tokens
        seq_len = min(tokens, cfg.max_model_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
        self.attn_backend.allocate(self.attention_layers, len(lens) * blocks_per_seq, self.block_size)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        dev = self.device
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        tables = torch.arange(len(lens) * blocks_per_seq, dtype=torch.int32, device=dev).view(len(lens), -1)
        slots = torch.cat([tables[i].repeat_interleave(self.block_size)[:n] * self.block_size
                           + torch.arange(n, device=dev) % self.block_size for i, n in enumerate(lens)])
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
        views = {"slots": slots.to(torch.int32), "context_lens": torch.tensor(lens, dtype=torch.int32, device=dev),
                 "tables": tables, "cu": cu}
        with forward_context(self.attn_backend.build_metadata(True, views, positions, max(lens),
                                                              tuple((n, n) for n in lens))):
            hidden = self.model(torch.zeros(sum(lens), dtype=torch.long, device=dev))
        self.model.compute_logits(hidden[cu[1:].long() - 1])
        del hidden
        # the sampler's fp32 temporaries for a full decode batch (logits, probabilities, noise)
        sampler_peak = [torch.empty(cfg.max_num_seqs, self.spec.vocab_size, dtype=torch.float32, device=dev)
                        for _ in range(3)]
        torch.cuda.synchronize()
        del sampler_peak
        activation_peak = torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()
        self.attn_backend.release(self.attention_layers)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        # everything held now (weights, other engines, non-torch memory) plus the forward's transient peak
        used = total - free
        budget = int(total * cfg.gpu_memory_utilization) - used - activation_peak
        log.info("profile: peak %.2f GiB, non-torch %.2f GiB, KV budget %.2f GiB", activation_peak / 2**30,
                 (used - torch.cuda.memory_reserved()) / 2**30, budget / 2**30)
        return budget


class _Laps:
    """Records the wall seconds since the previous lap (or construction) under each phase name."""

    def __init__(self, into: dict[str, float]):
        self.into, self.last = into, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name], self.last = now - self.last, now


@contextlib.contextmanager
def sizes_must_fit(config: EngineConfig):
    """Buffers sized by the engine's options (the KV pool, the step staging, per-row scratch) that the device cannot
    hold are a bad option, raised as one ConfigError naming those options, not an allocator's traceback."""
    try:
        yield
    except RuntimeError as err:  # torch.OutOfMemoryError is one; the CPU allocator raises a plain one
        if not isinstance(err, torch.OutOfMemoryError) and "can't allocate memory" not in str(err):
            raise
        sizes = ", ".join(f"{name}={getattr(config, name)}" for name in (
            "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "num_kv_blocks"))
        raise ConfigError(f"the {config.torch_device.type} cannot hold the buffers these sizes ask for ({sizes}): "
                          f"{str(err).splitlines()[0][:200]}") from err
