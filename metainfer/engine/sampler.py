"""Sampler: penalties, min_tokens, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Everything runs on the logits' device as batched tensor ops; the one host sync is the
caller reading the chosen ids. Sampling uses the exponential-race trick
(argmax(p / E), E ~ Exp(1)), which draws from p without a multinomial sync. A request
with a seed draws its noise from its own generator, so its tokens do not depend on which
other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from metainfer.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per sequence: (logprob of the chosen token, {token: logprob} of the top-k) or None
    logprobs: list[tuple[float, dict[int, float]] | None]


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        logits = logits[:, : self.vocab_size].float()
        raw = logits
        params = [s.params for s in seqs]
        dev = logits.device
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits.clone(), seqs)
        if any(s.num_output_tokens < s.params.min_tokens for s in seqs):
            logits = self._mask_stop_tokens(logits if logits is not raw else logits.clone(), seqs)
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):
            greedy = torch.tensor([p.greedy for p in params], device=dev)
            sampled = self._sample(logits, seqs)
            tokens = torch.where(greedy, tokens, sampled)
        want_logprobs = [p.logprobs is not None for p in params]
        if not any(want_logprobs):
            return SamplerOutput(tokens.tolist(), [None] * len(seqs))
        return self._with_logprobs(raw, tokens, seqs)

    # -- logits processors -------------------------------------------------------------
    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        out_counts = torch.zeros_like(logits)
        seen = torch.zeros_like(logits, dtype=torch.bool)
        for row, seq in enumerate(seqs):
            out = seq.output_token_ids
            if out:
                ids = torch.tensor(out, device=dev)
                out_counts[row].scatter_add_(0, ids, torch.ones(len(out), device=dev))
            if seq.params.repetition_penalty != 1.0:
                seen[row, torch.tensor(seq.token_ids, device=dev).clamp(max=vocab - 1)] = True
        p = [s.params for s in seqs]
        rep = torch.tensor([x.repetition_penalty for x in p], device=dev).unsqueeze(1)
        presence = torch.tensor([x.presence_penalty for x in p], device=dev).unsqueeze(1)
        frequency = torch.tensor([x.frequency_penalty for x in p], device=dev).unsqueeze(1)
        seen |= out_counts > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        return logits - frequency * out_counts - presence * (out_counts > 0).to(logits.dtype)

    def _mask_stop_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                ids = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(self.eos_token_ids))
                if ids:
                    logits[row, ids] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        params = [s.params for s in seqs]
        temps = torch.tensor([max(p.temperature, 1e-5) if not p.greedy else 1.0 for p in params], device=dev)
        logits = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = self._top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None:
                if seq.generator is None or seq.generator.device != dev:
                    seq.generator = torch.Generator(device=dev).manual_seed(seq.params.seed + seq.index)
                noise[row].exponential_(generator=seq.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        top_p = torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # keep a token while the mass before it < top_p
        drop |= mass_before >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    # -- logprobs ---------------------------------------------------------------------
    @staticmethod
    def _with_logprobs(raw: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        logprobs = raw.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max(s.params.logprobs or 0 for s in seqs)
        top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        token_list, chosen_list = tokens.tolist(), chosen.tolist()
        top_vals = top_vals.tolist() if k else None
        top_ids = top_ids.tolist() if k else None
        out = []
        for row, seq in enumerate(seqs):
            n = seq.params.logprobs
            if n is None:
                out.append(None)
                continue
            top = {top_ids[row][j]: top_vals[row][j] for j in range(n)} if n else {}
            out.append((chosen_list[row], top))
        return SamplerOutput(token_list, out)
