"""Where a batch-1 MLX decode step's time goes, end to end through LLMEngine.step (the tiny Qwen3 of
tools/bench_mlx.py unless --model names a folder): per step, the scheduler, the input packing, the call of the
compiled decode function (tracing / dispatch of the graph), the wait in `mx.eval` (the MLX CPU stream's worker
thread running the kernels), the rest of the runner (sampled ids to torch), the read-back (detokenizer, stop
checks, prefix-cache hashing) and the engine's own remainder; plus how often the stream's worker thread went to
sleep a step (voluntary context switches of the process's other threads: each is a hand-off between the Python
thread and MLX's worker, cheap on an idle core, a scheduling delay on a busy one). Medians over the decode
steps (the prefill step of each run left out).

    python tools/profile_mlx_decode.py --runs 10 --output-json docs/results/mlx_decode_profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _worker_sleeps() -> int:
    """Voluntary context switches of every thread but the main one (MLX's stream worker; Linux /proc)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == os.getpid():
            continue
        with open(f"/proc/self/task/{tid}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
    return total


class PhaseTimer:
    """Wraps methods of live objects; each engine step's per-method wall time becomes one row of `steps`."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []

    def wrap(self, obj, name: str, key: str, closes_step: bool = False) -> None:
        inner = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[key] += time.perf_counter() - start
                if closes_step:
                    self.steps.append(dict(self.current))
                    self.current.clear()

        setattr(obj, name, timed)


def profile(folder: str, runs: int, new_tokens: int) -> dict:
    from metainfer import LLM, SamplingParams

    llm = LLM(folder, device="mlx", dtype="float32", max_model_len=1024, max_num_seqs=1)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    timer = PhaseTimer()
    for obj, name, key in [(engine.scheduler, "schedule", "schedule"), (engine, "_read_back", "read_back"),
                           (runner, "execute", "runner_execute"), (runner, "_decode", "decode"),
                           (runner, "_decode_inputs", "input_packing"), (runner, "_decode_forward", "compiled_call")]:
        timer.wrap(obj, name, key)
    timer.wrap(engine, "step", "engine_step", closes_step=True)
    vocab = engine.spec.vocab_size
    prompt = [t % vocab for t in engine.tokenizer.encode("The capital of France is")]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)

    def generate() -> float:
        engine.block_manager.hash_to_block.clear()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return (out.metrics["finished_time"] - out.metrics["first_token_time"]) / (new_tokens - 1)

    generate()  # warm-up: traces the compiled shapes
    load_start, per_token, decode_steps, sleeps = os.getloadavg()[0], [], [], 0
    for _ in range(runs):
        timer.steps.clear()
        before = _worker_sleeps()
        per_token.append(generate())
        sleeps += _worker_sleeps() - before
        decode_steps += [s for s in timer.steps if "decode" in s]  # the prefill step left out

    def median_ms(f) -> float:
        return statistics.median(f(s) for s in decode_steps) * 1e3

    phases = {
        "schedule": median_ms(lambda s: s["schedule"]),
        "input_packing": median_ms(lambda s: s["input_packing"]),
        "compiled_call": median_ms(lambda s: s["compiled_call"]),
        "mx_eval_wait": median_ms(lambda s: s["decode"] - s["input_packing"] - s["compiled_call"]),
        "runner_rest": median_ms(lambda s: s["runner_execute"] - s["decode"]),
        "read_back": median_ms(lambda s: s["read_back"]),
        "engine_rest": median_ms(lambda s: s["engine_step"] - s["schedule"] - s["runner_execute"] - s["read_back"]),
    }
    llm.close()
    return {"model": folder, "runs": runs, "new_tokens": new_tokens, "decode_steps": len(decode_steps),
            "ms_per_token_median": statistics.median(per_token) * 1e3,
            "decode_step_ms_median": median_ms(lambda s: s["engine_step"]),
            "phases_ms_median": phases, "worker_sleeps_per_step": sleeps / (runs * new_tokens),
            "load_1min": {"start": load_start, "end": os.getloadavg()[0]}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an HF folder (default: bench_mlx.py's tiny random Qwen3)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    import bench_mlx

    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or bench_mlx.tiny_qwen3_folder(os.path.join(tmp, "tiny-qwen3"), torch.float32)
        record = profile(folder, args.runs, args.new_tokens)
    if args.model is None:
        record["model"] = "tiny-qwen3 (tools/bench_mlx.py)"
    record["command"] = "python tools/profile_mlx_decode.py " + " ".join(sys.argv[1:])
    print(json.dumps(record, indent=1))
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
