"""ModelSpec from config.json: both rope key styles (rope_theta/rope_scaling and rope_parameters), the
derived fields, an unsupported architecture named with the supported ones, and the config values the engine cannot
run refused when read or built (activation, group-limited routing, MLA dims on the GPU)."""

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


_DEEPSEEK = {"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
             "num_hidden_layers": 2, "num_attention_heads": 2, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
             "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 16, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2}


def test_an_activation_other_than_silu_is_refused():
    """Every family's MLP is SwiGLU: a config naming another activation would otherwise run SiLU silently."""
    base = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2}
    assert ModelSpec.from_dict({**base, "hidden_act": "silu"}).architecture == "LlamaForCausalLM"
    ModelSpec.from_dict({**base, "hidden_act": "swish"})  # the same function under its other name
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        ModelSpec.from_dict({**base, "hidden_act": "gelu"})


def test_group_limited_routing_with_too_few_groups_is_refused_when_read():
    """topk_group above n_group, or top-k above the experts of the kept groups, would fail inside the router at the
    first step (a torch index error); the config reader names the fields instead."""
    spec = ModelSpec.from_dict(_DEEPSEEK)
    assert (spec.n_group, spec.topk_group, spec.num_experts_per_tok) == (4, 2, 2)
    with pytest.raises(ValueError, match=r"topk_group \(5\) must be in \[1, n_group=4\]"):
        ModelSpec.from_dict({**_DEEPSEEK, "topk_group": 5})
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(5\) exceeds the 4 experts in topk_group=2 groups"):
        ModelSpec.from_dict({**_DEEPSEEK, "num_experts_per_tok": 5})
    ModelSpec.from_dict({**_DEEPSEEK, "topk_method": "greedy", "num_experts_per_tok": 5})  # greedy: any group


def test_mla_dims_the_gpu_kernels_cannot_tile_are_refused_at_build():
    """The Triton MLA kernels need powers of two >= 16: the GPU path refuses other dims when the backend is built
    (naming them), the CPU path builds."""
    import dataclasses

    from metainfer.config import EngineConfig
    from metainfer.kernels import REF_OPS, TRITON_OPS
    from metainfer.models.registry import build_attention_backend

    for dims, bad in (({}, None), ({"kv_lora_rank": 48}, "kv_lora_rank=48"), ({"v_head_dim": 8}, "v_head_dim=8")):
        spec = ModelSpec.from_dict({**_DEEPSEEK, **dims})
        config = dataclasses.replace(EngineConfig(model="unused", device="cpu", max_model_len=64), spec=spec)
        assert build_attention_backend(config, REF_OPS).kv_lora_rank == spec.kv_lora_rank
        if bad is None:
            assert build_attention_backend(config, TRITON_OPS).kv_lora_rank == 16
        else:
            with pytest.raises(ValueError, match=f"powers of two >= 16 for .*{bad}.*device='cpu' runs this model"):
                build_attention_backend(config, TRITON_OPS)


def test_a_broken_config_is_one_error_naming_the_key_or_the_file(tmp_path):
    """A config.json without a size, with one that is not a positive int, or not JSON at all is a ConfigError
    (ModelConfigError) naming the key or the file: before, a KeyError or a TypeError deep in the engine or the
    spec report."""
    import json

    from metainfer import LLM
    from metainfer.config import ConfigError
    from metainfer.config.model_spec import ModelConfigError, read_config_json
    from metainfer.knowledge.spec_report import model_spec

    good = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    assert ModelSpec.from_dict(good).num_heads == 4
    for key in ("num_attention_heads", "vocab_size", "hidden_size", "num_hidden_layers"):
        with pytest.raises(ModelConfigError, match=f"lacks '{key}'"):
            model_spec({k: v for k, v in good.items() if k != key})
    for key, value in (("num_attention_heads", "4"), ("num_hidden_layers", 0), ("vocab_size", True),
                       ("head_dim", 2.5), ("num_key_value_heads", -2)):
        with pytest.raises(ModelConfigError, match=key):
            model_spec({**good, key: value})
    path = tmp_path / "config.json"
    path.write_text('{"a": 1,\n}')
    with pytest.raises(ModelConfigError, match="config.json is not valid JSON"):
        read_config_json(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="must hold a JSON object"):
        read_config_json(str(path))
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "hidden_size"}))
    with pytest.raises(ConfigError, match="lacks 'hidden_size'"):
        LLM(str(tmp_path), load_format="dummy", device="cpu")
