"""tools/agreement.py on the CPU with a tiny fp32 Qwen3: both teacher-forced paths (decode steps
through the runner, one paged prefill through the model) reproduce HF's logits, so the GPU suite's
agreement section measures rounding, not a broken harness; and they leave no KV block allocated."""

from __future__ import annotations

import torch

from metainfer import LLM
from tests.helpers.tiny_models import build_tiny_model
from tools.agreement import compare, copy_hf_weights, hf_logits, teacher_forced_logits, teacher_forced_prefill_logits


def test_teacher_forced_paths_match_hf_fp32(tmp_path):
    hf = build_tiny_model(str(tmp_path), "qwen3")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", load_format="dummy", max_model_len=256, num_kv_blocks=32)
    copy_hf_weights(llm, hf)  # dummy weights replaced through the checkpoint path
    prompt_len, positions = 5, 20
    tokens = torch.randint(0, 512, (prompt_len + positions,), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(hf, tokens, prompt_len, positions)
    free = llm.llm_engine.block_manager.num_free_blocks
    for fn in (teacher_forced_logits, teacher_forced_prefill_logits):
        ours = fn(llm, tokens, prompt_len, positions)
        assert ours.shape == ref.shape
        result = compare(ours, ref)
        assert result["top1"] == 1.0 and result["cos_min"] > 0.9999, (fn.__name__, result)
        assert llm.llm_engine.block_manager.num_free_blocks == free
