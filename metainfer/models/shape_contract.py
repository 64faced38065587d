"""Per-rank shape contract: every parameter's expected shape on one TP rank, from formulas.

The formulas are docs/CONTRACTS.md's, written here independently of the layers, so that a
layer that shards wrongly (sliced twice, KV heads not replicated, vocabulary not padded)
disagrees with the contract. `check_param_shapes(model, spec, tp_size)` compares a built
model with it; the TP runner runs it on every rank after loading. This is the seed of the
shape checker.

Symbols (per rank): Hq = heads / tp, Hk = max(1, kv_heads / tp), D = head_dim,
I = intermediate_size, H = hidden_size, V = vocab_size, Vp = ceil(V / tp); MoE: E = routed experts (all on
every rank), S = n_shared_experts (stacked after them), Ne = moe_intermediate_size / tp;
MLA: Dn, Dr, Dv = qk_nope / qk_rope / v head dims, L = kv_lora_rank, Lq = q_lora_rank (replicated).
"""

from __future__ import annotations

from torch import nn

from metainfer.config import ConfigError, ModelSpec
from metainfer.knowledge.spec_report import spec_violations


class ShapeContractError(ValueError):
    """A built model whose parameters disagree with the per-rank contract."""


def validate_tp_config(spec: ModelSpec, tp_size: int, kv_cache_dtype="auto") -> None:
    """Raise ConfigError for the first constraint (spec, tp_size) breaks, naming the blueprint node and the
    config field; the same checks as `metainfer spec` (knowledge/spec_report.py: spec_violations)."""
    violations = spec_violations(spec, tp_size, kv_cache_dtype)
    if violations:
        raise ConfigError(f"{violations[0]['node']}: {violations[0]['message']}")


def per_rank_dims(spec: ModelSpec, tp_size: int) -> dict[str, int]:
    validate_tp_config(spec, tp_size)
    return {
        "H": spec.hidden_size,
        "D": spec.head_dim,
        "Hq": spec.num_heads // tp_size,
        "Hk": max(1, spec.num_kv_heads // tp_size),
        "I": spec.intermediate_size // tp_size,
        "Vp": -(-spec.vocab_size // tp_size),
        "E": spec.num_experts,
        "Ne": spec.moe_intermediate_size // tp_size,
    }


def expected_param_shapes(spec: ModelSpec, tp_size: int) -> dict[str, tuple[int, ...]]:
    """Parameter name -> per-rank shape, for every family (dense, Qwen3-MoE, DeepSeek-V2)."""
    if spec.family not in ("dense", "qwen3_moe", "deepseek_v2"):
        raise ConfigError(f"no shape contract for model family {spec.family!r}")
    d = per_rank_dims(spec, tp_size)
    h = d["H"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (d["Vp"], h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update(_mla_shapes(spec, d, p) if spec.is_mla else _gqa_shapes(spec, d, p))
        shapes.update(_moe_shapes(spec, d, p) if i in spec.moe_layers else
                      {p + "mlp.gate_up_proj.weight": (2 * d["I"], h), p + "mlp.down_proj.weight": (h, d["I"])})
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_word_embeddings:  # tied: lm_head shares embed_tokens' parameter
        shapes["lm_head.weight"] = (d["Vp"], h)
    return shapes


def _gqa_shapes(spec: ModelSpec, d: dict, p: str) -> dict:
    h, hd, hq, hk = d["H"], d["D"], d["Hq"], d["Hk"]
    shapes = {p + "self_attn.qkv_proj.weight": ((hq + 2 * hk) * hd, h), p + "self_attn.o_proj.weight": (h, hq * hd)}
    if spec.qkv_bias:
        shapes[p + "self_attn.qkv_proj.bias"] = ((hq + 2 * hk) * hd,)
    if spec.qk_norm:
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return shapes


def _mla_shapes(spec: ModelSpec, d: dict, p: str) -> dict:
    h, hq, lat = d["H"], d["Hq"], spec.kv_lora_rank
    dn, dr, dv = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    a, lq, bias = p + "self_attn.", spec.q_lora_rank, bool(spec.raw.get("attention_bias"))
    shapes = {a + "kv_a_layernorm.weight": (lat,), a + "kv_b_proj.weight": (hq * (dn + dv), lat),
              a + "o_proj.weight": (h, hq * dv)}
    q_rows = hq * (dn + dr) if lq is None else lq  # q split by heads; q-LoRA's down-projection replicated
    if lq is not None:
        shapes.update({a + "q_a_layernorm.weight": (lq,), a + "q_b_proj.weight": (hq * (dn + dr), lq)})
    if not bias:  # q (or q_a) and the latent projection stacked in one GEMM
        shapes[a + "fused_qkv_a_proj.weight"] = (q_rows + lat + dr, h)
        return shapes
    shapes.update({a + "kv_a_proj_with_mqa.weight": (lat + dr, h), a + "kv_a_proj_with_mqa.bias": (lat + dr,),
                   a + "o_proj.bias": (h,)})
    if lq is None:
        shapes[a + "q_proj.weight"] = (q_rows, h)
    else:
        shapes.update({a + "q_a_proj.weight": (lq, h), a + "q_a_proj.bias": (lq,)})
    return shapes


def _moe_shapes(spec: ModelSpec, d: dict, p: str) -> dict:
    h, e, ne, s = d["H"], d["E"], d["Ne"], spec.num_shared_experts  # shared experts stacked after the routed
    return {p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e + s, 2 * ne, h),
            p + "mlp.experts.down_proj": (e + s, h, ne)}


def shape_mismatches(model: nn.Module, spec: ModelSpec, tp_size: int) -> list[str]:
    """Human-readable differences between the model's parameters and the contract (empty = ok)."""
    expected = expected_param_shapes(spec, tp_size)
    actual = {name: tuple(p.shape) for name, p in model.named_parameters()}
    problems = [f"{name}: missing (expected {shape})" for name, shape in expected.items() if name not in actual]
    problems += [f"{name}: not in the contract (shape {shape})" for name, shape in actual.items()
                 if name not in expected]
    problems += [f"{name}: shape {actual[name]}, contract {shape}" for name, shape in expected.items()
                 if name in actual and actual[name] != shape]
    if spec.tie_word_embeddings and hasattr(model, "lm_head"):
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            problems.append("lm_head.weight: tie_word_embeddings is set but lm_head does not share embed_tokens")
    return problems


def check_param_shapes(model: nn.Module, spec: ModelSpec, tp_size: int, rank: int | None = None) -> None:
    problems = shape_mismatches(model, spec, tp_size)
    if problems:
        where = f" on rank {rank}" if rank is not None else ""
        raise ShapeContractError(f"parameter shapes{where} break the tp={tp_size} contract:\n  "
                                 + "\n  ".join(problems))
