"""tools/agreement.py on the CPU with a tiny fp32 Qwen3: both teacher-forced paths (decode steps
through the runner, one paged prefill through the model) reproduce HF's logits, so the GPU suite's
agreement section measures rounding, not a broken harness; and they leave no KV block allocated."""

from __future__ import annotations

import pytest
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


def test_agreement_depth_follows_the_gpu_memory():
    """HF's fp32 model at full depth: Qwen3-30B-A3B (30.5B parameters by its model card: 122 GB) fits an H200's
    141 GB with headroom, not an H100's 80 GB; DeepSeek-V2-Lite (15.7B: 63 GB) fits both."""
    import json
    import os

    from tools.gpu_suite.families import agreement_layers

    configs = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "configs")

    def config(name):
        with open(os.path.join(configs, f"{name}.json")) as f:
            return json.load(f)

    h100, h200 = 80 * 2**30, 141 * 10**9
    assert agreement_layers("qwen3-30b-a3b", config("qwen3-30b-a3b"), h200) is None
    assert agreement_layers("qwen3-30b-a3b", config("qwen3-30b-a3b"), h100) == 12
    assert agreement_layers("deepseek-v2-lite", config("deepseek-v2-lite"), h100) is None
    with pytest.raises(ValueError, match="no fallback depth"):
        agreement_layers("deepseek-v2-lite", config("deepseek-v2-lite"), 40 * 10**9)
