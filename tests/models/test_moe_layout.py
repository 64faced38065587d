"""Where the MoE families put their sparse layers, and the tuned MoE table's coverage of the real models.

Layer placement: DeepSeek-V2's `moe_layer_freq` (an MoE layer where layer_idx >= first_k_dense_replace and
layer_idx % moe_layer_freq == 0) and Qwen3-MoE's `decoder_sparse_step` / `mlp_only_layers` (MoE where
(layer_idx + 1) % decoder_sparse_step == 0 and layer_idx not in mlp_only_layers): the engine's per-layer
module kinds against HF's module kinds, and greedy fp32 CPU parity with HF on tiny random checkpoints.

Tuned table: the fused MoE looks its launch configs up by "E{E}_N{N}_H{H}" of the stacked expert weights
it is handed (E routed + shared experts, N = moe_intermediate_size / tp); the shipped H200 table must hold
the keys DeepSeek-V2-Lite and Qwen3-30B-A3B produce at tp=1 and tp=2, else they run the untuned guess.
"""

from __future__ import annotations

import os

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.config import ModelSpec
from metainfer.layers.moe import SparseMoeBlock
from tests.helpers.engine_checks import assert_drained, generate_ids
from tests.helpers.tiny_models import assert_matches_hf, build_tiny_model, hf_greedy, make_prompts

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LENGTHS = [1, 9, 33, 70]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
HF_MOE_CLASSES = ("DeepseekV2Moe", "Qwen3MoeSparseMoeBlock")
HF_DENSE_CLASSES = ("DeepseekV2MLP", "Qwen3MoeMLP")


def _hf_kinds(model) -> list[str]:
    kinds = []
    for layer in model.model.layers:
        name = type(layer.mlp).__name__
        assert name in HF_MOE_CLASSES + HF_DENSE_CLASSES, f"unknown HF feed-forward class {name}"
        kinds.append("moe" if name in HF_MOE_CLASSES else "dense")
    return kinds


def _kinds_of(model) -> list[str]:
    return ["moe" if isinstance(layer.mlp, SparseMoeBlock) else "dense" for layer in model.model.layers]


def _engine_kinds_from_config(folder: str) -> list[str]:
    """The layer kinds the engine builds from the checkpoint's config.json (on the meta device, before any
    loading, so a misplaced layer shows as a kind mismatch and not only as the loader's unexpected tensor)."""
    from metainfer.kernels import REF_OPS
    from metainfer.models.registry import model_class

    spec = ModelSpec.from_file(os.path.join(folder, "config.json"))
    with torch.device("meta"):
        return _kinds_of(model_class(spec)(spec, REF_OPS, None, dtype=torch.float32))


def _deepseek_formula(layers: int, first_dense: int, freq: int) -> list[str]:
    """The original DeepSeek-V2 modeling code's placement (DeepseekV2DecoderLayer)."""
    return ["moe" if i >= first_dense and i % freq == 0 else "dense" for i in range(layers)]


def _qwen3_moe_formula(layers: int, step: int, mlp_only: list[int]) -> list[str]:
    return ["moe" if i not in mlp_only and (i + 1) % step == 0 else "dense" for i in range(layers)]


