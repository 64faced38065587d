"""Numeric kernels: a Triton kernel and its torch reference per op, picked once per engine.

The torch references are the CPU execution path and the test oracle; the Triton versions run on
CUDA. `select_ops(device)` makes the choice once when the engine is built, so the per-step hot
path calls `ops.rms_norm(...)` etc. without any device check. Importing this package neither
needs Triton nor initialises CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

import torch

from ._triton import HAS_TRITON, pdl_supported
from .activation import silu_and_mul_ref, silu_and_mul_triton
from .attention import (
    DEFAULT_MAX_NUM_SPLITS,
    alloc_decode_workspace,
    decode_workspace_numel_for,
    decode_num_splits,
    decode_workspace_numel,
    paged_decode_attention_qkv_composed,
    paged_decode_attention_qkv_ref,
    paged_decode_attention_qkv_triton,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
)
from .fused_linear import (
    norm_linear_engine,
    norm_linear_unfused,
    silu_mul_linear_engine,
    silu_mul_linear_unfused,
)
from .gemv import linear_ref, tuned_linear
from .kv_cache import FP8_KV_DTYPE, store_kv_ref, store_kv_triton, token_major_v_cache
from .qkv_prep import qk_norm_rope_store_ref, qk_norm_rope_store_triton
from .rms_norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from .rotary import build_cos_sin_cache, rope_mscale, rotary_neox_ref, rotary_neox_triton, yarn_get_mscale
from .skinny_gemm import TUNED_CONFIGS as SKINNY_TUNED_CONFIGS
from .skinny_gemm import linear_with_skinny, parse_skinny_table
from .sampling import GumbelSampler
from .step_inputs import step_inputs_ref, step_inputs_triton


@dataclass(frozen=True)
class KernelOps:
    """The kernel set of one engine; signatures as in docs/CONTRACTS.md."""

    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_neox: Callable
    silu_and_mul: Callable
    store_kv: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    qk_norm_rope_store: Callable
    # qk_norm_rope_store + paged_decode_attention for a decode step (kernels/attention.py): the two
    # composed (the default; the references), or with select_ops(fuse_decode_prep=True) one fused launch
    paged_decode_attention_qkv: Callable
    # a step's int64 token ids and positions from its packed int32 staging fields (kernels/step_inputs.py)
    step_inputs: Callable
    linear: Callable = linear_ref
    backend: str = "torch"
    pdl: bool = False  # Triton kernels launched under programmatic dependent launch (_triton.pdl_enter)
    # (residual-add +) RMSNorm -> linear and SiLU-and-mul -> linear (kernels/fused_linear.py); set by
    # `with_linear`, which binds them to this set's norm, activation and linear
    norm_linear: Callable | None = None
    silu_mul_linear: Callable | None = None
    # the one-pass Gumbel-max sampler class (kernels/sampling.py) for greedy/temperature-only batches, or None
    gumbel_sampler: type | None = None


def with_linear(ops: KernelOps, linear: Callable = linear_ref, gemv_table: Mapping | None = None,
                fuse_norm: bool = False, fuse_activation: bool = True) -> KernelOps:
    """`ops` with its GEMM set to `linear` and the fused linears bound to it: the unfused compositions
    of ops' own kernels, or with `gemv_table` (parsed, (N, K) -> GemvConfig) the Triton GEMVs with
    the norm (`fuse_norm`) / the activation (`fuse_activation`) folded in for the shapes that table
    tunes, with the table's configs as given (a `preload` in it is honoured even when ops.pdl is
    False; `select_ops` goes through `tuned_linear`, which drops it then)."""
    norm_linear = functools.partial(norm_linear_unfused, rms_norm=ops.rms_norm,
                                    add_rms_norm=ops.fused_add_rms_norm, linear=linear)
    silu_mul_linear = functools.partial(silu_mul_linear_unfused, silu_and_mul=ops.silu_and_mul, linear=linear)
    if gemv_table is not None and fuse_norm:
        norm_linear = functools.partial(norm_linear_engine, table=gemv_table, pdl=ops.pdl, unfused=norm_linear)
    if gemv_table is not None and fuse_activation:
        silu_mul_linear = functools.partial(silu_mul_linear_engine, table=gemv_table, pdl=ops.pdl,
                                            unfused=silu_mul_linear)
    return replace(ops, linear=linear, norm_linear=norm_linear, silu_mul_linear=silu_mul_linear)


REF_OPS = with_linear(KernelOps(
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    rotary_neox=rotary_neox_ref,
    silu_and_mul=silu_and_mul_ref,
    store_kv=store_kv_ref,
    paged_decode_attention=paged_decode_attention_ref,
    paged_prefill_attention=paged_prefill_attention_ref,
    qk_norm_rope_store=qk_norm_rope_store_ref,
    paged_decode_attention_qkv=paged_decode_attention_qkv_ref,
    step_inputs=step_inputs_ref,
    backend="torch",
))

TRITON_OPS = with_linear(KernelOps(
    rms_norm=rms_norm_triton,
    fused_add_rms_norm=fused_add_rms_norm_triton,
    rotary_neox=rotary_neox_triton,
    silu_and_mul=silu_and_mul_triton,
    store_kv=store_kv_triton,
    paged_decode_attention=paged_decode_attention_triton,
    paged_prefill_attention=paged_prefill_attention_triton,
    qk_norm_rope_store=qk_norm_rope_store_triton,
    paged_decode_attention_qkv=paged_decode_attention_qkv_triton,
    step_inputs=step_inputs_triton,
    backend="triton",
    gumbel_sampler=GumbelSampler,
))  # the GEMM: cuBLAS; on CUDA, select_ops picks the Triton GEMV where this GPU has a tuned table


# The ops that are Triton launchers taking `pdl` (linear is chosen per GPU in select_ops).
_PDL_OPS = tuple(f.name for f in fields(KernelOps)
                 if f.name not in ("linear", "backend", "pdl", "norm_linear", "silu_mul_linear", "gumbel_sampler"))


def select_ops(device: torch.device | str, use_triton: bool | None = None, gpu_name: str | None = None,
               pdl: bool = False, gemv_table: Mapping | None = None, fuse_norm: bool = False,
               fuse_activation: bool = True, fuse_decode_prep: bool = False, skinny_gemm: bool = True,
               skinny_table: Mapping | None = None, fused_sampler: bool = True) -> KernelOps:
    """Torch references on CPU, Triton kernels on CUDA. `use_triton` overrides (e.g. False to
    debug the GPU path with the references, True to run Triton on CPU under TRITON_INTERPRET=1).
    `gpu_name` (torch.cuda.get_device_name) picks the GEMM: the Triton GEMV with that GPU's tuned
    table for batch-1/2 shapes if it has one (kernels/gemv.py: TUNED_CONFIGS with `pdl`,
    TUNED_CONFIGS_NO_PDL without, or the PDL table where a GPU has no no-PDL one), cuBLAS otherwise;
    `gemv_table` ("NxK" or (N, K) -> GemvConfig or its dict; its `preload` kept only with `pdl`) replaces
    that table (an empty one:
    cuBLAS for every shape, but the rows the skinny GEMM takes, below). With a table,
    `fuse_activation` folds SiLU-and-mul into the down GEMV and
    `fuse_norm` the RMSNorms into the GEMVs after them (kernels/fused_linear.py). Defaults from the
    H200's A/B (docs/PERFORMANCE.md, runs 12-13): the folded SiLU saved 0.6 us a layer; the folded
    norm cost 1.4 us (qkv) and 3.4 us (gate_up) a launch more than a separate norm kernel, so it is off.
    `pdl` binds every Triton launcher to programmatic dependent launch (a CUDA device of compute
    capability >= 9: check with `pdl_supported`). `fuse_decode_prep` runs a decode step's q/k norm,
    rotary and K/V store inside the decode attention launch; off by default, the two kernels
    composed (run 18 on the H200: fused 231.5 against 239.4 tok/s at bs1, the 256-row attention
    6.47 against 5.75 ms). `skinny_gemm` sends 3..64-row GEMMs to the tensor-core skinny GEMM
    (kernels/skinny_gemm.py) for the (shape, row bucket) entries of `skinny_table` ("NxK/mB" or (N, K, B) ->
    config, e.g. a sweep's) or else of the GPU's tuned table; with neither it changes nothing (H200,
    run 21: batch 4 / 8 / 16 decode +5 / +8 / +2%). Selection makes no CUDA call."""
    device = torch.device(device)
    if use_triton is None:
        use_triton = device.type == "cuda"
    if pdl and (device.type != "cuda" or not use_triton):
        raise ValueError(f"pdl=True needs the Triton kernels on a CUDA device, got device {device}, "
                         f"use_triton={use_triton}")
    if not use_triton:
        return REF_OPS
    if not HAS_TRITON:
        raise RuntimeError(f"Triton kernels requested for device {device} but triton is not installed")
    ops = TRITON_OPS if fused_sampler else replace(TRITON_OPS, gumbel_sampler=None)
    if pdl:
        ops = replace(ops, pdl=True, **{name: functools.partial(getattr(ops, name), pdl=True) for name in _PDL_OPS})
    if not fuse_decode_prep:
        ops = replace(ops, paged_decode_attention_qkv=functools.partial(
            paged_decode_attention_qkv_composed, prep=ops.qk_norm_rope_store, decode=ops.paged_decode_attention))
    linear = tuned_linear(gpu_name or "", pdl=pdl, table=gemv_table)
    table = linear.keywords["table"] if isinstance(linear, functools.partial) else None
    skinny = skinny_table if skinny_table is not None else SKINNY_TUNED_CONFIGS.get(gpu_name or "")
    if skinny_gemm and skinny:
        linear = functools.partial(linear_with_skinny, base=linear, pdl=pdl, table=parse_skinny_table(skinny))
    return with_linear(ops, linear, table, fuse_norm, fuse_activation)


__all__ = [
    "DEFAULT_MAX_NUM_SPLITS",
    "FP8_KV_DTYPE",
    "decode_workspace_numel_for",
    "token_major_v_cache",
    "HAS_TRITON",
    "KernelOps",
    "REF_OPS",
    "TRITON_OPS",
    "alloc_decode_workspace",
    "build_cos_sin_cache",
    "decode_num_splits",
    "decode_workspace_numel",
    "fused_add_rms_norm_ref",
    "fused_add_rms_norm_triton",
    "paged_decode_attention_qkv_composed",
    "paged_decode_attention_qkv_ref",
    "paged_decode_attention_qkv_triton",
    "paged_decode_attention_ref",
    "paged_decode_attention_triton",
    "paged_prefill_attention_ref",
    "paged_prefill_attention_triton",
    "pdl_supported",
    "qk_norm_rope_store_ref",
    "qk_norm_rope_store_triton",
    "rms_norm_ref",
    "rms_norm_triton",
    "rope_mscale",
    "rotary_neox_ref",
    "rotary_neox_triton",
    "select_ops",
    "with_linear",
    "silu_and_mul_ref",
    "silu_and_mul_triton",
    "store_kv_ref",
    "store_kv_triton",
    "yarn_get_mscale",
]
