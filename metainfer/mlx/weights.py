"""Checkpoints onto the MLX model: safetensors folders (HF's and mlx-lm's own, 4-/8-bit affine-quantized
ones included), GGUF files (through the engine's GGUF reader: HF names, Q/K un-permuted), dummy weights.

Every source becomes one dict of HF-named arrays; `build_dense_model` takes each tensor it needs, fuses
q|k|v and gate|up, and names every missing or unexpected tensor (ValueError), as the torch loader does.
An mlx-lm quantized checkpoint holds, per quantized linear or embedding, a packed uint32 `weight` with
`scales` and `biases`; config.json's `quantization` gives `group_size` / `bits` (and `mode`), with
per-module overrides keyed by the module's path (mlx-lm's mixed-precision recipes).
"""

from __future__ import annotations

import glob
import os

import mlx.core as mx
import torch

from metainfer.config import ConfigError, ModelSpec
from metainfer.mlx.layers import (
    Attention,
    DecoderLayer,
    DenseModel,
    Embedding,
    Linear,
    QuantFormat,
    Rotary,
    fuse_linears,
)

MX_DTYPES = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_tensors(config) -> dict[str, mx.array]:
    """The checkpoint an EngineConfig names, as HF-named MLX arrays (dummy: built in build_dense_model)."""
    if config.gguf_file is not None:
        from metainfer.loader.gguf import iterate_gguf

        return {name: mx.array(t.numpy()) for name, t in iterate_gguf(config.gguf_file)}
    files = sorted(glob.glob(os.path.join(config.model_dir, "*.safetensors")))
    if not files:
        raise ConfigError(f"model folder {config.model_dir!r} has no *.safetensors files")
    tensors: dict[str, mx.array] = {}
    for path in files:
        tensors.update(mx.load(path))
    return tensors


def dummy_tensors(spec: ModelSpec, seed: int, scale: float = 0.02) -> dict[str, mx.array]:
    """Random weights at the real dims (the torch path's dummy format: norms 1, the rest uniform ±scale)."""
    key = mx.random.key(seed)
    shapes = dense_shapes(spec)
    out = {}
    for i, (name, shape) in enumerate(sorted(shapes.items())):
        if "norm" in name:
            out[name] = mx.ones(shape)
        else:
            out[name] = mx.random.uniform(-scale, scale, shape, key=mx.random.split(key, i + 2)[i + 1])
    return out


