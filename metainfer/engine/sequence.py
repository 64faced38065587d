"""One generated sample (a request with n > 1 has n sequences) and its bookkeeping."""

from __future__ import annotations

import enum
import itertools

import torch

from metainfer.sampling_params import SamplingParams

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt + output) and the KV bookkeeping the scheduler needs.

    `num_computed_tokens` counts tokens whose K/V are in the cache; a step computes
    `num_scheduled_tokens` more. Prefix-cache hits advance it at allocation.
    """

    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams):
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_hashed_blocks = 0  # leading blocks already registered in the prefix cache
        self.num_scheduled_tokens = 0
        self.num_cached_prompt_tokens = 0  # first allocation's prefix-cache hit, for stats
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_text = ""
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, float]] = []
        self.detok_prefix_offset = 0
        self.detok_read_offset = 0
        self.incremental_detokenize = True
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def will_sample(self) -> bool:
        """True when this step computes the last token, so logits are needed."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]
