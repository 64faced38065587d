"""One generated sample (a request with n > 1 has n sequences) and its bookkeeping."""

from __future__ import annotations

import enum
import itertools

import torch

from metainfer.sampling_params import SamplingParams

_ids = itertools.count()

# Placeholder for a token sampled on the device whose value the host has not read yet
# (async scheduling: step n+1 is scheduled and launched before step n's tokens arrive).
PENDING = -1

# The most prompt ids (its last) the detokenizer reads to choose the context it decodes the output after
# (engine/tokenizer.py); vLLM's fast detokenizer looks back as far.
DETOK_PROMPT_TAIL = 24


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt + output) and the KV bookkeeping the scheduler needs.

    `num_computed_tokens` counts tokens whose K/V are in the cache; a step computes
    `num_scheduled_tokens` more. Prefix-cache hits advance it at allocation.
    `token_ids` may end with `num_pending` PENDING entries (launched, not yet read back);
    counts used for scheduling include them, the outputs and hashes only use known tokens.
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
        self.num_pending = 0  # trailing PENDING entries of token_ids
        self.sample_row = -1  # row of this sequence in the last launched step's sampled ids
        self.num_cached_prompt_tokens = 0  # first allocation's prefix-cache hit, for stats
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.output_text = ""
        self.cumulative_logprob = 0.0
        self.output_logprobs: list[dict[int, float]] = []
        # params.prompt_logprobs: per prompt position, {its token: logprob, top others} (None at 0 and until scored);
        # the first sample scores the prompt the request shares, the others may then take its prefix-cache hit
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None and index == 0 else None)
        # the detokenizer's window (engine/tokenizer.py), relative to num_prompt_tokens: it starts in the prompt, at
        # the context it chooses on first use
        self.detok_prefix_offset = 0
        self.detok_read_offset = 0
        self.detok_context: list[int] | None = None
        self.incremental_detokenize = True
        self.decode_logprobs = False  # set Logprob.decoded_token of its logprobs (engine/token_texts.py)
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        self.logit_adjustment: torch.Tensor | None = None  # logit_bias / allowed_token_ids as one row (the sampler's)
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed + index)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.token_ids) - self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens the host has read (in-flight ones excluded)."""
        return self.token_ids[self.num_prompt_tokens:self.num_known_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens including in-flight ones (what scheduling and sampling count)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_output_tokens(self) -> int:
        return self.num_known_tokens - self.num_prompt_tokens

    @property
    def detok_prompt_tail(self) -> list[int]:
        """The prompt's last DETOK_PROMPT_TAIL ids, that the detokenizer chooses its context from."""
        return self.token_ids[max(0, self.num_prompt_tokens - DETOK_PROMPT_TAIL):self.num_prompt_tokens]

    def add_pending(self, sample_row: int) -> int:
        """Reserve the next token for a sampled-but-unread id; returns its index."""
        self.token_ids.append(PENDING)
        self.num_pending += 1
        self.sample_row = sample_row
        return len(self.token_ids) - 1

    def resolve_pending(self, index: int, token: int) -> None:
        """Fill in the oldest pending token (steps are read back in launch order)."""
        self.token_ids[index] = token
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """A finished sequence keeps only the tokens that were read back."""
        if self.num_pending:
            del self.token_ids[self.num_known_tokens:]
            self.num_pending = 0

    def reached_length_limit(self, max_model_len: int) -> bool:
        """Its last token is already launched: a further step would be thrown away."""
        p = self.params
        return (p.max_tokens is not None and self.num_output_tokens >= p.max_tokens) or \
            self.num_tokens >= max_model_len

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def will_sample(self) -> bool:
        """True when this step computes the last token, so logits are needed."""
        return self.num_computed_tokens + self.num_scheduled_tokens == self.num_tokens

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size:(i + 1) * block_size]
