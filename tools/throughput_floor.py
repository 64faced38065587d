"""The byte / FLOP floor of an offline throughput protocol, step by step, from a model's config.json.

    python -m tools.throughput_floor --config benchmarks/configs/deepseek-v2-lite.json [--protocol nano-vllm]

Why: the throughput targets are judged against a floor, and a floor written once by hand for one family
(dense: every decode step reads every weight) is wrong for another (MoE: a step reads only the experts its
rows picked; MLA: the cache holds a latent, not K and V). This walks the protocol's own requests
(metainfer.bench.throughput.make_requests, the same seed) through an idealised scheduler and prices each
step from the config alone (no model is built):

- a prefill step packs up to --max-batched-tokens prompt tokens and costs max(bytes, FLOPs): it reads every
  weight its tokens touch (at thousands of tokens, every expert) and computes 2 x active params a token plus
  causal attention;
- a decode step of r rows costs max(weight bytes touched, 2 x active params x r FLOPs) plus its rows' cache
  bytes (the kernels run one after another: `serial`), or max(all bytes, all FLOPs) if attention and GEMMs
  overlapped perfectly (`overlapped`: an ideal that no schedule reaches, since a row's attention waits on its
  qkv GEMM and its MLP on its attention), or the same with the rows in two micro-batches whose attention runs
  beside the other's GEMMs (`microbatched`: the overlap a schedule can reach; each half's GEMMs read the
  weights its rows touch, so the weights are read twice);
- a MoE layer at r rows reads E x (1 - (1 - k / E)^r) routed experts in expectation (uniform routing), plus
  the shared experts.

Rates: --bw-tbs (the copy rate; the suite measures it per run) and --tflops (cuBLAS bf16; 790 on the H200).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

PROTOCOLS = {  # num_seqs, input range, output range, max_num_seqs
    "nano-vllm": (256, (100, 1024), (100, 1024), 256),
    "1000x1000": (1000, (1000, 1000), (1000, 1000), 512),
}


@dataclass(frozen=True)
class Costs:
    """A model's per-step quantities: parameters (elements) and cache bytes, from its config."""
    dense_params: int          # read by every step: attention, dense MLPs, shared experts, routers, LM head
    expert_params: int         # one routed expert
    moe_layers: int
    num_experts: int
    top_k: int
    active_params: int         # computed per token: dense + (top_k + shared) experts in every MoE layer
    kv_bytes_per_token: float  # all layers
    attn_flops_per_pair: int   # one query against one cached token, all layers (QK and PV)


def _dense_attention(c: dict) -> tuple[int, int, int]:
    """(params, kv elements a token, attention FLOPs a (query, key) pair) of one GQA layer."""
    h, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads", nh)
    hd = c.get("head_dim") or h // nh
    return h * hd * (nh + 2 * nkv) + nh * hd * h, 2 * nkv * hd, 2 * 2 * nh * hd


def _mla_attention(c: dict) -> tuple[int, int, int]:
    """The same for DeepSeek-V2's MLA (absorbed decode: scores over L + rope, values over L)."""
    h, nh = c["hidden_size"], c["num_attention_heads"]
    nope, rope, v, lora = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    q_lora = c.get("q_lora_rank")
    q = h * nh * (nope + rope) if not q_lora else h * q_lora + q_lora * nh * (nope + rope)
    params = q + h * (lora + rope) + lora * nh * (nope + v) + nh * v * h
    return params, lora + rope, 2 * nh * (lora + rope + lora)


def model_costs(c: dict, kv_elem_bytes: float = 2.0) -> Costs:
    arch = c["architectures"][0]
    h, layers = c["hidden_size"], c["num_hidden_layers"]
    attn, kv_elems, attn_flops = (_mla_attention if arch == "DeepseekV2ForCausalLM" else _dense_attention)(c)
    mlp = 3 * h * c["intermediate_size"]
    lm_head = c["vocab_size"] * h
    if arch == "DeepseekV2ForCausalLM":
        moe_ids = [i for i in range(layers) if i >= c["first_k_dense_replace"] and i % c["moe_layer_freq"] == 0]
        num_experts, top_k, shared = c["n_routed_experts"], c["num_experts_per_tok"], c.get("n_shared_experts") or 0
    elif arch == "Qwen3MoeForCausalLM":
        only = set(c.get("mlp_only_layers") or [])
        step = c.get("decoder_sparse_step", 1)
        moe_ids = [i for i in range(layers) if i not in only and (i + 1) % step == 0]
        num_experts, top_k, shared = c["num_experts"], c["num_experts_per_tok"], 0
    else:
        moe_ids, num_experts, top_k, shared = [], 0, 0, 0
    expert = 3 * h * c["moe_intermediate_size"] if moe_ids else 0
    n_moe = len(moe_ids)
    dense = layers * attn + (layers - n_moe) * mlp + n_moe * (shared * expert + h * num_experts) + lm_head
    return Costs(dense_params=dense, expert_params=expert, moe_layers=n_moe, num_experts=num_experts, top_k=top_k,
                 active_params=dense + n_moe * top_k * expert, kv_bytes_per_token=layers * kv_elems * kv_elem_bytes,
                 attn_flops_per_pair=layers * attn_flops)


