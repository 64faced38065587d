"""Teacher-forced agreement with HF transformers: the same weights, the same tokens.

Exact greedy sequences diverge between any two bf16 implementations, so every position is
fed the reference token and we compare next-token top-1 and logit cosine at every position.
Two engine paths are measured:

- decode path (`teacher_forced_logits`): one paged prefill of the prompt, then one decode
  step per position through `runner.compute_logits` (CUDA graphs included when captured);
- prefill path (`teacher_forced_prefill_logits`): all tokens in one paged prefill, every
  position's logits kept (the runner returns only the sampling rows, so this builds the attention
  metadata itself and calls the model directly).

A tool (tools/gpu_suite, tools/agreement_study.py, the fp8 parity test): the package never imports it.
"""

from __future__ import annotations

import torch

from metainfer.attention import AttentionMetadata, forward_context
from metainfer.engine.scheduler import ScheduledBatch
from metainfer.engine.sequence import Sequence
from metainfer.loader import load_weights
from metainfer.sampling_params import SamplingParams

FP8_KV_ATTENTION = "fp8_kv_sdpa"


def _fp8_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """HF's SDPA attention over K/V rounded as an fp8 cache holds them (float8_e4m3fn, clamped to
    +-448): built from HF and torch alone, so it is an oracle for the engine's fp8 cache."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def rounded(t):
        return t.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(t.dtype)

    return sdpa_attention_forward(module, query, rounded(key), rounded(value), attention_mask, **kwargs)


def use_fp8_kv_attention(hf_model) -> None:
    """Switch an HF model to attention over fp8-rounded K/V (`_fp8_kv_sdpa`)."""
    from transformers import AttentionInterface

    AttentionInterface.register(FP8_KV_ATTENTION, _fp8_kv_sdpa)
    hf_model.set_attn_implementation(FP8_KV_ATTENTION)


def copy_hf_weights(llm, hf_model) -> None:
    """Load the HF model's tensors into the engine through the normal checkpoint path."""
    load_weights(llm.llm_engine.runner.model, hf_model.state_dict().items())


def _allocated_sequence(llm, token_ids: list[int], positions: int) -> Sequence:
    """A sequence with KV blocks for `token_ids`, nothing counted as cached (every token is
    computed by this measurement, never taken from the prefix cache)."""
    seq = Sequence("teacher-forced", 0, token_ids, SamplingParams(max_tokens=max(1, positions)))
    llm.llm_engine.block_manager.allocate(seq)
    seq.num_computed_tokens = 0
    return seq


@torch.inference_mode()
def teacher_forced_logits(llm, tokens: torch.Tensor, prompt_len: int, positions: int) -> torch.Tensor:
    """Decode path. Our fp32 logits [positions, V] for positions prompt_len-1 .. prompt_len+positions-2,
    each step fed the true token: one paged prefill, then decode steps through the runner (CUDA
    graphs when captured)."""
    engine = llm.llm_engine
    runner, bm = engine.runner, engine.block_manager
    seq = _allocated_sequence(llm, tokens[:prompt_len].tolist(), positions)
    seq.num_scheduled_tokens = seq.num_tokens
    batch, ours = ScheduledBatch([seq], is_prefill=True), []
    try:
        for step in range(positions):
            ours.append(runner.compute_logits(batch)[0].float())
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.token_ids.append(int(tokens[prompt_len + step]))
            bm.append_slots(seq)
            seq.num_scheduled_tokens = 1
            batch = ScheduledBatch([seq], is_prefill=False)
    finally:
        bm.free_sequence(seq)
    return torch.stack(ours)


@torch.inference_mode()
def teacher_forced_prefill_logits(llm, tokens: torch.Tensor, prompt_len: int, positions: int) -> torch.Tensor:
    """Prefill path. The same rows as `teacher_forced_logits` ([positions, V], fp32), from one
    paged prefill of all prompt_len + positions tokens (as HF's single forward sees them)."""
    engine = llm.llm_engine
    runner, bm = engine.runner, engine.block_manager
    ids = tokens[: prompt_len + positions].tolist()
    seq = _allocated_sequence(llm, ids, positions)
    try:
        n, bs, dev = len(ids), runner.block_size, runner.device
        table = torch.tensor(seq.block_table, dtype=torch.int32)
        pos = torch.arange(n)
        slots = (table[pos // bs].long() * bs + pos % bs).to(torch.int32)
        meta = AttentionMetadata(
            is_prefill=True,
            slot_mapping=slots.to(dev),
            context_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=table[None].to(dev),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
            max_seqlen_q=n,
            positions=pos.to(dev),
            seq_lens=((n, n),),
        )
        with forward_context(meta):
            hidden = runner.model(torch.tensor(ids, dtype=torch.long, device=dev))
        return runner.model.compute_logits(hidden[prompt_len - 1: prompt_len + positions - 1]).float()
    finally:
        bm.free_sequence(seq)


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Top-1 agreement and per-position logit cosine (mean, min) of two [positions, V] sets."""
    a, b = a.float(), b.to(a.device).float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return {"top1": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "cos_mean": cos.mean().item(), "cos_min": cos.min().item()}


def hf_to_dtype(hf_model, dtype: torch.dtype = torch.bfloat16):
    """Convert an HF model's parameters in place, keeping its floating buffers (the rotary
    `inv_freq`) as they are: `Module.to(dtype)` would round inv_freq to bf16 too, shifting every
    rotary angle by up to ~0.4% (0.5 rad at position 288), which HF loaded with
    `from_pretrained(dtype=bf16)` or built with `from_config(dtype=bf16)` never does."""
    buffers = {name: buf.clone() for name, buf in hf_model.named_buffers() if buf.is_floating_point()}
    hf_model.to(dtype)
    for name, buf in buffers.items():
        owner, _, leaf = name.rpartition(".")
        setattr(hf_model.get_submodule(owner), leaf, buf)
    return hf_model


def hf_logits(hf_model, tokens: torch.Tensor, prompt_len: int, positions: int) -> torch.Tensor:
    """HF's fp32 logits for the same rows, one forward over all tokens."""
    device = next(hf_model.parameters()).device
    with torch.inference_mode():
        out = hf_model(tokens[None, : prompt_len + positions].to(device)).logits
    return out[0, prompt_len - 1: prompt_len + positions - 1].float()
