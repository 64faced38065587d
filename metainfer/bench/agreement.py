"""Teacher-forced agreement with HF transformers: the same weights, the same tokens.

Exact greedy sequences diverge between any two bf16 implementations, so each decode
step is fed the reference token and we compare next-token top-1 and logit cosine at
every position. The engine runs its real path (paged prefill, then decode steps through
the runner, CUDA graphs included).
"""

from __future__ import annotations

import torch

from metainfer.engine.scheduler import ScheduledBatch
from metainfer.engine.sequence import Sequence
from metainfer.loader import load_weights
from metainfer.sampling_params import SamplingParams


def copy_hf_weights(llm, hf_model) -> None:
    """Load the HF model's tensors into the engine through the normal checkpoint path."""
    load_weights(llm.llm_engine.runner.model, hf_model.state_dict().items())


@torch.inference_mode()
def teacher_forced_logits(llm, tokens: torch.Tensor, prompt_len: int, positions: int) -> torch.Tensor:
    """Our logits for positions prompt_len-1 .. prompt_len+positions-2, each step fed the true token:
    one paged prefill, then decode steps through the runner (CUDA graphs when captured)."""
    engine = llm.llm_engine
    runner, bm = engine.runner, engine.block_manager
    seq = Sequence("teacher-forced", 0, tokens[:prompt_len].tolist(), SamplingParams(max_tokens=positions))
    bm.allocate(seq)
    seq.num_scheduled_tokens = seq.num_tokens - seq.num_computed_tokens
    batch, ours = ScheduledBatch([seq], is_prefill=True), []
    for step in range(positions):
        ours.append(runner.execute(batch)[0].float())
        seq.num_computed_tokens += seq.num_scheduled_tokens
        seq.token_ids.append(int(tokens[prompt_len + step]))
        bm.append_slots(seq)
        seq.num_scheduled_tokens = 1
        batch = ScheduledBatch([seq], is_prefill=False)
    bm.free_sequence(seq)
    return torch.stack(ours)


@torch.inference_mode()
def teacher_forced(llm, hf_model, prompt_len: int = 32, positions: int = 256, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = llm.llm_engine.spec.vocab_size
    tokens = torch.randint(0, min(vocab, 10000), (prompt_len + positions,), generator=g)
    device = next(hf_model.parameters()).device
    ref_logits = hf_model(tokens[None].to(device)).logits[0, prompt_len - 1: prompt_len + positions - 1].float()
    ours = teacher_forced_logits(llm, tokens, prompt_len, positions).to(ref_logits.device)
    top1 = (ours.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(ours, ref_logits, dim=-1)
    return {"positions": positions, "prompt_len": prompt_len, "top1_agreement": top1,
            "cosine_mean": cos.mean().item(), "cosine_min": cos.min().item()}
