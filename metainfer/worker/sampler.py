"""Sampler: penalties, min_tokens, greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Everything runs on the logits' device as batched tensor ops and returns device tensors
(`SampledBatch`); `SampledBatch.to_host()` starts the copy back and `HostSample.result()`
waits for it, so the engine can launch the next step before reading this one. Sampling uses the exponential-race trick
(argmax(p / E), E ~ Exp(1)), which draws from p without a multinomial sync. A request
with a seed draws its noise from its own generator, so its tokens do not depend on which
other requests share the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from metainfer.engine.sequence import Sequence
from metainfer.outputs import Logprob


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per sequence: (logprob of the chosen token, {token: logprob} of the top-k) or None; each a Logprob with its rank
    logprobs: list[tuple[Logprob, dict[int, Logprob]] | None]
    # per scored prompt row (ScheduledBatch.prompt_logprobs): (logprob of the prompt token, {token: logprob} top-k)
    prompt_logprobs: list[tuple[Logprob, dict[int, Logprob]]] | None = None


# Scored prompt rows go through the LM head this many at a time: each piece's fp32 logits and log_softmax (~39 MB
# each at a 151,936 vocabulary) sit beside the step's sampling logits, which the memory profile holds for
# max_num_seqs rows; small pieces keep the total well inside what the profile leaves free.
PROMPT_SCORE_ROWS = 64
# A top list wider than WIDE_TOP_K (logprobs=-1: the whole vocabulary) is taken WIDE_TOP_ROWS rows at a time and each
# piece copied to the host at once (`_top`), and read back row by row (`_row_lists`).
WIDE_TOP_K = 1024
WIDE_TOP_ROWS = 16


@dataclass
class PromptScores:
    """The logprobs of a prefill step's scored prompt tokens (SamplingParams.prompt_logprobs), on the device."""

    chosen: torch.Tensor  # fp32 [R]: log_softmax of the raw logits at each row's next prompt token
    chosen_rank: torch.Tensor  # int64 [R]: tokens at least as likely as it (vLLM's rank: 1 = the most likely)
    top_values: torch.Tensor | None  # fp32 [R, k] (None for k = 0; on the host for a wide k: `_top`)
    top_ids: torch.Tensor | None  # int64 [R, k]

    @classmethod
    def of(cls, logits: torch.Tensor, targets: torch.Tensor, k: int) -> PromptScores:
        """From the raw logits [R, V] (cut to the vocabulary) of the scored rows, as `_with_logprobs` scores a
        sampled token; k = -1: the whole vocabulary."""
        logprobs = logits.float().log_softmax(dim=-1)
        k = logprobs.shape[1] if k == -1 else k
        top_values, top_ids = _top(logprobs, k) if k else (None, None)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        return cls(chosen, _rank_of(logprobs, chosen), top_values, top_ids)

    @classmethod
    def cat(cls, parts: list[PromptScores]) -> PromptScores:
        if len(parts) == 1:
            return parts[0]
        tops = parts[0].top_values is not None
        return cls(torch.cat([p.chosen for p in parts]), torch.cat([p.chosen_rank for p in parts]),
                   torch.cat([p.top_values for p in parts]) if tops else None,
                   torch.cat([p.top_ids for p in parts]) if tops else None)


@dataclass
class SampledBatch:
    """One step's choices, still on the device (a step that only scores prompt tokens samples no row)."""

    token_ids: torch.Tensor  # int64 [B]
    wanted_logprobs: list[int | None]  # per sequence: requested top-k count (-1 resolved to the vocabulary) or None
    chosen_logprob: torch.Tensor | None = None  # fp32 [B]
    chosen_rank: torch.Tensor | None = None  # int64 [B] (PromptScores.chosen_rank's rule)
    # the rows whose wanted count is > 0, in order (k their largest; on the host for a wide k: `_top`)
    top_values: torch.Tensor | None = None  # fp32 [rows, k]
    top_ids: torch.Tensor | None = None  # int64 [rows, k]
    prompt: PromptScores | None = None

    def to_host(self) -> HostSample:
        """Start the device-to-host copy (pinned, non-blocking) and mark its completion."""
        tensors = [t for t in (self.token_ids, self.chosen_logprob, self.chosen_rank, self.top_values, self.top_ids)
                   if t is not None]
        host = [t.to("cpu", non_blocking=True) for t in tensors]
        prompt = None
        if self.prompt is not None:
            scores = self.prompt
            prompt = [t.to("cpu", non_blocking=True) if t is not None else None
                      for t in (scores.chosen, scores.chosen_rank, scores.top_values, scores.top_ids)]
        event = None
        if self.token_ids.is_cuda or (self.prompt is not None and self.prompt.chosen.is_cuda):
            event = torch.cuda.Event()
            event.record()
        return HostSample(host, event, self.wanted_logprobs, prompt)


