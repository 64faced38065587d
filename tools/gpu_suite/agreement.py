"""Agreement with HF transformers at the real dims (Qwen3-8B, random weights shared by both sides)."""

from __future__ import annotations

import torch

from tools.gpu_suite.common import model_dir, release, show


def agreement(args, results) -> dict:
    """Teacher-forced vs HF bf16, with HF fp32 as the yardstick, for both engine paths: decode (prefill
    of the prompt, then one decode step per position, CUDA graphs included) and prefill (all tokens in
    one paged prefill); then the fp8 KV cache against HF bf16 and against HF over fp8-rounded K/V."""
    import transformers

    from metainfer import LLM
    from tools.agreement import (
        compare,
        copy_hf_weights,
        hf_logits,
        hf_to_dtype,
        teacher_forced_logits,
        teacher_forced_prefill_logits,
        use_fp8_kv_attention,
    )

    folder = model_dir(args)
    config = transformers.AutoConfig.from_pretrained(folder)
    torch.manual_seed(0)
    with torch.device("cuda"):  # fp32 at 8B: 32.8 GB
        hf32 = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompt_len, n = 32, 256
    tokens = torch.randint(0, 10000, (prompt_len + n,), generator=torch.Generator().manual_seed(0))
    ref32 = hf_logits(hf32, tokens, prompt_len, n)
    hf16 = hf_to_dtype(hf32, torch.bfloat16)  # in place: the same weights rounded once; inv_freq stays fp32
    del hf32
    ref16 = hf_logits(hf16, tokens, prompt_len, n)

    def engine(hf, **kw):
        # KV sized explicitly: 288 tokens need 18 blocks, and a memory-profiled budget would count
        # HF's model (still resident) against gpu_memory_utilization
        llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=8,
                  num_kv_blocks=64, **kw)
        copy_hf_weights(llm, hf)
        release()
        return llm

    llm = engine(hf16)
    ours = {"decode": teacher_forced_logits(llm, tokens, prompt_len, n),
            "prefill": teacher_forced_prefill_logits(llm, tokens, prompt_len, n)}
    del llm
    release()
    result = {"positions": n, "prompt_len": prompt_len, "hf_bf16_vs_hf_fp32": compare(ref16, ref32)}
    for path, logits in ours.items():
        result[path] = {"ours_bf16_vs_hf_bf16": compare(logits, ref16), "ours_bf16_vs_hf_fp32": compare(logits, ref32)}
    result["ours_decode_vs_ours_prefill"] = compare(ours["decode"], ours["prefill"])
    llm = engine(hf16, kv_cache_dtype="fp8")  # the same weights over an fp8 KV cache: what the rounded K/V cost
    fp8 = teacher_forced_logits(llm, tokens, prompt_len, n)
    del llm
    use_fp8_kv_attention(hf16)  # HF bf16 with its attention over fp8-rounded K/V: the fp8 cache's oracle
    ref16_fp8 = hf_logits(hf16, tokens, prompt_len, n)
    del hf16
    release()
    result["decode_kv_fp8"] = {"ours_vs_hf_bf16": compare(fp8, ref16), "ours_vs_hf_fp32": compare(fp8, ref32),
                               "ours_vs_ours_bf16_cache": compare(fp8, ours["decode"]),
                               "ours_vs_hf_bf16_fp8_kv": compare(fp8, ref16_fp8),
                               "hf_bf16_fp8_kv_vs_hf_bf16": compare(ref16_fp8, ref16)}
    # the table's headline: the decode path vs HF bf16
    result["top1_agreement"] = result["decode"]["ours_bf16_vs_hf_bf16"]["top1"]
    result["cosine_mean"] = result["decode"]["ours_bf16_vs_hf_bf16"]["cos_mean"]
    show("agreement", result)
    return result
