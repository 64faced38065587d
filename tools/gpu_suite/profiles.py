"""Where a step's time goes: torch.profiler device time per kernel kind against wall time (decode at batch 1
and 256, and the mixed steps of issue 23's ITL tail)."""

from __future__ import annotations

import functools
import os
import time

import torch

from tools.gpu_suite.common import bench_llm, release, show

KINDS = (("gemm", ("gemm", "gemv", "splitk", "cutlass", "sm90", "nvjet", "cublas")),
         ("attention", ("decode", "prefill", "attn", "attention")),
         ("norm/rotary/act", ("rms", "rotary", "silu", "norm", "qk_norm")),
         ("memcpy", ("memcpy",)))


def _device_ms(evt) -> float:
    return (getattr(evt, "device_time_total", 0) or getattr(evt, "cuda_time_total", 0) or 0) / 1e3


def kernel_buckets(prof, per: int) -> dict[str, float]:
    """Device ms per `per` (steps or tokens) by kernel kind (KINDS, else "other")."""
    buckets: dict[str, float] = {}
    for evt in prof.key_averages():
        t = _device_ms(evt)
        if t <= 0 or evt.key.startswith("cuda") or evt.key.startswith("aten::"):
            continue
        k = evt.key.lower()
        kind = next((name for name, words in KINDS if any(w in k for w in words)), "other")
        buckets[kind] = buckets.get(kind, 0) + t / per
    return buckets


def top_kernels(prof, per: int, n: int) -> list:
    rows = [(e.key[:60], _device_ms(e) / per) for e in prof.key_averages() if not e.key.startswith("aten::")]
    return sorted(rows, key=lambda kv: -kv[1])[:n]


def kernel_timeline(prof, first: int = 80) -> list:
    """The profiled window's first `first` device events in start order as (name[:60], us): under CUDA graphs a
    cuBLAS kernel carries no shape, so its place in a step's sequence (after the attention, before the
    o_proj's norm, ...) is what says which projection it runs."""
    from torch.autograd import DeviceType

    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.is_user_annotation),
                    key=lambda e: e.time_range.start)
    return [(e.name[:60], round(e.time_range.elapsed_us(), 2)) for e in events[:first]]


def _profiled(engine, steps: int):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return prof


def _wall_ms_per_step(engine, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def profile(args, results) -> dict:
    """Batch-1 decode steps (graph, graph without PDL, eager): wall ms a token, device ms by kernel kind,
    launches a token. Under PDL the profiler books a kernel's early-launch wait as its own time, so only
    the PDL-off graph profile decomposes into kernels + gaps."""
    from metainfer import SamplingParams

    out, steps = {}, 32
    for name, kw in {"graph": {}, "graph_no_pdl": {"enable_pdl": False}, "eager": {"enforce_eager": True}}.items():
        llm = bench_llm(args, max_num_seqs=8, **kw)
        engine = llm.llm_engine
        engine.add_request("warm", {"prompt_token_ids": list(range(100, 132))},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), stream=False)
        _drain(engine)
        engine.add_request("p", {"prompt_token_ids": list(range(200, 232))},
                           SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True), stream=False)
        for _ in range(4):  # prefill and the first decode steps stay out of the window
            engine.step()
        wall_ms = _wall_ms_per_step(engine, steps)
        prof = _profiled(engine, steps)
        buckets = kernel_buckets(prof, per=steps)
        every = sorted(((e.key[:60], e.count / steps, round(_device_ms(e) / steps, 4))
                        for e in prof.key_averages() if not e.key.startswith("aten::")), key=lambda r: -r[2])
        device_ms = sum(buckets.values())
        out[name] = {"decode_steps": steps, "wall_ms_per_token": wall_ms, "device_ms_per_token": device_ms,
                     "gaps_ms_per_token": wall_ms - device_ms, "device_ms_per_token_by_kind": buckets,
                     "top_kernels_ms_per_token": top_kernels(prof, steps, 12),
                     "launches_per_token": sum(r[1] for r in every), "kernels_per_token": every}
        show(name, out[name])
        _drain(engine)
        del llm, engine
        release()
    return out


def profile_batch(args, results) -> dict:
    """A step of 256 running sequences (context ~600), what the throughput bench runs most of the time:
    the prefill (18 steps of 8,192 tokens; two profiled) and decode, wall ms a step against device ms
    by kernel kind and the top kernels. `--config` picks the model (a MoE family's config profiles its step)."""
    from metainfer import SamplingParams

    llm = bench_llm(args)
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.6, max_tokens=64, ignore_eos=True)
    for i in range(256):
        engine.add_request(f"p{i}", {"prompt_token_ids": torch.randint(0, 10000, (576,), generator=g).tolist()},
                           params, stream=False)

    def prefilling(sched):
        return bool(sched.waiting) or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running)

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(2):
        engine.step()
    prof, steps = _profiled(engine, 2), 4
    while prefilling(engine.scheduler):
        engine.step()
        steps += 1
    torch.cuda.synchronize()
    prefill = {"steps": steps, "tokens": 256 * 576,
               "wall_ms_per_step_incl_profiled": (time.perf_counter() - start) / steps * 1e3,
               "device_ms_per_step_by_kind": kernel_buckets(prof, per=2),
               "top_kernels_ms_per_step": top_kernels(prof, 2, 10)}
    prefill["device_ms_per_step"] = sum(prefill["device_ms_per_step_by_kind"].values())
    show("prefill", prefill)
    for _ in range(4):
        engine.step()
    wall_ms = _wall_ms_per_step(engine, 16)
    prof = _profiled(engine, 8)
    buckets = kernel_buckets(prof, per=8)
    _drain(engine)
    res = {"prefill": prefill, "running": 256, "context": "576 + 4..36", "wall_ms_per_step": wall_ms,
           "device_ms_per_step_by_kind": buckets, "device_ms_per_step": sum(buckets.values()),
           "top_kernels_ms_per_step": top_kernels(prof, 8, 12), "first_kernels_us": kernel_timeline(prof)}
    show("profile_batch", {k: v for k, v in res.items() if k != "first_kernels_us"})
    del llm, engine
    release()
    return res