class HostSample:
    """A step's sampled ids on their way to the host; `result()` waits for them."""

    def __init__(self, host: list[torch.Tensor], event, wanted_logprobs: list[int | None],
                 prompt: list[torch.Tensor | None] | None = None):
        self._host, self._event, self._wanted, self._prompt = host, event, wanted_logprobs, prompt

    def result(self, prompt_top_k: list[int | None] | None = None) -> SamplerOutput:
        """`prompt_top_k`: each scored prompt row's own k (its sequence's prompt_logprobs, -1 the whole
        vocabulary; None: the step's largest): a row gets no more than it asked for."""
        if self._event is not None:
            self._event.synchronize()
        out = self._sampled()
        if self._prompt is not None:
            chosen, ranks = self._prompt[0].tolist(), self._prompt[1].tolist()
            values, ids = self._prompt[2], self._prompt[3]
            if ids is None:
                tops = [{} for _ in chosen]
            else:
                width = ids.shape[1]
                widths = [width if k is None or k == -1 else min(k, width)
                          for k in (prompt_top_k or [None] * len(chosen))]
                tops = [_ranked(i, v) for i, v in zip(_row_lists(ids, widths), _row_lists(values, widths))]
            out.prompt_logprobs = [(Logprob(c, ranks[r]), tops[r]) for r, c in enumerate(chosen)]
        return out

    def _sampled(self) -> SamplerOutput:
        token_list = self._host[0].tolist()
        if len(self._host) == 1:
            return SamplerOutput(token_list, [None] * len(token_list))
        chosen, ranks = self._host[1].tolist(), self._host[2].tolist()
        widths = [n for n in self._wanted if n]  # the rows the top tensors hold
        top_vals = _row_lists(self._host[3], widths) if len(self._host) > 3 else None
        top_ids = _row_lists(self._host[4], widths) if len(self._host) > 3 else None
        out, held = [], 0
        for row, n in enumerate(self._wanted):
            if n is None:
                out.append(None)
                continue
            top = {}
            if n:
                top, held = _ranked(top_ids[held], top_vals[held]), held + 1
            out.append((Logprob(chosen[row], ranks[row]), top))
        return SamplerOutput(token_list, out)


def _ranked(ids: list[int], values: list[float]) -> dict[int, Logprob]:
    """A sorted top-k list as {token: Logprob}, ranks 1..k."""
    return {i: Logprob(v, rank) for rank, (i, v) in enumerate(zip(ids, values), 1)}


def _row_lists(t: torch.Tensor, widths: list[int]) -> list[list]:
    """The rows of a host [R, k] tensor as lists, row r cut to widths[r]: one tolist of the whole for a narrow k,
    row by row for a wide one (a whole vocabulary's row is V entries: a row that wants 5 of them builds 5 floats)."""
    if t.shape[1] <= WIDE_TOP_K:
        return [row[:n] for row, n in zip(t.tolist(), widths)]
    return [t[r, :n].tolist() for r, n in enumerate(widths)]