def _place_deepseek_dense_layers(model, folder: str, kinds: list[str]) -> None:
    """Give `model` DeepSeek's placement (HF's own DeepseekV2MLP on the dense layers, random N(0, init
    range) weights like the rest) and write it to `folder` again (config.json keeps moe_layer_freq)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2MLP

    generator = torch.Generator().manual_seed(3)
    for layer, kind in zip(model.model.layers, kinds):
        if kind == "dense" and type(layer.mlp).__name__ != "DeepseekV2MLP":
            layer.mlp = DeepseekV2MLP(model.config)
            with torch.no_grad():
                for param in layer.mlp.parameters():
                    param.copy_(torch.randn(param.shape, generator=generator) * model.config.initializer_range)
    model.eval().save_pretrained(folder)


def _parity(folder: str, model) -> LLM:
    prompts = make_prompts(LENGTHS)
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    llm = LLM(folder, device="cpu", dtype="float32")
    got = generate_ids(llm, prompts, GREEDY)
    assert_drained(llm)
    assert_matches_hf(model, prompts, got, expected)
    return llm


DEEPSEEK_LAYOUTS = {
    # HF's DeepseekV2 agrees with DeepSeek's formula here: the only layer past first_k_dense_replace is a
    # multiple of moe_layer_freq
    "hf_agrees": dict(num_hidden_layers=3, first_k_dense_replace=2, moe_layer_freq=2),
    # HF makes layers 1-4 MoE; DeepSeek's formula (and the engine) MoE on 2 and 4 only
    "deepseek_formula": dict(num_hidden_layers=5, first_k_dense_replace=1, moe_layer_freq=2),
}


@pytest.mark.parametrize("layout", list(DEEPSEEK_LAYOUTS))
def test_deepseek_moe_layer_freq_places_dense_layers(layout, tmp_path):
    """`moe_layer_freq > 1`: the engine builds DeepSeek's dense/MoE placement and matches HF greedily.

    transformers (5.x, DeepseekV2DecoderLayer) ignores `moe_layer_freq`: it builds an MoE on every layer
    from `first_k_dense_replace` on. The original DeepSeek code (and the engine, ModelSpec.moe_layers) puts
    one where layer_idx >= first_k_dense_replace and layer_idx % moe_layer_freq == 0. So: "hf_agrees" is a
    config where the two coincide (plain HF is the reference); "deepseek_formula" is one where they differ,
    and HF's model is given DeepSeek's placement (HF's own DeepseekV2MLP swapped in on the formula's dense
    layers before save_pretrained) to serve as the reference. Both compare the engine's layer kinds with
    the formula and with the reference's module kinds, then the greedy tokens."""
    cfg = DEEPSEEK_LAYOUTS[layout]
    folder = str(tmp_path)
    model = build_tiny_model(folder, "deepseek_v2", **cfg)
    formula = _deepseek_formula(cfg["num_hidden_layers"], cfg["first_k_dense_replace"], cfg["moe_layer_freq"])
    hf_ignores_freq = ["moe" if i >= cfg["first_k_dense_replace"] else "dense"
                       for i in range(cfg["num_hidden_layers"])]
    assert _hf_kinds(model) == hf_ignores_freq, "transformers' DeepseekV2 placement changed: revisit this test"
    if layout == "hf_agrees":
        assert formula == hf_ignores_freq
    else:
        assert formula != hf_ignores_freq
        _place_deepseek_dense_layers(model, folder, formula)
    assert _hf_kinds(model) == formula
    assert ModelSpec.from_file(os.path.join(folder, "config.json")).raw["moe_layer_freq"] == cfg["moe_layer_freq"]
    assert _engine_kinds_from_config(folder) == formula
    llm = _parity(folder, model)
    assert _kinds_of(llm.llm_engine.runner.model) == formula


QWEN3_MOE_LAYOUTS = {
    "sparse_step2": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[]),
    "sparse_step2_mlp_only": dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]),
}


@pytest.mark.parametrize("layout", list(QWEN3_MOE_LAYOUTS))
def test_qwen3_moe_sparse_step_places_dense_layers(layout, tmp_path):
    """`decoder_sparse_step=2` (alone, and with `mlp_only_layers` removing one of its sparse layers): the
    engine's dense/MoE layer kinds equal HF's Qwen3MoE module kinds, and greedy tokens match HF."""
    cfg = QWEN3_MOE_LAYOUTS[layout]
    folder = str(tmp_path)
    model = build_tiny_model(folder, "qwen3_moe", **cfg)
    formula = _qwen3_moe_formula(cfg["num_hidden_layers"], cfg["decoder_sparse_step"], cfg["mlp_only_layers"])
    assert _hf_kinds(model) == formula, "transformers' Qwen3MoE placement changed: revisit this test"
    assert "dense" in formula and "moe" in formula
    assert _engine_kinds_from_config(folder) == _hf_kinds(model)
    llm = _parity(folder, model)
    assert _kinds_of(llm.llm_engine.runner.model) == _hf_kinds(model)