def dense_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of a dense checkpoint and its shape."""
    h, d = spec.hidden_size, spec.head_dim
    q, kv, ff = spec.num_heads * d, spec.num_kv_heads * d, spec.intermediate_size
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
                       p + "mlp.down_proj.weight": (h, ff)})
        if spec.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if spec.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return shapes


class _Checkpoint:
    """Takes tensors by name, casting floating ones to the compute dtype; remembers what was missing."""

    def __init__(self, tensors: dict[str, mx.array], quantization: dict | None, dtype, shapes: dict):
        self.tensors, self.dtype, self.missing = dict(tensors), dtype, []
        self.quantization, self.shapes = quantization, shapes

    def take(self, name: str, required: bool = True) -> mx.array | None:
        t = self.tensors.pop(name, None)
        if t is None:
            if required:
                self.missing.append(name)
            return None
        quantized = name.endswith(".weight") and name[:-len(".weight")] + ".scales" in self.tensors
        expected = self.shapes.get(name)
        if expected is not None and not quantized and tuple(t.shape) != expected:
            raise ValueError(f"checkpoint tensor {name} has shape {tuple(t.shape)}, expected {expected}")
        return t.astype(self.dtype) if mx.issubdtype(t.dtype, mx.floating) else t

    def linear(self, prefix: str, in_out: bool, bias: bool = False) -> Linear:
        weight = self.take(prefix + ".weight")
        b = self.take(prefix + ".bias", required=bias)
        if prefix + ".scales" not in self.tensors:
            if weight is None:  # reported with the other missing tensors once the model is built
                weight = mx.zeros(self.shapes.get(prefix + ".weight", (1, 1)), dtype=self.dtype)
            return Linear(weight, b, in_out=in_out)
        scales, biases = self.take(prefix + ".scales"), self.take(prefix + ".biases")
        return Linear(weight, b, scales, biases, self.quant_format(prefix))

    def quant_format(self, prefix: str) -> QuantFormat:
        q = self.quantization
        if not q:
            raise ValueError(f"checkpoint tensor {prefix}.scales is quantized but config.json has no "
                             "'quantization' section")
        own = q.get(prefix)
        own = own if isinstance(own, dict) else q
        return QuantFormat(int(own.get("group_size", 64)), int(own.get("bits", 4)), str(own.get("mode", "affine")))


def build_dense_model(spec: ModelSpec, tensors: dict[str, mx.array], dtype, in_out: bool) -> DenseModel:
    """The MLX model from HF-named tensors. `in_out`: dense weights stored [in, out] (layers.py says when)."""
    if spec.family != "dense":
        raise ConfigError(f"device='mlx' supports the dense family (Qwen3, Qwen2, Llama); got {spec.architecture}")
    quantization = spec.raw.get("quantization") or spec.raw.get("quantization_config")
    ck = _Checkpoint(tensors, quantization, dtype, dense_shapes(spec))
    table = ck.linear("model.embed_tokens", in_out=in_out and spec.tie_word_embeddings)
    lm_head = table if spec.tie_word_embeddings else ck.linear("lm_head", in_out=in_out)
    if spec.tie_word_embeddings:
        ck.tensors.pop("lm_head.weight", None)  # some tied checkpoints still carry it
    rotary = Rotary(spec, tables=mx.default_device() == mx.cpu, dtype=dtype)
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        qkv = fuse_linears([ck.linear(p + f"self_attn.{n}_proj", in_out, bias=spec.qkv_bias) for n in "qkv"])
        o_proj = ck.linear(p + "self_attn.o_proj", in_out)
        q_norm = ck.take(p + "self_attn.q_norm.weight") if spec.qk_norm else None
        k_norm = ck.take(p + "self_attn.k_norm.weight") if spec.qk_norm else None
        attn = Attention(spec, qkv, o_proj, q_norm, k_norm, rotary)
        gate_up = fuse_linears([ck.linear(p + f"mlp.{n}_proj", in_out) for n in ("gate", "up")])
        down = ck.linear(p + "mlp.down_proj", in_out)
        norms = ck.take(p + "input_layernorm.weight"), ck.take(p + "post_attention_layernorm.weight")
        layers.append(DecoderLayer(attn, gate_up, down, *norms, spec.rms_norm_eps))
    model = DenseModel(spec, Embedding(table), layers, ck.take("model.norm.weight"), lm_head, dtype)
    if ck.missing:
        more = f" (and {len(ck.missing) - 8} more)" if len(ck.missing) > 8 else ""
        raise ValueError(f"missing tensor(s) in checkpoint: {', '.join(ck.missing[:8])}{more}")
    unexpected = [n for n in ck.tensors if not n.endswith(IGNORED_SUFFIXES)]
    if unexpected:
        raise ValueError(f"unexpected tensor(s) in checkpoint: {', '.join(sorted(unexpected)[:8])}")
    mx.eval(model.arrays())
    return model


def load_model(config) -> DenseModel:
    """The model an EngineConfig names, in its dtype, with the dense layout chosen for the device."""
    dtype = MX_DTYPES[config.torch_dtype]
    in_out = mx.default_device() == mx.cpu and dtype == mx.float32
    tensors = dummy_tensors(config.spec, config.seed) if config.load_format == "dummy" else read_tensors(config)
    return build_dense_model(config.spec, tensors, dtype, in_out)