def weight_bytes(costs: Costs, rows: int, elem: int = 2) -> float:
    """Weights a step of `rows` tokens reads: the dense part and the routed experts its rows pick."""
    if not costs.moe_layers:
        return costs.dense_params * elem
    touched = costs.num_experts * (1.0 - (1.0 - costs.top_k / costs.num_experts) ** rows)
    return (costs.dense_params + costs.moe_layers * touched * costs.expert_params) * elem


def simulate(costs: Costs, inputs: list[int], outputs: list[int], max_num_seqs: int, max_batched_tokens: int,
             bw: float, flops: float) -> dict:
    """Prefill first (packed steps, a prompt may be chunked), then decode the running rows; admit waiting
    prompts whenever rows free up. Returns seconds by phase, serial and overlapped."""
    waiting = list(zip(inputs, outputs))
    running: list[list[int]] = []  # [context, tokens left to generate]
    pending_chunk = 0               # tokens of the prompt at waiting[0] already prefilled
    t = {"prefill": 0.0, "decode_serial": 0.0, "decode_overlapped": 0.0, "decode_microbatched": 0.0,
         "decode_steps": 0, "prefill_steps": 0}
    while waiting or running:
        if waiting and len(running) < max_num_seqs:
            budget, step_tokens, step_attn = max_batched_tokens, 0, 0.0
            while waiting and budget and len(running) < max_num_seqs:
                prompt, out = waiting[0]
                take = min(budget, prompt - pending_chunk)
                start = pending_chunk
                step_attn += take * (start + (take + 1) / 2)  # causal pairs of the chunk
                step_tokens += take
                budget -= take
                pending_chunk += take
                if pending_chunk == prompt:
                    waiting.pop(0)
                    pending_chunk = 0
                    if out > 1:  # the prefill's last logits give the first output token
                        running.append([prompt + 1, out - 1])
            fl = 2 * costs.active_params * step_tokens + costs.attn_flops_per_pair * step_attn
            t["prefill"] += max(weight_bytes(costs, step_tokens) / bw, fl / flops)
            t["prefill_steps"] += 1
            continue
        rows = len(running)
        ctx = sum(seq[0] for seq in running)
        w, kv = weight_bytes(costs, rows), ctx * costs.kv_bytes_per_token
        fl = 2 * costs.active_params * rows + costs.attn_flops_per_pair * ctx
        t["decode_overlapped"] += max((w + kv) / bw, fl / flops)
        serial = max(w / bw, 2 * costs.active_params * rows / flops) + kv / bw
        t["decode_serial"] += serial
        if rows == 1:  # one row cannot be split
            t["decode_microbatched"] += serial
        else:  # or one batch, where that is cheaper
            halves = weight_bytes(costs, (rows + 1) // 2) + weight_bytes(costs, rows // 2)
            t["decode_microbatched"] += min(max((halves + kv) / bw, fl / flops), serial)
        t["decode_steps"] += 1
        for seq in running:
            seq[0] += 1
            seq[1] -= 1
        running = [seq for seq in running if seq[1] > 0]
    return t


def floor(config: dict, protocol: str, kv_elem_bytes: float, bw: float, flops: float, max_batched_tokens: int,
          max_num_seqs: int | None = None) -> dict:
    from metainfer.bench.throughput import make_requests

    num_seqs, (min_in, max_in), (min_out, max_out), default_seqs = PROTOCOLS[protocol]
    prompts, params = make_requests(num_seqs, min_in, max_in, min_out, max_out, vocab=config["vocab_size"])
    inputs = [len(p["prompt_token_ids"]) for p in prompts]
    outputs = [sp.max_tokens for sp in params]
    costs = model_costs(config, kv_elem_bytes)
    t = simulate(costs, inputs, outputs, max_num_seqs or default_seqs, max_batched_tokens, bw, flops)
    out_tokens = sum(outputs)
    return {"protocol": protocol, "architecture": config["architectures"][0], "output_tokens": out_tokens,
            "input_tokens": sum(inputs), "kv_elem_bytes": kv_elem_bytes, "bw_tbs": bw / 1e12, "tflops": flops / 1e12,
            "active_params_b": costs.active_params / 1e9,
            "params_b": (costs.dense_params + costs.moe_layers * costs.num_experts * costs.expert_params) / 1e9,
            "kv_bytes_per_token": costs.kv_bytes_per_token, **{k: round(v, 3) for k, v in t.items()},
            "output_tok_s_serial": out_tokens / (t["prefill"] + t["decode_serial"]),
            "output_tok_s_overlapped": out_tokens / (t["prefill"] + t["decode_overlapped"]),
            "output_tok_s_microbatched": out_tokens / (t["prefill"] + t["decode_microbatched"])}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.throughput_floor", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="a model's config.json")
    p.add_argument("--protocol", choices=sorted(PROTOCOLS), default="nano-vllm")
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--bw-tbs", type=float, default=4.3, help="copy rate, TB/s (default 4.3: the H200's measured)")
    p.add_argument("--tflops", type=float, default=790.0, help="bf16 GEMM rate, TFLOP/s (default 790: the H200's)")
    p.add_argument("--max-batched-tokens", type=int, default=8192, help="prefill tokens a step (default 8192)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="running rows (default: the protocol's)")
    args = p.parse_args(argv)
    with open(args.config) as f:
        config = json.load(f)
    record = floor(config, args.protocol, 1.0 if args.kv_cache_dtype == "fp8" else 2.0, args.bw_tbs * 1e12,
                   args.tflops * 1e12, args.max_batched_tokens, args.max_num_seqs)
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
