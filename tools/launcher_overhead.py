"""Host microseconds of the attention launchers' own Python (checks, split rule, tile choice, argument
building) with the Triton kernel replaced by a no-op, planned at every call and replayed from a step's plans
(kernels/_triton.py: PlannedLaunch), at a dense mixed step's shapes (Qwen3-8B heads: 32 q, 8 kv,
D 128; 64 decode rows at context 600 beside a 128-token prompt). Runs on the CPU: what it times is Python,
which the GPU host pays per layer and launch on top of Triton's own launcher (a mixed step calls each of the two
launchers once a layer: 72 calls at 36 layers); then the MLA launchers at DeepSeek-V2-Lite's shapes.

    python -m tools.launcher_overhead [--calls 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _per_call_us(fn, calls: int) -> float:
    for _ in range(min(100, calls)):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(calls: int = 2000) -> dict:
    from metainfer.kernels import attention_decode, attention_prefill

    saved = attention_prefill._prefill_kernel, attention_decode._decode_split_kernel
    attention_prefill._prefill_kernel = attention_decode._decode_split_kernel = _NoLaunch()
    try:
        decode_rows, prompt, hq, hk, d = 64, 128, 32, 8, 128
        rows = decode_rows + 1
        q = torch.zeros(decode_rows + prompt, hq, d, dtype=torch.bfloat16)
        k_cache = torch.zeros(64, 16, hk, d, dtype=torch.bfloat16)
        v_cache = torch.zeros_like(k_cache)
        tables = torch.zeros(rows, 256, dtype=torch.int32)
        lens = torch.full((rows,), 600, dtype=torch.int32)
        cu = torch.arange(rows + 1, dtype=torch.int32)
        workspace = torch.zeros(attention_decode.decode_workspace_numel_for(rows, hq, hk, d, 256 * 16))
        # a mixed step's two parts, as their metadata holds them: views made once, shared by every layer
        p_cu, p_lens, p_tables = cu[decode_rows:], lens[decode_rows:], tables[decode_rows:]
        d_q, d_lens, d_tables = q[:decode_rows], lens[:decode_rows], tables[:decode_rows]
        res = {}
        for mode in ("planned_every_call", "replayed"):  # no plans dict; one dict shared by the calls (a step)
            prefill_plans, decode_plans = ({}, {}) if mode == "replayed" else (None, None)
            prefill_us = _per_call_us(lambda plans=prefill_plans: attention_prefill.paged_prefill_attention_triton(
                q, k_cache, v_cache, p_cu, p_lens, p_tables, prompt, 0.1, out=q, plans=plans), calls)
            decode_us = _per_call_us(lambda plans=decode_plans: attention_decode.paged_decode_attention_triton(
                d_q, k_cache, v_cache, d_tables, d_lens, 0.1, workspace=workspace, out=d_q, plans=plans), calls)
            if mode == "replayed":  # one plan each: every call after the first replayed it
                assert len(prefill_plans) == 1 and len(decode_plans) == 1, (prefill_plans, decode_plans)
            res[mode] = {"prefill_wrapper_us": round(prefill_us, 1), "decode_wrapper_us": round(decode_us, 1),
                         "mixed_step_ms_at_36_layers": round(36 * (prefill_us + decode_us) / 1e3, 2)}
    finally:
        attention_prefill._prefill_kernel, attention_decode._decode_split_kernel = saved
    return {**res, "mla": measure_mla(calls), "calls": calls,
            "torch": torch.__version__, "cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2)}


def measure_mla(calls: int = 2000) -> dict:
    """The same for the MLA launchers at a DeepSeek-V2-Lite mixed step's parts (16 heads, L 512, R 64; 64 decode
    rows at context 600 over the engine's 4,096-token table beside a 128-token prompt; 27 layers)."""
    from metainfer.kernels import mla_attention

    saved = mla_attention._mla_prefill_kernel, mla_attention._mla_decode_kernel
    mla_attention._mla_prefill_kernel = mla_attention._mla_decode_kernel = _NoLaunch()
    try:
        decode_rows, prompt, heads, lat, rope = 64, 128, 16, 512, 64
        rows = decode_rows + 1
        q_lat = torch.zeros(heads, decode_rows + prompt, lat, dtype=torch.bfloat16).transpose(0, 1)  # a bmm's
        q_pe = torch.zeros(decode_rows + prompt, heads, 128 + rope, dtype=torch.bfloat16)[..., 128:]
        cache = torch.zeros(64, 16, lat + rope, dtype=torch.bfloat16)
        tables = torch.zeros(rows, 256, dtype=torch.int32)
        lens = torch.full((rows,), 600, dtype=torch.int32)
        cu = torch.arange(rows + 1, dtype=torch.int32)
        workspace = torch.zeros(mla_attention.mla_decode_workspace_numel(rows, heads, lat, 256 * 16))
        p_cu, p_lens, p_tables = cu[decode_rows:], lens[decode_rows:], tables[decode_rows:]
        d_lat, d_pe = q_lat[:decode_rows], q_pe[:decode_rows]
        d_lens, d_tables = lens[:decode_rows], tables[:decode_rows]
        p_lat, p_pe = q_lat[decode_rows:], q_pe[decode_rows:]
        res = {}
        for mode in ("planned_every_call", "replayed"):
            prefill_plans, decode_plans = ({}, {}) if mode == "replayed" else (None, None)
            prefill_us = _per_call_us(lambda plans=prefill_plans: mla_attention.mla_prefill_attention_triton(
                p_lat, p_pe, cache, p_cu, p_lens, p_tables, prompt, 0.1, plans=plans), calls)
            decode_us = _per_call_us(lambda plans=decode_plans: mla_attention.mla_decode_attention_triton(
                d_lat, d_pe, cache, d_tables, d_lens, 0.1, workspace=workspace, plans=plans), calls)
            if mode == "replayed":
                assert len(prefill_plans) == 1 and len(decode_plans) == 1, (prefill_plans, decode_plans)
            res[mode] = {"prefill_wrapper_us": round(prefill_us, 1), "decode_wrapper_us": round(decode_us, 1),
                         "mixed_step_ms_at_27_layers": round(27 * (prefill_us + decode_us) / 1e3, 2)}
    finally:
        mla_attention._mla_prefill_kernel, mla_attention._mla_decode_kernel = saved
    return res


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    res = measure(args.calls)
    print(json.dumps(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
