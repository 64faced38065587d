"""Offline facade with vLLM's `LLM` interface: generate, chat, a progress bar."""

from __future__ import annotations

import itertools

import torch

from metainfer.config import EngineConfig
from metainfer.engine.llm_engine import LLMEngine
from metainfer.outputs import RequestOutput
from metainfer.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, dtype="auto", device: str = "auto", tensor_parallel_size: int = 1,
                 max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, num_kv_blocks: int | None = None,
                 enable_prefix_caching: bool = True, enforce_eager: bool = False,
                 load_format: str = "auto", seed: int = 0, tokenizer: str | None = None,
                 kv_cache_dtype: str | torch.dtype = "auto", **kwargs):
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
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, list):
            params = sampling_params
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p in zip(ids, prompts, params):
                engine.add_request(request_id, prompt, p, stream=False)
        except ValueError:
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
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
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
        ids = self.get_tokenizer().apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
            **(chat_template_kwargs or {}))
        if hasattr(ids, "keys") and "input_ids" in ids:  # transformers v5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def close(self) -> None:
        self.llm_engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["LLM", "SamplingParams"]
