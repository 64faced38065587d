"""Numeric kernels: a Triton kernel and its torch reference per op, picked once per engine.

The torch references are the CPU execution path and the test oracle; the Triton versions run on
CUDA. `select_ops(device)` makes the choice once when the engine is built, so the per-step hot
path calls `ops.rms_norm(...)` etc. without any device check. Importing this package neither
needs Triton nor initialises CUDA.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from ._triton import HAS_TRITON, pdl_supported
from .activation import silu_and_mul_ref, silu_and_mul_triton
from .attention import (
    DEFAULT_MAX_NUM_SPLITS,
    alloc_decode_workspace,
    decode_num_splits,
    decode_workspace_numel,
    paged_decode_attention_ref,
    paged_decode_attention_triton,
    paged_prefill_attention_ref,
    paged_prefill_attention_triton,
)
from .gemv import linear_ref
from .kv_cache import store_kv_ref, store_kv_triton
from .qkv_prep import qk_norm_rope_store_ref, qk_norm_rope_store_triton
from .rms_norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton, rms_norm_ref, rms_norm_triton
from .rotary import build_cos_sin_cache, rope_mscale, rotary_neox_ref, rotary_neox_triton, yarn_get_mscale


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
    linear: Callable = linear_ref
    backend: str = "torch"
    pdl: bool = False  # Triton kernels launched under programmatic dependent launch (_triton.pdl_enter)


REF_OPS = KernelOps(
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    rotary_neox=rotary_neox_ref,
    silu_and_mul=silu_and_mul_ref,
    store_kv=store_kv_ref,
    paged_decode_attention=paged_decode_attention_ref,
    paged_prefill_attention=paged_prefill_attention_ref,
    qk_norm_rope_store=qk_norm_rope_store_ref,
    backend="torch",
)

TRITON_OPS = KernelOps(
    rms_norm=rms_norm_triton,
    fused_add_rms_norm=fused_add_rms_norm_triton,
    rotary_neox=rotary_neox_triton,
    silu_and_mul=silu_and_mul_triton,
    store_kv=store_kv_triton,
    paged_decode_attention=paged_decode_attention_triton,
    paged_prefill_attention=paged_prefill_attention_triton,
    qk_norm_rope_store=qk_norm_rope_store_triton,
    linear=linear_ref,  # on CUDA, select_ops picks the Triton GEMV where this GPU has a tuned table
    backend="triton",
)


# The ops that are Triton launchers taking `pdl` (linear is chosen per GPU in select_ops).
_PDL_OPS = tuple(f.name for f in fields(KernelOps) if f.name not in ("linear", "backend", "pdl"))


def select_ops(device: torch.device | str, use_triton: bool | None = None, gpu_name: str | None = None,
               pdl: bool = False) -> KernelOps:
    """Torch references on CPU, Triton kernels on CUDA. `use_triton` overrides (e.g. False to
    debug the GPU path with the references, True to run Triton on CPU under TRITON_INTERPRET=1).
    `gpu_name` (torch.cuda.get_device_name) picks the GEMM: the Triton GEMV with that GPU's tuned
    table for batch-1/2 shapes if it has one (kernels/gemv.py: TUNED_CONFIGS), cuBLAS otherwise.
    `pdl` binds every Triton launcher to programmatic dependent launch (a CUDA device of compute
    capability >= 9: check with `pdl_supported`). Selection makes no CUDA call."""
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
    ops = TRITON_OPS
    if pdl:
        ops = replace(ops, pdl=True, **{name: functools.partial(getattr(ops, name), pdl=True) for name in _PDL_OPS})
    if gpu_name is None:
        return ops
    from .gemv import tuned_linear

    return replace(ops, linear=tuned_linear(gpu_name, pdl=pdl))


__all__ = [
    "DEFAULT_MAX_NUM_SPLITS",
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
    "silu_and_mul_ref",
    "silu_and_mul_triton",
    "store_kv_ref",
    "store_kv_triton",
    "yarn_get_mscale",
]
