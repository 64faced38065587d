"""HF transformers at the same shapes: eager, and static cache + torch.compile.

Weights are random at the real dims (from config.json), like our dummy format; for a
GGUF model the real weights are loaded. TTFT and TPOT are measured as in bench/latency.py:
TTFT = generate(max_new_tokens=1); TPOT = (last token's time - first token's time) / (output_len - 1)
inside each full generate, from a streamer that stamps every token generate hands it (generate reads each
step's tokens back to the host before it calls the streamer). `tpot_e2e_ms` keeps the older (median full
generate - median TTFT) / (output_len - 1), which a stall in either call skews (it went negative once
under load on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from metainfer.bench.common import add_batch_shape_args, environment, sync, write_json
from metainfer.entrypoints.cli import int_at_least

MODES = ("eager", "compile")


def load_hf_model(model: str, dtype: torch.dtype, device: torch.device, dummy: bool):
    import transformers

    if model.endswith(".gguf"):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model), gguf_file=os.path.basename(model), dtype=dtype).to(device).eval()
    if dummy:
        config = transformers.AutoConfig.from_pretrained(model)
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device).eval()


class _TokenTimes:
    """A generate streamer that records when each new token reaches it (the prompt's put comes first
    and is skipped)."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


@torch.inference_mode()
def time_hf(hf_model, batch_size: int, input_len: int, output_len: int, iters: int = 3, mode: str = "eager") -> dict:
    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 (TPOT is measured over tokens after the first), got {output_len}")
    if min(batch_size, input_len, iters) < 1 or mode not in MODES:
        raise ValueError(f"batch_size, input_len and iters must be >= 1 and mode one of {', '.join(MODES)}; got "
                         f"{batch_size}, {input_len}, {iters}, {mode!r}")
    device = next(hf_model.parameters()).device
    vocab = hf_model.config.vocab_size
    ids = torch.randint(0, min(vocab, 10000), (batch_size, input_len), device=device)
    kwargs = {"do_sample": False, "attention_mask": torch.ones_like(ids), "pad_token_id": 0}
    hf_model.generation_config.eos_token_id = None
    if mode == "compile":  # transformers compiles the forward itself when the cache is static
        kwargs["cache_implementation"] = "static"

    def timed(n: int) -> tuple[float, list[float]]:
        stamps = _TokenTimes()
        sync(device)
        start = time.perf_counter()
        out = hf_model.generate(ids, max_new_tokens=n, min_new_tokens=n, streamer=stamps, **kwargs)
        sync(device)
        assert out.shape[1] == input_len + n and len(stamps.times) == n
        return time.perf_counter() - start, stamps.times

    graphs_before = _dynamo_graphs()
    compile_start = time.perf_counter()
    timed(1), timed(output_len)  # warm-up (and compilation)
    warmup = time.perf_counter() - compile_start
    # transformers compiles a static-cache generate on GPUs only (on the CPU "compile" is a static cache alone):
    # whether dynamo built a graph during the warm-up is what the record says, not a guess from the device
    compiled = _dynamo_graphs() > graphs_before
    ttft = statistics.median(timed(1)[0] for _ in range(iters))
    fulls = [timed(output_len) for _ in range(iters)]
    total = statistics.median(t for t, _ in fulls)
    tpot = statistics.median((times[-1] - times[0]) / (output_len - 1) for _, times in fulls)
    tpot_e2e = (total - ttft) / (output_len - 1)
    return {"mode": mode, "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
            "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3, "tpot_e2e_ms": tpot_e2e * 1e3,
            "decode_tok_s": batch_size / tpot,
            "e2e_output_tok_s": batch_size * output_len / total, "warmup_s": warmup, "compiled": compiled}


def _dynamo_graphs() -> int:
    """Graphs torch.compile has built in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def add_parser(sub, add_engine_args) -> None:
    p = sub.add_parser("baseline", help="HF transformers eager / static+compile at the same shapes")
    add_engine_args(p)
    add_batch_shape_args(p)
    p.add_argument("--iters", type=int_at_least(1), default=3, help="timed iterations (default 3)")
    p.add_argument("--modes", type=_modes, default="eager,compile",
                   help="comma-separated: eager, compile (static cache) (default eager,compile)")
    p.add_argument("--output-json", default=None, help="write the record (GPU name, library versions) here")
    p.set_defaults(bench_func=main)


def _modes(text: str) -> list[str]:
    """--modes as a list; an unknown mode is argparse's one-line error naming the option."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or not set(modes) <= set(MODES):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(MODES)}, got {text!r}")
    return modes


def main(args: argparse.Namespace, engine_kwargs) -> dict:
    from metainfer.config import ConfigError, resolve_device, resolve_dtype

    kw = engine_kwargs(args)
    if args.output_len < 2:  # checked before the model loads: TPOT needs two tokens
        raise ConfigError(f"--output-len must be >= 2 (TPOT is timed over the tokens after the first), got "
                          f"{args.output_len}")
    if kw.get("distributed_executor_backend", "mp") != "mp":
        raise ConfigError("--distributed-executor-backend: the HF baseline runs in one process on one device and "
                          "cannot be launched by torchrun; leave the option out")
    if kw.get("step_trace_path"):
        raise ConfigError("--step-trace: the HF baseline runs no MetaInfer engine, so there are no engine steps to "
                          "trace; leave the option out")
    if kw["device"] == "mlx":  # HF transformers runs in torch; mlx-lm is the MLX baseline (tools/bench_mlx.py)
        raise ConfigError("--device mlx: the HF baseline runs HF transformers in torch, not MLX; pass --device cpu "
                          "or cuda")
    if kw["kv_cache_dtype"] != "auto":
        raise ConfigError(f"kv_cache_dtype={kw['kv_cache_dtype']!r}: the HF baseline keeps HF's own KV cache in the "
                         "model dtype; pass auto")
    device = resolve_device(kw["device"])
    dtype = resolve_dtype(kw["dtype"], "bfloat16", device)
    results = []
    for mode in _modes(args.modes) if isinstance(args.modes, str) else args.modes:
        hf = load_hf_model(kw["model"], dtype, device, dummy=kw["load_format"] == "dummy")
        try:
            results.append(time_hf(hf, args.batch_size, args.input_len, args.output_len, args.iters, mode))
        finally:
            del hf
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r = results[-1]
        uncompiled = mode == "compile" and not r["compiled"]
        label = "static cache, not compiled (transformers compiles on GPUs)" if uncompiled else mode
        print(f"HF {label}: TTFT {r['ttft_ms']:.2f} ms  TPOT {r['tpot_ms']:.3f} ms  {r['decode_tok_s']:.1f} tok/s"
              f"  (warm-up {r['warmup_s']:.1f} s)", flush=True)
    record = {"bench": "baseline", "model": kw["model"], "results": results, "env": environment()}
    write_json(args.output_json, record)
    return record
