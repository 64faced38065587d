"""ModelSpec from config.json: both rope key styles (rope_theta/rope_scaling and rope_parameters), the
derived fields, and an unsupported architecture named with the supported ones."""

from __future__ import annotations

import pytest

from metainfer.config import ModelSpec


def test_config_key_styles():
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    old = ModelSpec.from_dict({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = ModelSpec.from_dict({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}})
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling["rope_type"] == new.rope_scaling["rope_type"] == "linear"
    assert old.head_dim == 4 and old.qk_norm and not old.qkv_bias
    with pytest.raises(ValueError, match="unsupported architecture.*supported architectures: DeepseekV2ForCausalLM, "
                       "LlamaForCausalLM"):
        ModelSpec.from_dict({**base, "architectures": ["FooForCausalLM"]})


@pytest.mark.parametrize("name, positions", [("qwen3-8b", 40960), ("deepseek-v2-lite", 163840)])
def test_max_context_tokens_of_real_configs(name, positions):
    """Qwen3-8B: max_position_embeddings; DeepSeek-V2-Lite: YaRN's original 4,096 positions x factor 40."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = ModelSpec.from_file(os.path.join(root, "benchmarks", "configs", f"{name}.json"))
    assert spec.max_context_tokens == positions


def test_max_context_tokens_under_scaled_ropes():
    base = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 40960}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert ModelSpec.from_dict(base).max_context_tokens == 40960
    assert ModelSpec.from_dict({**base, "rope_scaling": yarn}).max_context_tokens == 131072  # Qwen3's long mode
    assert ModelSpec.from_dict({**base, "rope_scaling": {"type": "linear", "factor": 2.0}}).max_context_tokens == 81920
