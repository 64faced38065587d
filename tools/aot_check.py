"""Compile every Triton kernel ahead of time for Hopper (sm_90) on a machine without a GPU.

The CPU interpreter accepts programs the GPU compiler rejects (tl.dot with K < 16, calls to
non-jit helpers, dtype mismatches) and knows nothing of shared-memory limits. This check runs the
real launchers on small CPU tensors with each kernel's `run` intercepted, so the exact arguments,
constexprs and launch options the launcher would use are captured; each distinct launch is then
compiled with `triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` through
Triton's own argument binder (same specialisation as a real launch).

Usage (in a process WITHOUT TRITON_INTERPRET, ideally with a fresh TRITON_CACHE_DIR):
    python -m tools.aot_check [--arch 90] [op ...]
ops: rms_norm silu_and_mul rotary store_kv decode prefill gemv qk_prep sampling skinny_gemm step_inputs
(default: all).
The first case of each op is compiled a second time with programmatic dependent launch (pdl=True).
Exit status: 0 all compiled, 1 a kernel failed, 2 Triton cannot compile here at all (skip).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time

import torch

from metainfer.kernels import (
    FP8_KV_DTYPE,
    activation,
    attention_decode,
    attention_prefill,
    block_major_k_cache,
    gemv,
    kv_cache,
    qkv_prep,
    rms_norm,
    rotary,
    sampling,
    skinny_gemm,
    step_inputs,
    token_major_v_cache,
)
from metainfer.kernels._triton import HAS_TRITON, tl, triton
from metainfer.kernels.moe_ref import ExpertSlots
from metainfer.kernels.tuned_configs import load_tuned_configs

# H200/H100 opt-in shared memory per block.
_MAX_SHARED_BYTES = 232448

# Kernels that keep HF's per-op rounding in half precision (launched with enable_fp_fusion=False):
# their PTX must hold no half-precision fma, which would skip the rounding of a product.
_HF_ROUNDING_KERNELS = ("_rotary_neox_kernel", "_qk_norm_rope_store_kernel")

ALL_OPS = ("rms_norm", "silu_and_mul", "rotary", "store_kv", "decode", "prefill", "gemv", "qk_prep", "sampling",
           "skinny_gemm", "step_inputs")


def _kv_cache(blocks: int, block: int, hk: int, head_dim: int, dtype: torch.dtype):
    """(k_cache, v_cache) of zeros as the engine lays them out: an fp8 cache keeps K block-major and V token-major
    (kernels/kv_cache.py), a 16-bit one both head-major."""
    kv = torch.zeros(2, blocks, block, hk, head_dim, dtype=dtype)
    if dtype == FP8_KV_DTYPE:
        return block_major_k_cache(kv[0].clone()), token_major_v_cache(kv[1].clone())
    return kv[0], kv[1]


def _attention_cases(op, dtype, hq, hk, head_dim, n, tag, cache, tables, lens, fp32):
    """The decode or prefill launches of one config."""
    cases = []
    if op == "decode":
        q = torch.zeros(2, hq, head_dim, dtype=dtype)
        cases.append((f"decode {tag} splits<={n}",
                      lambda pdl, q=q, c=cache, t=tables, lens=lens, n=n:
                      attention_decode.paged_decode_attention_triton(q, c[0], c[1], t, lens, 0.1, max_num_splits=n,
                                                                     pdl=pdl)))
    else:
        q = torch.zeros(5, hq, head_dim, dtype=dtype)
        cu = torch.zeros(3, dtype=torch.int32)
        cases.append((f"prefill {tag} max_seqlen_q={n}",
                      lambda pdl, q=q, c=cache, t=tables, lens=lens, cu=cu, n=n:
                      attention_prefill.paged_prefill_attention_triton(q, c[0], c[1], cu, lens, t, n, 0.1, pdl=pdl)))
    return cases


def _cases(op: str):
    """(label, thunk) pairs that call the public launchers with representative shapes; a thunk
    takes `pdl` (launch with programmatic dependent launch)."""
    bf16, fp32, fp8 = torch.bfloat16, torch.float32, torch.float8_e4m3fn  # fp8: kv_cache_dtype="fp8"
    cases = []
    if op == "rms_norm":
        for dtype, hidden in ((bf16, 4096), (fp32, 1000)):
            x = torch.zeros(3, hidden, dtype=dtype)
            w = torch.ones(hidden, dtype=dtype)
            cases.append((f"rms_norm {dtype} H={hidden}",
                          lambda pdl, x=x, w=w: rms_norm.rms_norm_triton(x, w, 1e-6, pdl=pdl)))
            cases.append((f"fused_add_rms_norm {dtype} H={hidden}",
                          lambda pdl, x=x, w=w: rms_norm.fused_add_rms_norm_triton(x, x.clone(), w, 1e-6, pdl=pdl)))
        # the norm after a MoE block at tp = 1: DeepSeek-V2-Lite's 8 slots (6 routed + 2 shared of 66) summed in it
        # (the slots in the model's dtype)
        slots = ExpertSlots(torch.zeros(3 * 8, 2048, dtype=bf16), torch.zeros(3, 8, dtype=torch.int32), 66)
        cases.append(("fused_add_rms_norm_slots bf16 H=2048 K=8",
                      lambda pdl, s=slots: rms_norm.fused_add_rms_norm_slots_triton(
                          s, torch.zeros(3, 2048, dtype=bf16), torch.ones(2048, dtype=bf16), 1e-6, pdl=pdl)))
        qkv = torch.zeros(3, (32 + 2 * 8) * 128, dtype=bf16)
        q_heads = qkv[:, : 32 * 128].view(3, 32, 128)
        cases.append(("rms_norm bf16 head-norm [T,32,128] strided",
                      lambda pdl: rms_norm.rms_norm_triton(q_heads, torch.ones(128, dtype=bf16), 1e-6, pdl=pdl)))
    elif op == "silu_and_mul":
        for dtype, inter in ((bf16, 12288), (fp32, 100)):
            x = torch.zeros(2, 2 * inter, dtype=dtype)
            cases.append((f"silu_and_mul {dtype} I={inter}",
                          lambda pdl, x=x: activation.silu_and_mul_triton(x, pdl=pdl)))
    elif op == "rotary":
        for dtype, hq, hk, head_dim, rot in ((bf16, 32, 8, 128, 128), (bf16, 16, 16, 192, 64), (fp32, 4, 1, 64, 32)):
            pos = torch.zeros(3, dtype=torch.int64)
            qkv = torch.zeros(3, (hq + 2 * hk) * head_dim, dtype=dtype)
            q, k = qkv[:, : hq * head_dim], qkv[:, hq * head_dim : (hq + hk) * head_dim]
            cache = torch.zeros(16, rot, dtype=fp32)
            cases.append((f"rotary {dtype} Hq={hq} Hk={hk} D={head_dim} rot={rot}",
                          lambda pdl, pos=pos, q=q, k=k, cache=cache, d=head_dim:
                          rotary.rotary_neox_triton(pos, q, k, cache, d, pdl=pdl)))
    elif op == "store_kv":
        for dtype, hk, head_dim, block, cache_dtype in ((bf16, 8, 128, 16, bf16), (fp32, 1, 64, 1, fp32),
                                                        (bf16, 8, 128, 16, fp8)):
            qkv = torch.zeros(4, (4 * hk + 2 * hk) * head_dim, dtype=dtype)
            k = qkv[:, 4 * hk * head_dim : 5 * hk * head_dim].view(4, hk, head_dim)
            v = qkv[:, 5 * hk * head_dim :].view(4, hk, head_dim)
            cache = _kv_cache(3, block, hk, head_dim, cache_dtype)
            slots = torch.zeros(4, dtype=torch.int32)
            cases.append((f"store_kv {dtype} cache {cache_dtype} Hk={hk} D={head_dim} S={block}",
                          lambda pdl, k=k, v=v, c=cache, s=slots:
                          kv_cache.store_kv_triton(k, v, c[0], c[1], s, pdl=pdl)))
    elif op in ("decode", "prefill"):
        # (dtype, Hq, Hk, D, block size, max_num_splits or max_seqlen_q)
        if op == "decode":
            # the split path (splits > 1) holds the in-kernel merge (atomics); 32 splits: the
            # batch-1 shape of Qwen3-8B (BLOCK_S 32, merge tiles of 8 splits)
            configs = [(bf16, 32, 8, 128, 16, 1), (bf16, 32, 8, 128, 16, 8), (bf16, 32, 8, 128, 16, 32),
                       (bf16, 32, 32, 128, 16, 8), (bf16, 16, 2, 64, 32, 8), (bf16, 8, 1, 128, 1, 8),
                       (fp32, 8, 2, 128, 16, 8), (torch.float16, 8, 2, 64, 16, 32),
                       (bf16, 32, 8, 128, 16, 1, fp8), (bf16, 32, 8, 128, 16, 32, fp8)]
        else:
            configs = [(bf16, 32, 8, 128, 16, 16), (bf16, 32, 8, 128, 16, 2048), (bf16, 32, 32, 128, 1, 2048),
                       (bf16, 16, 2, 64, 32, 2048), (bf16, 8, 2, 256, 16, 2048), (fp32, 8, 2, 128, 16, 2048),
                       (bf16, 32, 8, 128, 16, 16, fp8), (bf16, 32, 8, 128, 16, 2048, fp8)]
        for dtype, hq, hk, head_dim, block, n, *cache_dtype in configs:
            cache_dtype = cache_dtype[0] if cache_dtype else dtype
            cache = _kv_cache(4, block, hk, head_dim, cache_dtype)
            tables = torch.zeros(2, 4096 // block, dtype=torch.int32)
            lens = torch.zeros(2, dtype=torch.int32)
            tag = f"{dtype} Hq={hq} Hk={hk} D={head_dim} S={block}" + (f" cache {cache_dtype}" if cache_dtype != dtype
                                                                        else "")
            cases += _attention_cases(op, dtype, hq, hk, head_dim, n, tag, cache, tables, lens, fp32)
    elif op == "gemv":
        # the H200 table's configs (first weight tile preloaded) at the Qwen3-8B decode shapes, M = 1 and
        # 2 (the first case is also compiled with PDL: the preload's only effective combination); a ragged
        # K split and a bias; the plain loop
        table = gemv.parse_gemv_table(load_tuned_configs("NVIDIA H200")["gemv"])
        qkv, down = table[(6144, 4096)], table[(4096, 12288)]
        for m, n, k, cfg in ((1, 6144, 4096, qkv), (2, 4096, 4096, table[(4096, 4096)]),
                             (1, 1000, 3000, gemv.GemvConfig(block_n=8, block_k=1024, num_warps=8, split_k=2)),
                             (1, 6144, 4096, gemv.GemvConfig(block_n=4, block_k=1024, num_warps=4))):
            x, w, b = torch.zeros(m, k, dtype=bf16), torch.zeros(n, k, dtype=bf16), torch.zeros(n, dtype=bf16)
            cases.append((f"gemv bf16 M={m} N={n} K={k} split={cfg.split_k} preload={cfg.preload}",
                          lambda pdl, x=x, w=w, b=b, cfg=cfg: gemv.gemv_triton(x, w, b, config=cfg, pdl=pdl)))
        hidden, inter = 4096, 12288
        for m in (1, 2):
            gu, w = torch.zeros(m, 2 * inter, dtype=bf16), torch.zeros(hidden, inter, dtype=bf16)
            cases.append((f"silu_mul_gemv bf16 M={m} N={hidden} K={inter}",
                          lambda pdl, gu=gu, w=w: gemv.silu_mul_gemv_triton(gu, w, config=down, pdl=pdl)))
    elif op == "qk_prep":
        for dtype, tokens, hq, hk, head_dim, cache_dtype in ((bf16, 1, 32, 8, 128, bf16), (bf16, 64, 32, 8, 128, bf16),
                                                             (fp32, 3, 4, 2, 64, fp32), (bf16, 64, 32, 8, 128, fp8)):
            qkv = torch.zeros(tokens, (hq + 2 * hk) * head_dim, dtype=dtype)
            cache = _kv_cache(4, 16, hk, head_dim, cache_dtype)
            pos, slots = torch.zeros(tokens, dtype=torch.int64), torch.zeros(tokens, dtype=torch.int32)
            cos_sin, w = torch.zeros(64, head_dim, dtype=fp32), torch.ones(head_dim, dtype=dtype)
            cases.append((f"qk_norm_rope_store {dtype} cache {cache_dtype} T={tokens} Hq={hq} Hk={hk} D={head_dim}",
                          lambda pdl, a=(qkv, pos, cos_sin, w, w, 1e-6, cache[0], cache[1], slots, hq, hk, head_dim):
                          qkv_prep.qk_norm_rope_store_triton(*a, pdl=pdl)))
    elif op == "step_inputs":
        for tokens in (1, 512, 8192):  # a decode bucket, the largest one, a prefill step
            i32 = torch.zeros(tokens, dtype=torch.int32)
            cases.append((f"step_inputs T={tokens}", lambda pdl, i32=i32: step_inputs.step_inputs_triton(
                i32, i32, i32, torch.zeros(4, dtype=torch.int64), pdl=pdl)))
    elif op == "sampling":
        # Qwen3 vocabulary (padded LM-head rows): one row (148 splits), 256 rows (4 splits), given noise
        vocab = 151936
        for rows, dtype, pad in ((1, bf16, 64), (256, bf16, 64), (3, fp32, 64), (4, bf16, 65)):  # 65: the
            logits = torch.zeros(rows, vocab + pad, dtype=dtype)  # row stride's class that is not a multiple of 16
            temps = torch.zeros(rows, dtype=fp32)
            cases.append((f"gumbel_sample {dtype} B={rows} stride {vocab + pad}",
                          lambda pdl, lg=logits, t=temps, n=rows: sampling.GumbelSampler(n, vocab, "cpu", pdl=pdl)(
                              lg, t, seed=12345)))
        logits, noise = torch.zeros(2, 1000, dtype=bf16), torch.full((2, 1000), 0.5, dtype=fp32)
        cases.append(("gumbel_sample bf16 B=2 given noise",
                      lambda pdl: sampling.GumbelSampler(2, 1000, "cpu", pdl=pdl)(
                          logits, torch.zeros(2, dtype=fp32), seed=12345, noise=noise)))
    elif op == "skinny_gemm":
        # the H200 table's configs at 5 rows (the first also with PDL); the untuned DEFAULT_CONFIG at the
        # Qwen3-8B decode shapes at 8 and 64 rows (the automatic K split on the 4096-row ones), a bias
        for (n, k, _), cfg in skinny_gemm.parse_skinny_table(load_tuned_configs("NVIDIA H200")["skinny"]).items():
            x, w = torch.zeros(5, k, dtype=bf16), torch.zeros(n, k, dtype=bf16)
            cases.append((f"skinny_gemm bf16 M=5 N={n} K={k} H200 table",
                          lambda pdl, x=x, w=w, cfg=cfg: skinny_gemm.skinny_gemm_triton(x, w, config=cfg, pdl=pdl)))
        for m, (n, k) in ((8, (6144, 4096)), (8, (4096, 12288)), (64, (4096, 4096)), (64, (151936, 4096))):
            x, w = torch.zeros(m, k, dtype=bf16), torch.zeros(n, k, dtype=bf16)
            cases.append((f"skinny_gemm bf16 M={m} N={n} K={k}",
                          lambda pdl, x=x, w=w: skinny_gemm.skinny_gemm_triton(x, w, pdl=pdl)))
        x, w, b = torch.zeros(5, 1000, dtype=fp32), torch.zeros(300, 1000, dtype=fp32), torch.zeros(300, dtype=fp32)
        cases.append(("skinny_gemm fp32 M=5 N=300 K=1000 bias",
                      lambda pdl: skinny_gemm.skinny_gemm_triton(x, w, b, pdl=pdl)))
    else:
        raise ValueError(f"unknown op {op!r}; choose from {ALL_OPS}")
    return cases


def _kernel_objects():
    return [
        rms_norm._rms_norm_kernel, activation._silu_and_mul_kernel, rotary._rotary_neox_kernel,
        kv_cache._store_kv_kernel, attention_decode._decode_split_kernel, attention_prefill._prefill_kernel,
        gemv._gemv_kernel, gemv._splitk_reduce_kernel, qkv_prep._qk_norm_rope_store_kernel,
        sampling._gumbel_sample_kernel, skinny_gemm._skinny_gemm_kernel, step_inputs._step_inputs_kernel,
    ]


@contextlib.contextmanager
def capture_launches(kernels):
    """Intercept each kernel's `run` inside the block, so the launchers run on CPU tensors and launch nothing;
    the list it yields collects (kernel, args, kwargs, grid) of every launch, as the launcher made it."""
    captured = []
    for kernel in kernels:
        def record(*a, grid, warmup, _kernel=kernel, **kw):
            captured.append((_kernel, a, kw, grid))
        kernel.run = record
    try:
        yield captured
    finally:
        for kernel in kernels:
            del kernel.run


def _compile_launch(kernel, args, kwargs, target, backend):
    """Compile one captured launch exactly as JITFunction.run would specialise it."""
    from triton.compiler import ASTSource
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs)
    kwargs.setdefault("debug", False)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)


def _resource_usage(compiled) -> str:
    """Registers and local memory (spills) per thread from cuobjdump, when the cubin is there."""
    import subprocess
    import tempfile

    cubin = compiled.asm.get("cubin")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", text)
    if not regs:
        return ""
    # spilled registers show as local memory or, in newer cuobjdumps, as per-thread stack
    spills = [f"{name.lower()}={m.group(1)}B" for name in ("LOCAL", "STACK")
              if (m := re.search(rf"{name}:(\d+)", text)) and int(m.group(1))]
    return f"regs={regs.group(1)}" + (f" SPILL {' '.join(spills)}" if spills else "")


@triton.jit
def _aot_probe_kernel(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)


def _probe_compile(target) -> str | None:
    """None if Triton can compile a trivial kernel for `target` here, else the reason."""
    if not HAS_TRITON:
        return "triton is not installed"
    try:
        from triton.compiler import ASTSource

        src = ASTSource(_aot_probe_kernel, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": 64})
        triton.compile(src, target=target)
    except Exception as exc:  # noqa: BLE001 - any failure here means "cannot compile on this machine"
        return f"triton cannot compile for {target}: {exc!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", default=list(ALL_OPS))
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("aot_check: unset TRITON_INTERPRET (the interpreter cannot compile)", file=sys.stderr)
        return 2
    if not HAS_TRITON:
        print("aot_check: SKIP: triton is not installed", file=sys.stderr)
        return 2
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    target = GPUTarget("cuda", args.arch, 32)
    reason = _probe_compile(target)
    if reason is not None:
        print(f"aot_check: SKIP: {reason}", file=sys.stderr)
        return 2
    backend = make_backend(target)

    with capture_launches(_kernel_objects()) as captured:
        launches = []
        for op in args.ops:
            cases = _cases(op)
            firsts = list({label.split()[0]: (label, thunk) for label, thunk in reversed(cases)}.values())
            # every case without PDL, and the first case of each launcher (label's first word) with it
            for label, thunk, pdl in [(label, thunk, False) for label, thunk in cases] + [(*c, True) for c in firsts]:
                start = len(captured)
                thunk(pdl)
                label = f"{label} pdl" if pdl else label
                launches += [(label, *c) for c in captured[start:]]

    failures = 0
    seen = {}
    for label, kernel, a, kw, grid in launches:
        name = kernel.fn.__name__
        try:
            t0 = time.perf_counter()
            compiled = _compile_launch(kernel, a, kw, target, backend)
            key = compiled.hash
            if key in seen:
                continue
            seen[key] = label
            shared = compiled.metadata.shared
            status = "ok" if shared <= _MAX_SHARED_BYTES else "FAIL shared memory"
            hf_rounding = name in _HF_ROUNDING_KERNELS
            if hf_rounding and re.search(r"\bfma\.rn\.(bf16|f16)\b", compiled.asm.get("ptx", "")):
                status = "FAIL half-precision fma (a rounding point contracted away)"
            failures += status != "ok"
            print(f"{status:4s} {name:22s} {label:54s} grid={grid} smem={shared}B "
                  f"warps={compiled.metadata.num_warps} {_resource_usage(compiled)} {time.perf_counter() - t0:.2f}s")
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
            failures += 1
            print(f"FAIL {name:24s} {label}: {type(exc).__name__}: {exc}")
    print(f"aot_check sm_{args.arch}: {len(seen)} distinct kernels compiled, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
