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