def _host_functions(run, per: int, top: int = 20) -> list:
    """cProfile over `run()`: the functions with the most cumulative wall ms per step, as (file:line(name), ms).
    Time blocked on the GPU (the read-back of the step before, under async scheduling) shows as the read-back's;
    the rest is the host's own work a step, by function."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(run)
    stats = pstats.Stats(profiler)
    rows = [(f"{os.path.basename(f)}:{line}({fn})", ct * 1e3 / per)
            for (f, line, fn), (_, _, _, ct, _) in stats.stats.items()]
    return sorted(rows, key=lambda r: -r[1])[:top]


def profile_mixed(args, results) -> dict:
    """Issue 23's ITL tail: steps of 64 running decodes (context ~512-640) with one new prompt of P tokens
    beside them (P = 128, 256, 512; max_tokens 1, so the running set stays at 64), against pure decode steps of the
    same batch. Per case: wall ms a step as served (async scheduling), serial ms a step (synchronised after
    each step: host + GPU without overlap), the host's enqueue ms of the forward (the runner's compute_logits
    call: no sync inside), device ms by kernel kind and launches a step. Wall near the host's enqueue time and
    well above the device time says the step is host-bound."""
    import statistics

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from metainfer import SamplingParams

    llm = bench_llm(args, max_num_seqs=128)
    engine = llm.llm_engine
    runner = engine.runner
    forward, enqueue = runner.compute_logits, []

    def timed_forward(batch):
        start = time.perf_counter()
        out = forward(batch)
        enqueue.append((batch.is_mixed, (time.perf_counter() - start) * 1e3))
        return out

    runner.compute_logits = timed_forward
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": torch.randint(10, 10000, (n,), generator=g).tolist()}

    running = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(64):
        engine.add_request(f"r{i}", prompt(512), running, stream=False)
    for _ in range(12):  # the 64 prompts' prefill (one 8,192-token budget step, a chunk) and a few decodes
        engine.step()
    arrivals = iter(range(10**6))

    def steps(prompt_len: int, n: int, sync: bool = False) -> None:
        for _ in range(n):
            if prompt_len:
                engine.add_request(f"m{next(arrivals)}", prompt(prompt_len), one, stream=False)
            engine.step()
            if sync:
                torch.cuda.synchronize()

    res = {"running": 64, "prompt_len_running": 512}
    for name, prompt_len in (("decode", 0), ("mixed_128", 128), ("mixed_256", 256), ("mixed_512", 512)):
        n = 12
        steps(prompt_len, 4)  # settle
        enqueue.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        steps(prompt_len, n)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / n * 1e3
        host = [ms for mixed, ms in enqueue if mixed == bool(prompt_len)]
        kinds_seen = f"{len(host)} of {len(enqueue)}"
        start = time.perf_counter()
        steps(prompt_len, n, sync=True)
        serial = (time.perf_counter() - start) / n * 1e3
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            steps(prompt_len, n)
            torch.cuda.synchronize()
        buckets = kernel_buckets(prof, per=n)
        host_functions = _host_functions(functools.partial(steps, prompt_len, n), n)
        res[name] = {"wall_ms_per_step": wall, "serial_ms_per_step": serial,
                     "host_enqueue_ms_median": statistics.median(host) if host else None,
                     "steps_of_this_kind": kinds_seen,
                     "device_ms_per_step": sum(buckets.values()), "device_ms_per_step_by_kind": buckets,
                     "launches_per_step": sum(e.count for e in prof.key_averages()
                                              if not e.key.startswith(("aten::", "cuda"))) / n,
                     "top_kernels_ms_per_step": top_kernels(prof, n, 12),
                     "host_ms_per_step_by_function": host_functions}
        show(f"profile_mixed {name}", {k: v for k, v in res[name].items() if not k.startswith(("top", "host_ms"))})
    # the direct relaunch of a planned attention kernel's compiled kernel (session 28, kernels/_triton.PlannedLaunch)
    # against every launch through Triton's JITFunction: the 256-token mixed step's enqueue and wall, then direct again
    from metainfer.kernels._triton import PlannedLaunch

    direct_launcher = PlannedLaunch._direct_launcher
    try:
        for name, through_jit in (("mixed_256_jit_launch", True), ("mixed_256_direct_again", False)):
            if through_jit:
                PlannedLaunch._direct_launcher = lambda self, compiled, tensors: False
            else:
                PlannedLaunch._direct_launcher = direct_launcher
            steps(256, 4)
            enqueue.clear()
            torch.cuda.synchronize()
            start = time.perf_counter()
            steps(256, 12)
            torch.cuda.synchronize()
            host = [ms for mixed, ms in enqueue if mixed]
            res[name] = {"wall_ms_per_step": (time.perf_counter() - start) / 12 * 1e3,
                         "host_enqueue_ms_median": statistics.median(host) if host else None}
            show(f"profile_mixed {name}", res[name])
    finally:
        PlannedLaunch._direct_launcher = direct_launcher
    runner.compute_logits = forward
    # the closures hold the engine and `forward` (the runner's bound method) its runner, whose KV pool is most of the
    # GPU: drop them before releasing its memory (runs 69 and 99: the section after this one found no memory left)
    llm = engine = runner = forward = None
    release()
    return res