TUNED_GPU = "NVIDIA H200"
REAL_CONFIGS = ("deepseek-v2-lite.json", "qwen3-30b-a3b.json")


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("config", REAL_CONFIGS)
def test_h200_moe_table_has_the_engine_keys(config, tp):
    """The shipped H200 table (kernels/configs, `moe` section, read as select_ops reads it) holds the
    (E, N, H) keys the fused MoE looks up for the real models at this tp. The shapes come from the engine's
    own MoE blocks, built (on the meta device) as rank r of tp; the key from them the way fused_moe_triton
    derives it (E, 2N, H = w13.shape) and the engine's moe_table_key."""
    from metainfer.distributed.parallel_state import tp_state
    from metainfer.kernels import REF_OPS
    from metainfer.kernels.fused_moe import moe_table_key, parse_moe_table
    from metainfer.kernels.tuned_configs import load_tuned_configs
    from metainfer.models.registry import model_class

    spec = ModelSpec.from_file(os.path.join(ROOT, "benchmarks", "configs", config))
    table = load_tuned_configs(TUNED_GPU)["moe"]
    assert table, f"no `moe` section for {TUNED_GPU}"
    parsed = parse_moe_table(table)
    wanted = set()
    for rank in range(tp):
        with tp_state(rank, tp), torch.device("meta"):
            model = model_class(spec)(spec, REF_OPS, None, dtype=torch.bfloat16)
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
        assert len(blocks) == len(spec.moe_layers)
        for block in blocks:
            num_experts, n2, hidden = block.experts.gate_up_proj.shape
            wanted.add((num_experts, n2 // 2, hidden))
    for dims in sorted(wanted):
        key = moe_table_key(*dims)
        assert key in table and dims in parsed, (
            f"{config} at tp={tp}: the fused MoE looks up {key} (stacked experts, N per rank, hidden), which the "
            f"{TUNED_GPU} table lacks (it has {sorted(table)})")


def test_the_norm_after_each_moe_layer_sums_its_slots(tmp_path):
    """At tp = 1 each MoE block returns its unsummed expert slots and exactly the norm after it (the next layer's
    input norm, or the final norm after the last layer) takes them; a norm after a dense layer does not. Layout:
    DeepSeek's formula over 5 layers (dense, dense, MoE, dense, MoE), so both kinds of successor occur."""
    from metainfer.kernels import REF_OPS
    from metainfer.models.registry import model_class

    folder = str(tmp_path)
    build_tiny_model(folder, "deepseek_v2", **DEEPSEEK_LAYOUTS["deepseek_formula"])
    spec = ModelSpec.from_file(os.path.join(folder, "config.json"))
    with torch.device("meta"):
        model = model_class(spec)(spec, REF_OPS, None, dtype=torch.float32)
    layers = model.model.layers
    assert _kinds_of(model) == ["dense", "dense", "moe", "dense", "moe"]
    assert all(layer.mlp.returns_slots for layer in layers if isinstance(layer.mlp, SparseMoeBlock))
    following = [*(layer.input_layernorm for layer in layers[1:]), model.model.norm]
    assert [norm.sums_expert_slots for norm in following] == [False, False, True, False, True]
    assert not any(layer.post_attention_layernorm.sums_expert_slots for layer in layers)
    assert following[2]._add_norm is REF_OPS.fused_add_rms_norm_slots
    assert following[1]._add_norm is REF_OPS.fused_add_rms_norm
