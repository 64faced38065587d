"""LLMEngine: requests in, incremental RequestOutputs out, one `step()` at a time.

The offline `LLM` and the server both drive it through add_request / step / abort_request.
A rejected request raises ValueError before anything is queued, so the engine keeps
serving the others.

Async scheduling (`EngineConfig.async_scheduling`, on by default for one CUDA GPU): a step
launches batch n+1 before reading batch n's sampled ids back, so the host's scheduling,
input packing and output handling overlap the GPU's forward instead of idling it. Tokens
not yet read are PENDING placeholders (engine/sequence.py); the next step's inputs take
them from the device. A sequence that stops on EOS or a stop string was already scheduled
once more; that extra token is discarded. Penalties need every token on the host, so a
step with a running penalised sequence first reads back what is in flight.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from metainfer.config import EngineConfig, ModelSpec, locate_model
from metainfer.config.model_spec import read_config_json
from metainfer.engine.block_manager import BlockManager
from metainfer.engine.logprob_entries import fill_sampled_texts, prompt_logprobs, store_prompt_logprobs
from metainfer.engine.request_validation import (
    InvalidRequestError,
    RequestLimits,
    check_fan_out,
    check_group_budget,
    check_prompt_ids,
    check_request,
    kv_tokens_needed,
)
from metainfer.engine.scheduler import ScheduledBatch, Scheduler
from metainfer.engine.sequence import Sequence
from metainfer.engine.token_texts import TokenTexts, text_ending
from metainfer.engine.tokenizer import IncrementalDetokenizer, NoText, load_tokenizer
from metainfer.knowledge.spec_report import model_spec
from metainfer.loader.gguf import gguf_config, share_gguf_readers
from metainfer.models.shape_contract import validate_tp_config
from metainfer.outputs import CompletionOutput, RequestOutput
from metainfer.sampling_params import SamplingParams
from metainfer.worker.model_runner import ModelRunner
from metainfer.worker.sampler import HostSample, SampledBatch
from metainfer.worker.tp.driver import TPDriver
from metainfer.worker.tp.launched import LaunchedRank

log = logging.getLogger("metainfer")


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finished_time: float | None = None
    stream: bool = True  # report progress every step (else only when finished)
    error: str | None = None  # why fault isolation finished it (finish_reason "error")

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class LaunchedStep:
    """A batch whose forward and sampling are queued on the device, not yet read back."""

    batch: ScheduledBatch
    sampling: list[Sequence]
    token_index: list[int]  # per sampling sequence: where its PENDING token sits in token_ids
    sampled: HostSample | None
    trace: list | None = None  # its step_trace record, whose last field is set when it is read back


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # the process's BLAS preference before this engine's runner may set cuBLASLt (EngineConfig.enable_cublaslt):
        # close() puts it back, so code run after the engine (a peer's model, a benchmark) gets what it had
        self._blas_before = torch.backends.cuda.preferred_blas_library()
        self.tp_driver = self.launcher = None
        try:
            self._build(config)
        except BaseException:
            try:  # a caller that catches a failed build gets its BLAS setting back and leaks no workers
                self._release()
            except BaseException as exc:  # the build's error is the one raised; a failed clean-up is logged
                log.error("giving back a failed build's resources failed too: %s: %s", type(exc).__name__, exc)
            raise

    def _build(self, config: EngineConfig) -> None:
        with share_gguf_readers():  # a GGUF is parsed once: its config here, rank 0's weights in the runner
            spec = resolve_config(config)
            self.spec = spec
            self.tokenizer = (None if config.skip_tokenizer_init
                              else load_tokenizer(config.model_dir, config.gguf_file, config.tokenizer))
            eos = set(spec.eos_token_ids)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                eos.add(self.tokenizer.eos_token_id)
            self.eos_token_ids = tuple(sorted(eos))
            # one runner class on every rank; with TP, rank 0's is built alongside the workers' by the driver, or,
            # under torchrun (external launcher), every process builds its own rank's (worker/tp/launched.py)
            self.launcher = LaunchedRank(config) if config.distributed_executor_backend == "external_launcher" else None
            self.tp_driver = TPDriver(config) if config.tensor_parallel_size > 1 and self.launcher is None else None
            if self.launcher is not None:
                self.runner = self.launcher.build_runner(self.eos_token_ids)
            elif self.tp_driver is not None:
                self.runner = self.tp_driver.build_runner(self.eos_token_ids)
            elif config.device == "mlx":  # the MLX backend (metainfer/mlx/): same scheduler, sampler and outputs
                from metainfer.mlx.model_runner import MLXModelRunner

                self.runner = MLXModelRunner(config, eos_token_ids=self.eos_token_ids)
            else:
                self.runner = ModelRunner(config, eos_token_ids=self.eos_token_ids)
        # every Triton kernel variant compiled before the engine takes requests (worker/warmup.py); under an
        # external launcher rank 0 runs the steps and the other ranks replay them (LaunchedRank.warm_up)
        warm_up = self.launcher.warm_up if self.launcher is not None else getattr(self.runner, "warm_up", None)
        self.warmup_seconds = warm_up() if warm_up is not None else 0.0
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        capacity = self.runner.num_blocks * config.block_size
        if capacity < config.max_model_len:
            log.warning("KV pool holds %d tokens < max_model_len %d; capping max_model_len",
                        capacity, config.max_model_len)
            config.max_model_len = capacity
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, config.max_mixed_prefill_tokens, config.kv_reserve_ratio,
                                   config.kv_reserve_min_running,
                                   routed_experts=bool(config.spec is not None and config.spec.moe_layers))
        self.lookahead = 1 if config.async_scheduling else 0  # steps left in flight after step()
        self.in_flight: deque[LaunchedStep] = deque()
        self.detokenizer = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else NoText()
        self.token_texts = TokenTexts(self.tokenizer)  # Logprob.decoded_token (engine/token_texts.py)
        self.requests: dict[str, Request] = {}
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "failed_steps": 0, "failed_requests": 0}
        self._failed: list[Request] = []  # finished by fault isolation, reported by the next step()
        self._id_space: int | None = None  # token ids a request may name (request_limits)
        # Test hook: called with each batch's sequences before it runs; raising there acts as a step that
        # failed because of those sequences' data (fault isolation, _execute_isolating).
        self.fault_hook: Callable[[list[Sequence]], None] | None = None
        # Test hook: called with each sequence before its new token is processed on the host (logprobs,
        # detokenizing, stop checks); raising there finishes only that sequence's request (_read_back).
        self.output_fault_hook: Callable[[Sequence], None] | None = None
        # A list to have every launch recorded as [perf_counter at launch, is_prefill, sequences, tokens, decode
        # rows, perf_counter when read back (None until then, and for a step that samples nothing: nothing to wait
        # on)]: the throughput bench's timeline, and config.step_trace_path's (written at close, by the rank that
        # schedules: under an external launcher, rank 0). None records nothing.
        self.step_trace: list[list] | None = (
            [] if config.step_trace_path and (self.launcher is None or self.launcher.is_leader) else None)

    # -- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None, stream: bool = True, decode_logprobs: bool = True) -> None:
        """Queue a request. `stream=False` (offline use) reports it only when finished and
        detokenizes once at the end unless stop strings need the text as it grows. `decode_logprobs`: set the
        `decoded_token` of its logprobs and prompt logprobs (vLLM's field; an engine without a tokenizer leaves
        it None); the server's engine process passes False (its HTTP process decodes the tokens it answers)."""
        self._queue(self._prepare(request_id, prompt, params, stream, decode_logprobs))

    def add_request_group(self, items: list[tuple[str, str | list[int] | dict, SamplingParams]],
                          stream: bool = True, decode_logprobs: bool = True) -> None:
        """Queue the engine requests of one client request, all or none: together they may ask for at most
        max_n choices (prompts x n) and their samples must fit in the KV pool together (one request's token
        budget, `request_validation.check_group_budget`)."""
        limits = self.request_limits()
        if len(items) > 1:  # before tokenizing them all (a single prompt's n is check_request's)
            params = [p or SamplingParams() for _, _, p in items]
            for p in params:
                if isinstance(p, SamplingParams):
                    p.validate()
            check_fan_out(len(items), [p.n if isinstance(p, SamplingParams) else 1 for p in params], limits.max_n)
        requests = [self._prepare(rid, prompt, params, stream, decode_logprobs) for rid, prompt, params in items]
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids of a group must differ")
        check_group_budget([kv_tokens_needed(r.params, len(r.prompt_token_ids), limits) for r in requests], limits)
        for request in requests:
            self._queue(request)

    def _prepare(self, request_id: str, prompt, params: SamplingParams | None, stream: bool,
                 decode_logprobs: bool = True) -> Request:
        """Tokenize and check a request (raise ValueError naming the field); queue nothing."""
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError("sampling_params", "sampling_params must be a SamplingParams, got "
                                                         f"{type(params).__name__}")
        params = copy.deepcopy(params or SamplingParams())  # checked once: the caller's object may change
        params.validate()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.allowed_token_ids is not None and params.min_tokens > 0:
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if set(params.allowed_token_ids) <= stops:  # min_tokens masks them all: nothing could be sampled
                raise InvalidRequestError("allowed_token_ids", "allowed_token_ids holds only stop tokens, which "
                                                               "min_tokens masks until it is reached")
        if self.tokenizer is None and params.stop_strings:
            raise InvalidRequestError("stop", "stop strings need a tokenizer: this engine was built with "
                                              "skip_tokenizer_init=True (stop_token_ids work)")
        text, ids = self._tokenize(prompt)
        check_request(params, ids, self.spec.vocab_size, self.request_limits())  # engine/request_validation.py
        seqs = [Sequence(request_id, i, ids, params) for i in range(params.n)]
        texts = decode_logprobs and self.tokenizer is not None and (params.logprobs is not None
                                                                   or params.prompt_logprobs is not None)
        for seq in seqs:
            seq.incremental_detokenize = stream or bool(params.stop_strings)
            seq.decode_logprobs = texts
        return Request(request_id, text, ids, params, seqs, stream=stream)

    def _queue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def request_limits(self) -> RequestLimits:
        """What one request may ask of this engine (ids either the model or the tokenizer can name)."""
        c = self.config
        if self._id_space is None:
            self._id_space = max(self.spec.vocab_size, len(self.tokenizer) if self.tokenizer is not None else 0)
        return RequestLimits(vocab_size=self._id_space,
                             max_model_len=c.max_model_len, max_n=min(c.max_n, c.max_num_seqs),
                             max_logprobs=-1 if c.max_logprobs == -1 else min(c.max_logprobs, self.spec.vocab_size),
                             kv_tokens=self.block_manager.num_blocks * c.block_size,
                             shared_prompt=c.enable_prefix_caching)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def abort_request(self, request_id: str) -> None:
        self._finish_request(request_id, "abort")

    def _finish_request(self, request_id: str, reason: str) -> Request | None:
        """Drop the request and finish its unfinished sequences with `reason`; None when it is not here."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch one scheduled batch and read back the ones beyond the lookahead; return the
        outputs of requests that changed."""
        touched: dict[str, Request] = {}
        if self.in_flight and any(s.params.has_penalties for s in self.scheduler.running):
            self._read_back(0, touched)  # penalties count the in-flight tokens' values
        batch = self.scheduler.schedule()
        if batch is not None:
            self.in_flight.append(self._launch(batch))
        elif not self.in_flight and self.requests:  # work exists but nothing could run: fail loudly
            raise RuntimeError(f"scheduler made no progress with {len(self.requests)} unfinished "
                               f"request(s) and {self.block_manager.num_free_blocks} free KV blocks")
        self._read_back(self.lookahead if batch is not None else 0, touched)
        touched.update((r.request_id, r) for r in self._failed)  # finished by fault isolation
        self._failed.clear()
        return [self._request_output(r) for r in touched.values() if r.finished or r.stream]

    @torch.inference_mode()
    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queue the forward and the sampling; every sampling sequence gets a PENDING token."""
        record = None
        if self.step_trace is not None:
            record = [time.perf_counter(), batch.is_prefill, len(batch.seqs), batch.num_tokens,
                      batch.num_decode_rows, None]
            self.step_trace.append(record)
        batch, sampled = self._execute_isolating(batch)
        sampling = batch.sampling_seqs
        # before after_step, which zeroes num_scheduled_tokens (a mixed step's decode rows are not prompt)
        self.stats["prompt_tokens"] += batch.num_prefill_tokens
        self.scheduler.after_step(batch)
        index = [seq.add_pending(row) for row, seq in enumerate(sampling)]
        return LaunchedStep(batch, sampling, index, sampled.to_host() if sampled is not None else None, record)

    # -- fault isolation ----------------------------------------------------------------
    def _execute_isolating(self, batch: ScheduledBatch) -> tuple[ScheduledBatch, SampledBatch | None]:
        """Run the batch. If it raises, bisect it down to the sequences that fail on their own, finish
        their requests with finish_reason "error" (RequestOutput.error says why) and run the rest, so one
        request's data cannot fail the batch (vLLM's behaviour). A failure no single sequence reproduces,
        or any failure under tensor parallelism (the group is unusable after a failed step), is raised."""
        try:
            return batch, self._run(batch)
        except Exception as exc:
            if self.tp_driver is not None or self.launcher is not None:
                raise
            first = exc
        self.stats["failed_steps"] += 1
        saved = self._sampling_state(batch.seqs)
        culprits: dict[str, BaseException] = {}
        self._bisect(batch, batch.seqs, first, saved, culprits)
        if not culprits:
            raise first
        for request_id, exc in culprits.items():
            log.error("request %s failed a step and was finished with an error: %s: %s", request_id,
                      type(exc).__name__, exc)
            self._fail_request(request_id, f"{type(exc).__name__}: {exc}")
        rest = batch.subset([s for s in batch.seqs if s.request_id not in culprits])
        self._restore_sampling_state(saved)
        return rest, (self._run(rest) if rest.seqs else None)

    def _run(self, batch: ScheduledBatch) -> SampledBatch | None:
        if self.fault_hook is not None:
            self.fault_hook(batch.seqs)
        return self.runner.execute(batch)

    def _bisect(self, batch, seqs: list[Sequence], exc: BaseException, saved, culprits: dict) -> None:
        """`seqs` fail together with `exc`: find the single sequences that fail alone."""
        if len(seqs) == 1:
            culprits.setdefault(seqs[0].request_id, exc)
            return
        half = len(seqs) // 2
        for part in (seqs[:half], seqs[half:]):
            self._restore_sampling_state(saved)
            try:
                self._run(batch.subset(part))
                error = None
            except Exception as err:
                error = err
            if self.config.torch_device.type == "cuda":
                torch.cuda.synchronize()  # a trial's uploads done before the next reuses the staging buffers
            if error is not None:
                self._bisect(batch, part, error, saved, culprits)

    def _sampling_state(self, seqs: list[Sequence]):
        """What a trial run changes besides the KV it rewrites: seeded generators, the sampled-ids buffer."""
        ids = getattr(self.runner, "sampled_ids", None)
        gens = [(s, s.generator, s.generator.get_state() if s.generator is not None else None) for s in seqs]
        return (ids.clone() if ids is not None else None), gens

    def _restore_sampling_state(self, saved) -> None:
        ids, gens = saved
        if ids is not None:
            self.runner.sampled_ids.copy_(ids)
        for seq, gen, state in gens:
            seq.generator = gen
            if gen is not None:
                gen.set_state(state)

    def _fail_request(self, request_id: str, error: str) -> None:
        request = self._finish_request(request_id, "error")
        if request is None:
            return
        request.error, request.finished_time = error, time.monotonic()
        self._failed.append(request)
        self.stats["failed_requests"] += 1

    def _read_back(self, keep: int, touched: dict[str, Request]) -> None:
        """Read back launched steps, oldest first, until `keep` remain in flight."""
        while len(self.in_flight) > keep:
            step = self.in_flight.popleft()
            scored = step.batch.prompt_logprobs
            result = None if step.sampled is None else step.sampled.result(
                [seq.params.prompt_logprobs for seq, _ in scored.owners] if scored is not None else None)
            if result is not None and step.trace is not None:  # the device finished it (or the host came late)
                step.trace[-1] = time.perf_counter()
            if result is not None and result.prompt_logprobs is not None:
                store_prompt_logprobs(step.batch.prompt_logprobs, result.prompt_logprobs)
                self._fill_prompt_texts(step.batch.prompt_logprobs)
            now = time.monotonic()
            for i, seq in enumerate(step.sampling):
                if seq.is_finished:  # stopped or aborted after this step was launched: discard
                    continue
                token = result.token_ids[i]
                seq.resolve_pending(step.token_index[i], token)
                try:  # host-side output processing (logprobs, detokenizing, stop checks) of this request only
                    if self.output_fault_hook is not None:
                        self.output_fault_hook(seq)
                    self._append_token(seq, token, result.logprobs[i])
                except Exception as exc:
                    log.error("request %s failed its output processing and was finished with an error: %s: %s",
                              seq.request_id, type(exc).__name__, exc)
                    self._fail_request(seq.request_id, f"{type(exc).__name__}: {exc}")
                    continue
                request = self.requests[seq.request_id]
                request.first_token_time = request.first_token_time or now
                touched[seq.request_id] = request
                self.stats["generation_tokens"] += 1
                if request.finished:
                    request.finished_time = now
                    del self.requests[seq.request_id]
            for seq in step.batch.seqs:
                if seq.block_table:
                    self.block_manager.register_full_blocks(seq)

    def _fill_prompt_texts(self, scored) -> None:
        """The decoded_token of a step's scored prompt tokens, for the requests that asked (decode_logprobs); a
        failure to decode finishes that request only."""
        for seq, position in scored.owners:
            if seq.decode_logprobs and not seq.is_finished:
                try:
                    self.token_texts.fill(seq.prompt_logprobs[position],
                                          self.token_texts.context_of(seq.token_ids, position)[0])
                except Exception as exc:
                    log.error("request %s failed to decode its prompt logprobs' tokens and was finished with an "
                              "error: %s: %s", seq.request_id, type(exc).__name__, exc)
                    self._fail_request(seq.request_id, f"{type(exc).__name__}: {exc}")

    def _append_token(self, seq: Sequence, token: int, logprob) -> None:
        """Account for a token just read back (already in seq.token_ids)."""
        entry = None
        if logprob is not None:
            seq.cumulative_logprob += logprob[0]
            entry = {**logprob[1], token: logprob[0]}
            seq.output_logprobs.append(entry)
        prev_len = len(seq.output_text)
        # a stop token is known before its text is decoded: its text (or the character it completes) is never shown,
        # so the streamed text is the text decoded once (flush leaves the stop token out), as vLLM's detokenizer skips
        # a stop-terminated request's last id
        reason = self._stop_token_reason(seq, token)
        if reason is None:
            if seq.incremental_detokenize:
                self.detokenizer.update(seq)
            reason = self._finish_reason(seq, prev_len)
        if entry is not None and seq.decode_logprobs:  # once the finish is known: the token that ends the text
            fill_sampled_texts(self.token_texts, seq, entry, token,
                               text_ending(reason, seq.stop_reason, seq.params.include_stop_str_in_output))
        if reason is not None:
            seq.finish_reason = reason  # before the flush: a stop token's text is left out (tokenizer.py)
            if not isinstance(seq.stop_reason, str):
                self.detokenizer.flush(seq)  # text held back (or never decoded) is emitted now
            self.scheduler.finish(seq)  # also drops a later PENDING token, if one was launched

    def _stop_token_reason(self, seq: Sequence, token: int) -> str | None:
        """"stop" where `token` is an EOS (unless ignore_eos) or one of stop_token_ids (its id becomes stop_reason),
        once min_tokens are out."""
        p = seq.params
        if seq.num_known_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        return None

    def _finish_reason(self, seq: Sequence, prev_text_len: int) -> str | None:
        """The finish reason of a sequence whose last token is not a stop token (_stop_token_reason): a stop string in
        its new text, or a length."""
        p, num_output = seq.params, seq.num_known_output_tokens
        if num_output >= p.min_tokens:
            if p.stop_strings and self._cut_at_stop_string(seq, prev_text_len):
                return "stop"
        if p.max_tokens is not None and num_output >= p.max_tokens:
            return "length"
        if seq.num_known_tokens >= self.config.max_model_len:
            return "length"
        return None

    @staticmethod
    def _cut_at_stop_string(seq: Sequence, prev_text_len: int) -> bool:
        text = seq.output_text
        longest = max(len(s) for s in seq.params.stop_strings)
        start = max(0, prev_text_len - longest + 1)
        found = [(text.find(s, start), s) for s in seq.params.stop_strings]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return False
        index, stop = min(found)
        seq.output_text = text[: index + len(stop)] if seq.params.include_stop_str_in_output else text[:index]
        seq.stop_reason = stop
        return True

    def _request_output(self, request: Request) -> RequestOutput:
        outs = [CompletionOutput(
            index=s.index, text=s.output_text, token_ids=s.output_token_ids,  # a fresh list (a slice)
            cumulative_logprob=s.cumulative_logprob if request.params.logprobs is not None else None,
            logprobs=list(s.output_logprobs) if request.params.logprobs is not None else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in request.seqs]
        metrics = {"arrival_time": request.arrival_time, "first_token_time": request.first_token_time,
                   "finished_time": request.finished_time,
                   "num_cached_tokens": request.seqs[0].num_cached_prompt_tokens}
        # the prompt ids are shared, not copied per step (a streamed 512-token prompt was copied every token)
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, outs,
                             request.finished, metrics, metrics["num_cached_tokens"], error=request.error,
                             prompt_logprobs=prompt_logprobs(request.seqs[0]))

    # -- observability ------------------------------------------------------------------
    def num_running(self) -> int:
        """Requests (not sequences: n > 1 counts once) with a sequence running."""
        return len({s.request_id for s in self.scheduler.running})

    def num_waiting(self) -> int:
        running = {s.request_id for s in self.scheduler.running}
        return len({s.request_id for s in self.scheduler.waiting} - running)

    def kv_cache_usage(self) -> float:
        return self.block_manager.usage()

    def _release(self) -> None:
        """What a built engine holds beyond its memory, given back (close(), or __init__ when the build fails): the
        process's BLAS preference as it was, the TP workers, the launched group. Each is given back whatever an
        earlier one raised; the first error is raised once all were tried."""
        steps = [lambda: torch.backends.cuda.preferred_blas_library(self._blas_before)]
        steps += [holder.close for holder in (self.tp_driver, self.launcher) if holder is not None]
        error = None
        for step in steps:
            try:
                step()
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def close(self) -> None:
        self._release()
        if self.config.step_trace_path and self.step_trace is not None:  # last: a failed write leaks no workers
            trace, self.step_trace = self.step_trace, None
            try:
                write_step_trace(self.config.step_trace_path, trace)
            except OSError as exc:
                log.error("could not write the step trace to %s: %s", self.config.step_trace_path, exc)


STEP_TRACE_FIELDS = ("perf_counter_s", "is_prefill", "num_seqs", "num_tokens", "num_decode_rows", "done_s")


def write_step_trace(path: str, trace: list[list]) -> None:
    """EngineConfig.step_trace_path's file: {"fields": STEP_TRACE_FIELDS, "steps": [[...], ...]}, one row a launch."""
    with open(path, "w") as f:
        json.dump({"fields": list(STEP_TRACE_FIELDS), "steps": [list(step) for step in trace]}, f)


