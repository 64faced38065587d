"""The dense family (Qwen3, Qwen2, Llama) computed in MLX over the paged KV pool.

Contract (the torch path's, docs/CONTRACTS.md): a step is a flat, unpadded batch of T tokens, `ids` and
`positions` int32 [T]; the model writes each token's K/V at its slot of the pool and attends over the
slots its sequence's block table names (`paged_kv.StepAttention`); `forward` returns the final-normed
hidden states [T, H], `logits` the LM head of the rows that sample, fp32 [S, V].

Ops: `mx.fast.rms_norm`, rope (`Rotary`: `mx.fast.rope` with the engine's own frequencies, or on MLX's CPU
build the same rotation from cos/sin tables made once a step), `mx.fast.scaled_dot_product_attention` (GQA
without tiling K/V), and one compiled SwiGLU. Projections are fused at load (q|k|v, gate|up): one GEMM each
instead of three or two.

Dense weight layout (`Linear.in_out`): MLX's CPU build calls a reference BLAS, whose `x @ W.T` inner loop
is a dot product it does not vectorise while `x @ W` is an axpy it does; on this CPU SmolLM2's fp32 LM-head
GEMV ran 1.51x faster with weights stored [in, out] (docs/results/mlx_cpu_levers.json). Metal and 16-bit
dtypes keep the checkpoint's [out, in]. The choice is made once, at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from metainfer.config import ConfigError, ModelSpec
from metainfer.kernels.rotary import _inv_freq


@mx.compile
def _swiglu(gate_up: mx.array) -> mx.array:
    gate, up = mx.split(gate_up, 2, axis=-1)
    return gate * mx.sigmoid(gate) * up


@dataclass
class QuantFormat:
    """mlx-lm's affine quantization of one weight: `bits` per value, one scale and bias per `group_size`."""

    group_size: int
    bits: int
    mode: str = "affine"


class Linear:
    """y = x W^T (+ b) for a dense weight (kept [in, out] when `in_out`) or an affine-quantized one
    (packed uint32 [out, in * bits / 32] with scales/biases [out, in / group_size], `mx.quantized_matmul`)."""

    def __init__(self, weight: mx.array, bias: mx.array | None = None, scales: mx.array | None = None,
                 biases: mx.array | None = None, quant: QuantFormat | None = None, in_out: bool = False):
        self.quant = quant
        self.bias = bias
        self.in_out = in_out and quant is None
        if quant is not None:
            self.weight, self.scales, self.biases = weight, scales, biases
            self.out_features = weight.shape[0]
        else:
            self.weight = mx.contiguous(weight.T) if self.in_out else weight
            self.out_features = weight.shape[0]
        self._forward = self._quantized if quant is not None else (self._dense_io if self.in_out else self._dense)

    def __call__(self, x: mx.array) -> mx.array:
        y = self._forward(x)
        return y if self.bias is None else y + self.bias

    def _dense(self, x):
        return x @ self.weight.T

    def _dense_io(self, x):
        return x @ self.weight

    def _quantized(self, x):
        q = self.quant
        return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                   group_size=q.group_size, bits=q.bits, mode=q.mode)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.weight, self.bias, getattr(self, "scales", None), getattr(self, "biases", None))
                if a is not None]


def fuse_linears(parts: list[Linear]) -> Linear | list[Linear]:
    """One Linear whose output is the parts' outputs side by side, when they share a format (the usual
    case); else the parts themselves (an mlx-lm mixed-precision checkpoint may quantize them differently)."""
    first = parts[0]
    if any(p.quant != first.quant or p.in_out != first.in_out or (p.bias is None) != (first.bias is None)
           for p in parts):
        return parts
    bias = mx.concatenate([p.bias for p in parts]) if first.bias is not None else None
    if first.quant is not None:
        fused = Linear(mx.concatenate([p.weight for p in parts]), bias,
                       mx.concatenate([p.scales for p in parts]), mx.concatenate([p.biases for p in parts]),
                       first.quant)
    else:
        axis = 1 if first.in_out else 0
        weight = mx.concatenate([p.weight for p in parts], axis=axis)
        fused = Linear(weight.T if first.in_out else weight, bias, in_out=first.in_out)
    return fused