def _top(logprobs: torch.Tensor, k: int, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k of each row of `logprobs` (of those `rows` alone when given), sorted: (fp32 values, int64 ids).
    A wide k (beyond WIDE_TOP_K: logprobs=-1 asks for the whole vocabulary) is taken WIDE_TOP_ROWS rows at a time and
    each piece copied to the host at once (a synchronous copy, paid by such steps only): 12 bytes x V a row would
    otherwise pile up on the device beside the step's logits, beyond the sampler's share of the memory profile
    (three fp32 [max_num_seqs, V] temporaries), for a whole prompt's rows."""
    if k <= WIDE_TOP_K:
        return (logprobs if rows is None else logprobs.index_select(0, rows)).topk(k, dim=-1)
    values, ids = [], []
    for start in range(0, logprobs.shape[0] if rows is None else rows.shape[0], WIDE_TOP_ROWS):
        piece = logprobs[start:start + WIDE_TOP_ROWS] if rows is None else \
            logprobs.index_select(0, rows[start:start + WIDE_TOP_ROWS])
        top_values, top_ids = piece.topk(k, dim=-1)
        values.append(top_values.cpu())
        ids.append(top_ids.cpu())
    return torch.cat(values), torch.cat(ids)


def _rank_of(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each row's count of tokens at least as likely as its chosen one (vLLM's rank; 1 for the argmax)."""
    return (logprobs >= chosen.unsqueeze(1)).sum(dim=-1)


def _host_rows(values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def _pinned_rows(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def row_uploader(device: torch.device | str) -> Callable[[list, torch.dtype], torch.Tensor]:
    """(values, dtype) -> a tensor on `device`. Per-row values reach CUDA through pinned memory and a non-blocking
    copy: a plain torch.tensor(..., device="cuda") would wait for the GPU and undo async scheduling."""
    device = torch.device(device)
    return functools.partial(_pinned_rows, device=device) if device.type == "cuda" else _host_rows


def _plain(seq: Sequence) -> bool:
    """Greedy or temperature-only: what the one-pass Gumbel-max kernel samples (kernels/sampling.py)."""
    p = seq.params
    return (not p.has_penalties and not p.has_token_constraints and seq.num_output_tokens >= p.min_tokens
            and p.top_k == 0 and p.top_p == 1.0 and p.min_p == 0.0 and p.seed is None and p.logprobs is None)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device | str = "cpu",
                 fused: Callable | None = None, seed: int = 0):
        """`fused`: a `KernelOps.gumbel_sampler` instance (logits, temperatures, seed) -> ids, taken for
        a batch whose every row is greedy or temperature-only (chosen per batch from the host-side
        parameters; the rest goes through the torch path). `seed` starts its per-step noise seeds."""
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._fused, self._fused_seed = fused, seed * 1_000_003
        self._zero_temperatures = getattr(fused, "zero_temperatures", None)  # GumbelSampler's device zeros
        self._rows = row_uploader(device)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampledBatch:
        if self._fused is not None and all(_plain(s) for s in seqs):
            self._fused_seed += 1  # fresh noise every step
            if self._zero_temperatures is not None and all(s.params.greedy for s in seqs):
                temps = self._zero_temperatures[: len(seqs)]  # no per-step copy of temperatures
            else:
                temps = self._rows([0.0 if s.params.greedy else s.params.temperature for s in seqs], torch.float32)
            return SampledBatch(self._fused(logits, temps, self._fused_seed), [None] * len(seqs))
        logits = logits[:, : self.vocab_size].float()
        raw = logits
        params = [s.params for s in seqs]
        if any(p.has_token_constraints for p in params):
            logits = self._apply_token_constraints(logits.clone(), seqs)
        if any(p.has_penalties for p in params):
            logits = self._apply_penalties(logits if logits is not raw else logits.clone(), seqs)
        if any(s.num_output_tokens < s.params.min_tokens for s in seqs):
            logits = self._mask_stop_tokens(logits if logits is not raw else logits.clone(), seqs)
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):
            temps = self._rows([p.temperature if not p.greedy else 0.0 for p in params], torch.float32)
            sampled = self._sample(logits, seqs, temps)
            tokens = torch.where(temps == 0, tokens, sampled)
        wanted = [self.vocab_size if p.logprobs == -1 else p.logprobs for p in params]  # -1: the whole vocabulary
        if all(n is None for n in wanted):
            return SampledBatch(tokens, wanted)
        return self._with_logprobs(raw, tokens, wanted)

    # -- logits processors -------------------------------------------------------------
    def _apply_token_constraints(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logit_bias added, then every id outside allowed_token_ids at -inf (vLLM applies both before the
        penalties; the request checks keep the ids inside the model's vocabulary): one additive [V] row a
        sequence, built on its first step and kept on it (a 76k-entry bias rebuilt from Python every step cost
        ~28 ms a step on the CPU), added to the constrained rows."""
        rows = [row for row, seq in enumerate(seqs) if seq.params.has_token_constraints]
        adds = torch.stack([self._logit_adjustment(seqs[row], logits) for row in rows])
        logits.index_add_(0, self._rows(rows, torch.long), adds)
        return logits

    def _logit_adjustment(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """The sequence's additive row: its biases, and -inf outside its allowed ids."""
        if seq.logit_adjustment is None or seq.logit_adjustment.device != logits.device:
            p, vocab = seq.params, logits.shape[1]
            row = torch.zeros(vocab, dtype=torch.float32)
            if p.logit_bias:
                row.index_put_((torch.tensor(list(p.logit_bias), dtype=torch.long),),
                               torch.tensor(list(p.logit_bias.values()), dtype=torch.float32), accumulate=True)
            if p.allowed_token_ids is not None:
                blocked = torch.ones(vocab, dtype=torch.bool)
                blocked[torch.tensor(p.allowed_token_ids, dtype=torch.long)] = False
                row.masked_fill_(blocked, float("-inf"))
            # once a request, without waiting for the GPU (a pinned, non-blocking copy: async scheduling holds)
            seq.logit_adjustment = (row.pin_memory().to(logits.device, non_blocking=True) if logits.is_cuda else row)
        return seq.logit_adjustment

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[1]
        out_rows, out_ids, seen_rows, seen_ids = [], [], [], []
        for row, seq in enumerate(seqs):
            out = seq.output_token_ids
            out_rows += [row] * len(out)
            out_ids += out
            if seq.params.repetition_penalty != 1.0:
                seen_rows += [row] * len(seq.token_ids)
                seen_ids += [min(t, vocab - 1) for t in seq.token_ids]
        out_counts = torch.zeros_like(logits)
        flat = self._rows(out_rows, torch.long) * vocab + self._rows(out_ids, torch.long)
        out_counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=logits.dtype))
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[self._rows(seen_rows, torch.long), self._rows(seen_ids, torch.long)] = True
        p = [s.params for s in seqs]
        rep = self._rows([x.repetition_penalty for x in p], torch.float32).unsqueeze(1)
        presence = self._rows([x.presence_penalty for x in p], torch.float32).unsqueeze(1)
        frequency = self._rows([x.frequency_penalty for x in p], torch.float32).unsqueeze(1)
        seen |= out_counts > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
        return logits - frequency * out_counts - presence * (out_counts > 0).to(logits.dtype)

    def _mask_stop_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        rows, cols = [], []
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.params.min_tokens:
                ids = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(self.eos_token_ids))
                # an id the model cannot produce needs no mask (a tokenizer's EOS beyond a small vocabulary)
                ids = [i for i in ids if 0 <= i < self.vocab_size]
                rows += [row] * len(ids)
                cols += ids
        logits[self._rows(rows, torch.long), self._rows(cols, torch.long)] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], temps: torch.Tensor) -> torch.Tensor:
        """temps: fp32 [B] on the device, 0 for greedy rows (their sample is not used)."""
        dev = logits.device
        params = [s.params for s in seqs]
        logits = logits / torch.where(temps == 0, 1.0, temps).unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = self._top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = self._rows([p.min_p for p in params], torch.float32).unsqueeze(1)
            probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.params.seed is not None:
                if seq.generator is None or seq.generator.device != dev:
                    seq.generator = torch.Generator(device=dev).manual_seed(seq.params.seed + seq.index)
                noise[row].exponential_(generator=seq.generator)
        return (probs / noise).argmax(dim=-1)

    def _top_k_top_p(self, logits: torch.Tensor, params) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = self._rows([p.top_k if p.top_k > 0 else vocab for p in params], torch.long)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        top_p = self._rows([p.top_p for p in params], torch.float32).unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # keep a token while the mass before it < top_p
        drop |= mass_before >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    # -- logprobs ---------------------------------------------------------------------
    def _with_logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]) -> SampledBatch:
        """The chosen tokens' logprobs and ranks, and the top lists of the rows that want some (their largest k;
        the rows that want none are left out: one whole-vocabulary request beside 255 rows without top logprobs
        takes a [1, V] top list, not [256, V])."""
        logprobs = raw.log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max(n or 0 for n in wanted)
        top_vals = top_ids = None
        if k:
            rows = [row for row, n in enumerate(wanted) if n]
            top_vals, top_ids = _top(logprobs, k, None if len(rows) == len(wanted) else self._rows(rows, torch.long))
        return SampledBatch(tokens, wanted, chosen, _rank_of(logprobs, chosen), top_vals, top_ids)
