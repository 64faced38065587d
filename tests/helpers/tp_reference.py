"""The reference the quick TP tests (tests/distributed/test_tp_rank_paths.py, test_tp_launched_pair.py) compare
every rank with: a tiny random Qwen3 written by transformers, its prompts, HF's greedy continuations and HF's
log-probabilities along them."""

from __future__ import annotations

import torch

from metainfer import SamplingParams
from tests.helpers.tiny_models import build_tiny_model, hf_greedy, make_prompts

VOCAB = 509  # prime: the vocabulary is padded at TP=2
LENGTHS = [1, 7, 20, 33]
NEW_TOKENS = 8
TOP = 3
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
LOGPROB_ATOL = 2e-4  # fp32 against HF (the ranks sum their row-parallel partials in another order)


def hf_reference(folder: str) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """(prompts, HF greedy ids, per prompt the [NEW_TOKENS, vocab] log-probabilities of each generated position)."""
    model = build_tiny_model(folder, "qwen3", vocab_size=VOCAB)
    prompts = make_prompts(LENGTHS, vocab=VOCAB, seed=4)
    ids = hf_greedy(model, prompts, NEW_TOKENS)
    logprobs = []
    with torch.no_grad():
        for prompt, out in zip(prompts, ids):
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1]
            logprobs.append(logits.float().log_softmax(-1))
    return prompts, ids, logprobs


def run(llm, prompts) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Greedy ids and top-TOP logprobs of every prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_logprobs_match_hf(got: list[list[dict[int, float]]], expected: list[torch.Tensor]) -> None:
    """Each generated position: HF's top-TOP ids, each logprob within LOGPROB_ATOL of HF's."""
    for prompt, (steps, hf) in enumerate(zip(got, expected)):
        assert len(steps) == len(hf), f"prompt {prompt}: {len(steps)} positions, HF {len(hf)}"
        for step, (entry, row) in enumerate(zip(steps, hf)):
            assert set(row.topk(TOP).indices.tolist()) <= set(entry), f"prompt {prompt} token {step}: {entry}"
            for token, value in entry.items():
                assert abs(value - row[token].item()) <= LOGPROB_ATOL, (
                    f"prompt {prompt} token {step} id {token}: logprob {value}, HF {row[token].item()}")