def apply_linear(linear: Linear | list[Linear], x: mx.array) -> mx.array:
    if isinstance(linear, list):
        return mx.concatenate([p(x) for p in linear], axis=-1)
    return linear(x)


class Embedding:
    """Token embedding (dense [V, H], or quantized rows dequantized after the lookup). With a tied head the
    LM head reuses it: `as_linear` (a dense [in, out] head reads the rows through its transpose, so the
    table is held once)."""

    def __init__(self, table: Linear):
        self.table = table

    def __call__(self, ids: mx.array) -> mx.array:
        t = self.table
        if t.quant is not None:
            q = t.quant
            return mx.dequantize(t.weight[ids], t.scales[ids], t.biases[ids], group_size=q.group_size,
                                 bits=q.bits, mode=q.mode)
        if t.in_out:
            return mx.take(t.weight, ids, axis=1).T
        return t.weight[ids]


class Attention:
    """q|k|v projection, per-head q/k RMSNorm (Qwen3), rope, K/V store into the paged pool, attention over
    the sequence's slots, o projection."""

    def __init__(self, spec: ModelSpec, qkv, o_proj, q_norm, k_norm, rotary: Rotary):
        self.qkv, self.o_proj, self.q_norm, self.k_norm = qkv, o_proj, q_norm, k_norm
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.eps, self.scale = spec.rms_norm_eps, spec.attention_scale
        self.rotary = rotary
        self.splits = [self.num_heads * self.head_dim, (self.num_heads + self.num_kv_heads) * self.head_dim]

    def __call__(self, x: mx.array, rope, step, k_pool: mx.array, v_pool: mx.array):
        """x [T, H], `rope` the step's Rotary.prepare(positions); returns (out [T, H], the pools with this
        step's K/V stored)."""
        T, d = x.shape[0], self.head_dim
        q, k, v = mx.split(apply_linear(self.qkv, x), self.splits, axis=-1)
        q = q.reshape(T, self.num_heads, 1, d)  # rope's (batch, *, seq, dim): each token its own batch row
        k = k.reshape(T, self.num_kv_heads, 1, d)
        if self.q_norm is not None:
            q = mx.fast.rms_norm(q, self.q_norm, self.eps)
            k = mx.fast.rms_norm(k, self.k_norm, self.eps)
        q = self.rotary(q, rope)
        k = self.rotary(k, rope)
        k_pool[step.slots] = k.reshape(T, self.num_kv_heads, d)
        v_pool[step.slots] = v.reshape(T, self.num_kv_heads, d)
        out = step.attend(q, k_pool, v_pool, self.scale)  # [T, heads * d]
        return self.o_proj(out), k_pool, v_pool


class DecoderLayer:
    def __init__(self, attn: Attention, gate_up, down: Linear, input_norm: mx.array, post_norm: mx.array, eps: float):
        self.attn, self.gate_up, self.down = attn, gate_up, down
        self.input_norm, self.post_norm, self.eps = input_norm, post_norm, eps

    def __call__(self, x, rope, step, k_pool, v_pool):
        h, k_pool, v_pool = self.attn(mx.fast.rms_norm(x, self.input_norm, self.eps), rope, step, k_pool, v_pool)
        x = x + h
        h = _swiglu(apply_linear(self.gate_up, mx.fast.rms_norm(x, self.post_norm, self.eps)))
        return x + self.down(h), k_pool, v_pool


class DenseModel:
    """Embedding, the decoder layers, final norm, LM head (tied: the embedding table)."""

    def __init__(self, spec: ModelSpec, embed: Embedding, layers: list[DecoderLayer], norm: mx.array,
                 lm_head: Linear, dtype):
        self.spec, self.embed, self.layers, self.norm = spec, embed, layers, norm
        self.lm_head, self.dtype = lm_head, dtype

    def forward(self, ids: mx.array, positions: mx.array, step, kv) -> mx.array:
        """Final-normed hidden states [T, H]; every layer's K/V stored into `kv` (a paged_kv.PagedKVPool)."""
        x = self.embed(ids)
        rope = self.layers[0].attn.rotary.prepare(positions) if self.layers else None  # once for every layer
        for i, layer in enumerate(self.layers):
            x, kv.k[i], kv.v[i] = layer(x, rope, step, kv.k[i], kv.v[i])
        return mx.fast.rms_norm(x, self.norm, self.spec.rms_norm_eps)

    def logits(self, hidden: mx.array) -> mx.array:
        return self.lm_head(hidden).astype(mx.float32)

    def arrays(self) -> list[mx.array]:
        out = [self.norm, *self.embed.table.arrays()]
        if self.lm_head is not self.embed.table:
            out += self.lm_head.arrays()
        for layer in self.layers:
            a = layer.attn
            for lin in (a.qkv, a.o_proj, layer.gate_up, layer.down):
                for part in (lin if isinstance(lin, list) else [lin]):
                    out += part.arrays()
            out += [x for x in (a.q_norm, a.k_norm, layer.input_norm, layer.post_norm) if x is not None]
        return out