def tokenize_prompt(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(text, ids) of a prompt: a string, a list of token ids or a dict with `prompt_token_ids` or `prompt`.
    The ids are checked with the rest of the request (check_prompt_ids: one check for every caller). The engine
    and the server's HTTP process (which tokenizes for the engine process) both call it."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise InvalidRequestError("prompt", f"prompt must be a string, got {type(text).__name__}")
            return text, check_prompt_ids(prompt["prompt_token_ids"])
        if "prompt" not in prompt:
            raise InvalidRequestError("prompt", "prompt dict needs 'prompt' or 'prompt_token_ids'")
        prompt = prompt["prompt"]
        if isinstance(prompt, dict):
            raise InvalidRequestError("prompt", "prompt must be a string or a list of token ids, got dict")
    if isinstance(prompt, (list, tuple)):
        return None, check_prompt_ids(prompt)
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt", "prompt must be a string, a list of token ids or a dict, got "
                                            f"{type(prompt).__name__}")
    if not prompt:
        raise InvalidRequestError("prompt", "prompt must not be empty")
    if tokenizer is None:
        raise InvalidRequestError("prompt", "a text prompt needs a tokenizer: this engine was built with "
                                            "skip_tokenizer_init=True; pass token ids (prompt_token_ids)")
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    if not ids:
        raise InvalidRequestError("prompt", "prompt encodes to zero tokens")
    return prompt, ids


