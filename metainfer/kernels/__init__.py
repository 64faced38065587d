"""Numeric kernels: a Triton kernel and its torch reference per op, picked once per engine.

The torch references are the CPU execution path and the test oracle; the Triton versions run on
CUDA. `select_ops(device)` makes the choice once when the engine is built, so the per-step hot
path calls `ops.rms_norm(...)` etc. without any device check. Importing this package neither
needs Triton nor initialises CUDA. Tuned launch tables are per-device JSON (kernels/configs/).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

import torch

from ._triton import HAS_TRITON, pdl_supported
from .activation import silu_and_mul_ref, silu_and_mul_triton
from .attention_decode import (
    DEFAULT_MAX_NUM_SPLITS,
    alloc_decode_workspace,
    decode_num_splits,
    decode_workspace_numel,
    decode_workspace_numel_for,
    paged_decode_attention_triton,
)
from .attention_prefill import paged_prefill_attention_triton
from .attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref
from .fused_linear import silu_mul_linear_engine, silu_mul_linear_unfused
from .fused_moe import fused_moe_slots_triton, fused_moe_triton, parse_moe_table
from .gemv import linear_ref, tuned_linear
from .kv_cache import FP8_KV_DTYPE, block_major_k_cache, store_kv_ref, store_kv_triton, token_major_v_cache
from .mla_absorb import mla_absorb_ref, mla_absorb_triton, mla_value_up_ref, mla_value_up_triton
from .mla_attention import mla_decode_attention_triton, mla_decode_workspace_numel, mla_prefill_attention_triton
from .mla_expanded import mla_expanded_attention_triton
from .mla_prep import mla_latent_prep_ref, mla_latent_prep_triton
from .mla_ref import mla_decode_attention_ref, mla_expanded_attention_ref, mla_prefill_attention_ref
from .moe_ref import ExpertSlots, fused_moe_ref, fused_moe_slots_ref, route_topk_ref, router_topk_ref
from .moe_routing import route_topk_triton, router_topk_triton
from .qkv_prep import qk_norm_rope_store_ref, qk_norm_rope_store_triton
from .rms_norm import (
    fused_add_rms_norm_ref,
    fused_add_rms_norm_slots_ref,
    fused_add_rms_norm_slots_triton,
    fused_add_rms_norm_triton,
    rms_norm_ref,
    rms_norm_triton,
)
from .rotary import build_cos_sin_cache, rope_mscale, rotary_neox_ref, rotary_neox_triton, yarn_get_mscale
from .sampling import GumbelSampler
from .skinny_gemm import linear_with_skinny, parse_skinny_table
from .step_inputs import step_inputs_ref, step_inputs_triton
from .tuned_configs import load_tuned_configs


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
    # per-head q/k RMSNorm -> rotary -> K/V into the paged cache, one launch (kernels/qkv_prep.py)
    qk_norm_rope_store: Callable
    # a step's int64 token ids and positions from its packed int32 staging fields (kernels/step_inputs.py)
    step_inputs: Callable
    # MoE (kernels/moe_ref.py, fused_moe.py): softmax top-k routing; the fused experts
    route_topk: Callable = route_topk_ref
    # a decode-sized router whole (GEMM + routing, <= ROUTER_FUSED_MAX_TOKENS tokens; moe_routing.py)
    router_topk: Callable = router_topk_ref
    fused_moe: Callable = fused_moe_ref
    # the same before the K-slot sum (ExpertSlots), and the residual add + RMSNorm that sums them in its launch
    fused_moe_slots: Callable = fused_moe_slots_ref
    fused_add_rms_norm_slots: Callable = fused_add_rms_norm_slots_ref
    # MLA (kernels/mla_prep.py, mla_ref.py, mla_attention.py): latent norm + rope + store; latent attention
    mla_latent_prep: Callable = mla_latent_prep_ref
    mla_decode_attention: Callable = mla_decode_attention_ref
    mla_prefill_attention: Callable = mla_prefill_attention_ref
    mla_expanded_attention: Callable = mla_expanded_attention_ref  # the expanded prefill's varlen attention
    mla_decode_workspace_numel: Callable | None = None
    # the absorbed form's per-head K-up of the query and V-up of the output (kernels/mla_absorb.py)
    mla_absorb: Callable = mla_absorb_ref
    mla_value_up: Callable = mla_value_up_ref
    linear: Callable = linear_ref
    backend: str = "torch"
    pdl: bool = False  # Triton kernels launched under programmatic dependent launch (_triton.pdl_enter)
    # SiLU-and-mul -> linear (kernels/fused_linear.py); set by `with_linear`, bound to this set's activation
    # and linear (and on a tuned GPU to the GEMV with the activation folded in)
    silu_mul_linear: Callable | None = None
    # the one-pass Gumbel-max sampler class (kernels/sampling.py) for greedy/temperature-only batches, or None
    gumbel_sampler: type | None = None


def with_linear(ops: KernelOps, linear: Callable = linear_ref, gemv_table: Mapping | None = None,
                fuse_activation: bool = True) -> KernelOps:
    """`ops` with its GEMM set to `linear` and silu_mul_linear bound to it: the unfused composition of ops'
    own kernels, or with `gemv_table` (parsed, (N, K) -> GemvConfig) and `fuse_activation` the Triton GEMV
    with the activation folded in for the shapes that table tunes."""
    silu_mul_linear = functools.partial(silu_mul_linear_unfused, silu_and_mul=ops.silu_and_mul, linear=linear)
    if gemv_table is not None and fuse_activation:
        silu_mul_linear = functools.partial(silu_mul_linear_engine, table=gemv_table, pdl=ops.pdl,
                                            unfused=silu_mul_linear)
    return replace(ops, linear=linear, silu_mul_linear=silu_mul_linear)


REF_OPS = with_linear(KernelOps(
    rms_norm=rms_norm_ref,
    fused_add_rms_norm=fused_add_rms_norm_ref,
    rotary_neox=rotary_neox_ref,
    silu_and_mul=silu_and_mul_ref,
    store_kv=store_kv_ref,
    paged_decode_attention=paged_decode_attention_ref,
    paged_prefill_attention=paged_prefill_attention_ref,
    qk_norm_rope_store=qk_norm_rope_store_ref,
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
    step_inputs=step_inputs_triton,
    route_topk=route_topk_triton,
    router_topk=router_topk_triton,
    fused_moe=fused_moe_triton,
    fused_moe_slots=fused_moe_slots_triton,
    fused_add_rms_norm_slots=fused_add_rms_norm_slots_triton,
    mla_latent_prep=mla_latent_prep_triton,
    mla_decode_attention=mla_decode_attention_triton,
    mla_prefill_attention=mla_prefill_attention_triton,
    mla_expanded_attention=mla_expanded_attention_triton,
    mla_decode_workspace_numel=mla_decode_workspace_numel,
    mla_absorb=mla_absorb_triton,
    mla_value_up=mla_value_up_triton,
    backend="triton",
    gumbel_sampler=GumbelSampler,
))  # the GEMM: cuBLAS; on CUDA, select_ops picks the Triton GEMV where this GPU has a tuned table


# The ops that are Triton launchers taking `pdl` (linear is chosen per GPU in select_ops).
_PDL_OPS = tuple(f.name for f in fields(KernelOps)
                 if f.name not in ("linear", "backend", "pdl", "silu_mul_linear", "gumbel_sampler",
                                   "mla_decode_workspace_numel"))


def select_ops(device: torch.device | str, use_triton: bool | None = None, gpu_name: str | None = None,
               pdl: bool = False, gemv_table: Mapping | None = None, fuse_activation: bool = True,
               skinny_gemm: bool = True, skinny_table: Mapping | None = None, fused_sampler: bool = True) -> KernelOps:
    """Torch references on CPU, Triton kernels on CUDA. `use_triton` overrides (e.g. False to debug the
    GPU path with the references, True to run Triton on CPU under TRITON_INTERPRET=1).
    `gpu_name` (torch.cuda.get_device_name) picks the GEMM from that GPU's tuned tables (kernels/configs/,
    `tuned_configs.py`): the Triton GEMV for batch-1/2 shapes of its `gemv` table under `pdl`, its
    `gemv_no_pdl` table without (the PDL table where it has none), cuBLAS otherwise; `gemv_table` ("NxK"
    -> config) replaces that table (an empty one: cuBLAS for every shape but the skinny GEMM's rows).
    With a table, `fuse_activation` folds SiLU-and-mul into the down GEMV (run 12: 0.6 us a layer).
    `pdl` binds every Triton launcher to programmatic dependent launch (a CUDA device of compute
    capability >= 9: check with `pdl_supported`). `skinny_gemm` sends 3..64-row GEMMs to the tensor-core
    skinny GEMM (kernels/skinny_gemm.py) for the (shape, row bucket) entries of `skinny_table` or else of
    the GPU's `skinny` table; with neither it changes nothing (H200, run 21: batch 4 / 8 / 16 decode
    +5 / +8 / +2%). `fused_sampler` False leaves the Gumbel-max sampler out (the torch sampler).
    Selection makes no CUDA call."""
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
    tuned = load_tuned_configs(gpu_name)
    if gemv_table is None:
        gemv_table = (tuned["gemv"] if pdl else tuned["gemv_no_pdl"]) or tuned["gemv"]
    linear = tuned_linear(gemv_table, pdl=pdl)
    table = linear.keywords["table"] if isinstance(linear, functools.partial) else None
    skinny = skinny_table if skinny_table is not None else tuned["skinny"]
    if skinny_gemm and skinny:
        linear = functools.partial(linear_with_skinny, base=linear, pdl=pdl, table=parse_skinny_table(skinny))
    if tuned.get("moe"):  # the fused MoE's tuned launch configs by (E, N, H) and token bucket
        moe_table = parse_moe_table(tuned["moe"])
        ops = replace(ops, fused_moe=functools.partial(ops.fused_moe, table=moe_table),
                      fused_moe_slots=functools.partial(ops.fused_moe_slots, table=moe_table))
    return with_linear(ops, linear, table, fuse_activation)


__all__ = [
    "DEFAULT_MAX_NUM_SPLITS",
    "ExpertSlots",
    "FP8_KV_DTYPE",
    "GumbelSampler",
    "HAS_TRITON",
    "KernelOps",
    "REF_OPS",
    "TRITON_OPS",
    "alloc_decode_workspace",
    "block_major_k_cache",
    "build_cos_sin_cache",
    "decode_num_splits",
    "decode_workspace_numel",
    "decode_workspace_numel_for",
    "fused_add_rms_norm_ref",
    "fused_add_rms_norm_triton",
    "linear_ref",
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
    "step_inputs_ref",
    "step_inputs_triton",
    "store_kv_ref",
    "store_kv_triton",
    "token_major_v_cache",
    "with_linear",
    "yarn_get_mscale",
]