class Rotary:
    """Rotary embedding (non-interleaved halves, the engine's rope tables, so llama3 / linear / yarn scaling
    match the torch path), applied to q or k [T, heads, 1, d]. Two forms, chosen once at build (`tables`):
    `mx.fast.rope` (one fused kernel a call on Metal), or, on MLX's CPU build, whose `fast.rope` falls back
    to composed ops that recompute the angles' cos/sin for every q and k of every layer: cos/sin tables made
    once a step (`prepare`), and a call is `x * cos + rotate_half(x) * sin` with rotate_half a signed
    permutation matmul (exact: one +-1 term a column), two kernels (docs/PERFORMANCE.md, MLX section)."""

    def __init__(self, spec: ModelSpec, tables: bool, dtype=mx.float32):
        self.periods, self.mscale = rope_tables(spec)  # mx.fast.rope's `freqs`
        self.rotary_dim, self.head_dim, self.tables, self.dtype = spec.rotary_dim, spec.head_dim, tables, dtype
        if tables:
            half, d = spec.rotary_dim // 2, spec.head_dim
            rotate = np.zeros((d, d), dtype=np.float32)  # x @ rotate = (-x2, x1, 0) for x = (x1, x2, rest)
            rotate[np.arange(half) + half, np.arange(half)] = -1.0
            rotate[np.arange(half), np.arange(half) + half] = 1.0
            self.rotate = mx.array(rotate, dtype=dtype)
            self.inv_freq = 1.0 / self.periods
            mx.eval(self.rotate, self.inv_freq)  # evaluated here: a lazy array cannot run on another thread's stream

    def prepare(self, positions: mx.array):
        """What every layer's call needs for these positions [T]: the positions, or (cos, sin) [T, 1, 1, d]
        computed in fp32 and held in the model dtype, as HF does (cos 1 and sin 0 past the rotary dims; the
        yarn magnitude folded in)."""
        if not self.tables:
            return positions
        angles = positions.astype(mx.float32)[:, None] * self.inv_freq
        angles = mx.concatenate([angles, angles], axis=-1)
        cos, sin = mx.cos(angles) * self.mscale, mx.sin(angles) * self.mscale
        if self.rotary_dim < self.head_dim:
            rest = (positions.shape[0], self.head_dim - self.rotary_dim)
            cos = mx.concatenate([cos, mx.ones(rest, dtype=mx.float32)], axis=-1)
            sin = mx.concatenate([sin, mx.zeros(rest, dtype=mx.float32)], axis=-1)
        shape = (positions.shape[0], 1, 1, self.head_dim)
        return cos.reshape(shape).astype(self.dtype), sin.reshape(shape).astype(self.dtype)

    def __call__(self, x: mx.array, rope) -> mx.array:
        if not self.tables:
            if self.mscale != 1.0:
                x = x * self.mscale
            return mx.fast.rope(x, self.rotary_dim, traditional=False, base=None, scale=1.0, offset=rope,
                                freqs=self.periods)
        cos, sin = rope
        return x * cos + (x @ self.rotate) * sin


def rope_tables(spec: ModelSpec) -> tuple[mx.array, float]:
    """mx.fast.rope's `freqs` (periods, 1 / inv_freq) and the yarn magnitude scale, from the engine's rope."""
    inv_freq, mscale = _inv_freq(spec.rotary_dim, spec.rope_theta, spec.rope_scaling)
    if mscale != 1.0 and spec.rotary_dim != spec.head_dim:
        raise ConfigError("device='mlx' does not support a yarn magnitude scale with partial rotary dims")
    return mx.array((1.0 / inv_freq).numpy()), float(mscale)
