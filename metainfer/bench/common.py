"""Shared benchmark helpers: environment record, measured copy bandwidth, weight bytes, JSON."""

from __future__ import annotations

import json
import os
import platform
import time

import torch


def environment() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    else:
        info["gpu"] = None
        info["cpu"] = platform.processor() or platform.machine()
        info["cpu_threads"] = torch.get_num_threads()
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, gib: float = 2.0, iters: int = 10) -> float:
    """Device-to-device copy, bytes read + written per second (the practical HBM ceiling)."""
    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    elapsed = (time.perf_counter() - start) / iters
    del src, dst
    return 2 * n * 4 / elapsed


def gemm_flops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """bf16 n x n x n matmul on random data, FLOP/s (cuBLAS's practical ceiling: the compute side of the floors,
    as copy_bandwidth is the bytes side; tools/throughput_floor --tflops)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    elapsed = (time.perf_counter() - start) / iters
    del a, b
    return 2 * n**3 / elapsed


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step must read: every parameter except the embedding table
    (one row is read), counting a tied LM head once; of stacked MoE experts only the routed share
    (their `active_fraction`: top_k / E, layers/moe.py)."""
    seen, total = set(), 0
    embed = getattr(getattr(model, "model", model), "embed_tokens", None)
    embed_ptr = embed.weight.data_ptr() if embed is not None else None
    tied = embed is not None and model.lm_head.weight.data_ptr() == embed_ptr
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if p.data_ptr() == embed_ptr and not tied:
            continue
        total += int(p.numel() * p.element_size() * getattr(p, "active_fraction", 1.0))
    return total


def add_skip_tokenizer_arg(p) -> None:
    """--skip-tokenizer-init for the benches whose prompts are random token ids (latency, throughput)."""
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="build no tokenizer: a config-only model folder (--load-format dummy) needs no --tokenizer")


def add_batch_shape_args(p) -> None:
    """--batch-size, --input-len, --output-len: the one batch shape that `bench latency` and `bench baseline`
    both time (the same defaults, so the two records compare)."""
    from metainfer.entrypoints.cli import int_at_least

    p.add_argument("--batch-size", type=int_at_least(1), default=1, help="prompts per batch (default 1)")
    p.add_argument("--input-len", type=int_at_least(1), default=32, help="prompt tokens (default 32)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens, >= 2 (default 128)")


def write_json(path: str | None, record: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": t.mean().item(), "median": t.median().item(), "p99": t.quantile(0.99).item()}


def run_on_engine(name: str, args, engine_kwargs, measure) -> dict:
    """Start an engine from CLI args (timing the start), run `measure(llm) -> record`, close it,
    and add what every benchmark record carries."""
    from metainfer import LLM
    from metainfer.worker.tp.launched import follow_rank0

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args))
    startup = time.perf_counter() - start
    if follow_rank0(llm):  # under torchrun rank 0 measures and reports; the others replay its steps, then exit
        raise SystemExit(0)
    try:
        record = measure(llm)
    finally:
        llm.close()
    record.update({"bench": name, "model": args.model, "device": llm.llm_engine.config.device,
                   "startup_s": startup, "tp": args.tp,
                   "enforce_eager": args.enforce_eager, "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto"),
                   "env": environment()})
    return record
