"""Throwaway probe: cuBLAS vs a plain Triton GEMM (optionally split-K) at 64-512 rows, Qwen3-8B decode shapes.

Question: are the 256-512-row decode GEMMs (77% of 790 TFLOP/s as a set, run 65) losing to wave quantization on
particular shapes (o_proj / down / qkv: few output tiles), and does a Triton tile choice beat cuBLAS there?
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _mm(x_ptr, w_ptr, y_ptr, M, N, K, SPLIT_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group_size = GROUP * num_m
    gid = pid // group_size
    first_n = gid * GROUP
    gn = min(num_n - first_n, GROUP)
    pid_n = first_n + (pid % group_size) % gn
    pid_m = (pid % group_size) // gn
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    k_per = K // SPLIT_K
    rk = tl.arange(0, BK)
    xp = x_ptr + rm[:, None] * K + (pid_k * k_per + rk)[None, :]
    wp = w_ptr + rn[None, :] * K + (pid_k * k_per + rk)[:, None]
    acc = tl.zeros((BM, BN), tl.float32)
    for _ in range(0, k_per, BK):
        a = tl.load(xp, mask=rm[:, None] < M, other=0.0)
        b = tl.load(wp)
        acc = tl.dot(a, b, acc)
        xp += BK
        wp += BK
    yp = y_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=rm[:, None] < M)


def triton_mm(x, w, cfg, ws):
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk, warps, stages, split = cfg
    out = ws if split > 1 else torch.empty(M, N, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), split)
    _mm[grid](x, w, out, M, N, K, SPLIT_K=split, BM=bm, BN=bn, BK=bk, GROUP=8, num_warps=warps, num_stages=stages)
    if split > 1:
        return out[:split].sum(0).to(x.dtype)
    return out


def time_graph(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) / reps * 1000)
    return best


SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ROWS = [64, 128, 256, 384, 512]
CFGS = [(bm, bn, 64, w, s, sk) for bm in (64, 128) for bn in (64, 128, 256) for w in (4, 8) for s in (3, 4)
        for sk in (1, 2, 4) if not (bm == 128 and bn == 256 and w == 4)]


def main():
    torch.manual_seed(0)
    res = {"gpu": torch.cuda.get_device_name(), "shapes": {}}
    copies = 4
    for name, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
        for M in ROWS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            flop = 2 * M * N * K
            t_cublas = time_graph(lambda i: torch.mm(x, ws[i % copies].t()))
            ref = torch.mm(x.float(), ws[0].float().t())
            best = (float("inf"), None)
            work = torch.empty(4, M, N, device="cuda", dtype=torch.float32)
            for cfg in CFGS:
                if cfg[0] > M and cfg[0] != 64:
                    continue
                if (K // cfg[5]) % cfg[2]:
                    continue
                try:
                    y = triton_mm(x, ws[0], cfg, work)
                    err = (y.float() - ref).abs().max().item()
                    if err > 0.05 * ref.abs().max().item():
                        print("bad", name, M, cfg, err, flush=True)
                        continue
                    t = time_graph(lambda i, c=cfg: triton_mm(x, ws[i % copies], c, work))
                except Exception as exc:  # out of resources etc.
                    print("skip", cfg, type(exc).__name__, flush=True)
                    continue
                if t < best[0]:
                    best = (t, cfg)
            row = {"cublas_us": round(t_cublas, 2), "cublas_tflops": round(flop / t_cublas / 1e6, 1),
                   "triton_us": round(best[0], 2), "triton_cfg": best[1],
                   "triton_tflops": round(flop / best[0] / 1e6, 1),
                   "bytes_us_at_3tbs": round((N * K * 2 + M * (N + K) * 2) / 3.0e6, 2)}
            res["shapes"][f"{name}/m{M}"] = row
            print(f"{name:8s} M={M:4d} cublas {t_cublas:8.2f} us {row['cublas_tflops']:6.1f} TF | triton "
                  f"{best[0]:8.2f} us {row['triton_tflops']:6.1f} TF {best[1]}", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "gemm_rows_probe.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