def resolve_config(config: EngineConfig) -> ModelSpec:
    """Locate the model, read its spec and finalize `config` against it (every option checked, ConfigError naming
    the field), with the tp constraints `metainfer spec` reports (every tp, 1 included): everything the engine
    checks before it loads a weight. `metainfer serve` runs it before it starts the engine process, so a bad option
    is refused there in about the time `generate` takes to refuse it."""
    config.model_dir, config.gguf_file = locate_model(config.model)
    spec = _read_spec(config)
    config.finalize(spec)
    validate_tp_config(spec, config.tensor_parallel_size, config.kv_cache_dtype)
    return spec


def _read_spec(config: EngineConfig) -> ModelSpec:
    """Through the check `metainfer spec` runs (spec_report.model_spec): an unsupported architecture is refused
    naming constraint.supported_architecture before anything is loaded."""
    if config.gguf_file is not None:
        return model_spec(gguf_config(config.gguf_file))
    return model_spec(_with_generation_eos(read_config_json(f"{config.model_dir}/config.json"), config.model_dir))


def _with_generation_eos(cfg: dict, model_dir: str) -> dict:
    """config.json with generation_config.json's EOS ids added: chat models list their end-of-turn token there only
    (Llama-3-Instruct: 128009), and transformers' generate and vLLM stop on them. Without this an engine with no
    tokenizer (skip_tokenizer_init), whose tokenizer would have named it, ran such a reply to max_tokens."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return cfg
    with open(path) as f:
        extra = json.load(f).get("eos_token_id")
    ids = [i for i in (extra if isinstance(extra, list) else [extra]) if isinstance(i, int)]
    own = cfg.get("eos_token_id")
    own = own if isinstance(own, list) else ([] if own is None else [own])
    merged = own + [i for i in ids if i not in own]
    return cfg if merged == own else {**cfg, "eos_token_id": merged}
