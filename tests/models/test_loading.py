"""Weight loading: safetensors (single and sharded), GGUF (real SmolLM2), dummy, and errors. (Reading
config.json: tests/config/test_model_spec.py.)"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import generate_ids, token_ids
from tests.helpers.tiny_models import build_tiny_model, copy_model_files, hf_greedy, make_prompts, smollm2_gguf

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3"))
    model = build_tiny_model(folder, "qwen3")
    return folder, model


def test_sharded_checkpoint(qwen3_dir, tmp_path):
    folder, model = qwen3_dir
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    copy_model_files(folder, str(tmp_path), weights=False)
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    prompts = make_prompts([9, 20])
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    assert generate_ids(llm, prompts, GREEDY) == hf_greedy(model, prompts, 12)


@pytest.mark.parametrize("mutation, message", [
    ("drop", "missing tensor(s) in checkpoint: model.layers.1.self_attn.k_proj.weight"),
    ("extra", "unexpected tensor(s) in checkpoint: model.layers.0.mlp.extra.weight"),
    ("reshape", "tensor 'model.layers.0.mlp.down_proj.weight' has"),
])
def test_bad_checkpoint_names_the_tensor(qwen3_dir, tmp_path, mutation, message):
    folder, _ = qwen3_dir
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    if mutation == "drop":
        del tensors["model.layers.1.self_attn.k_proj.weight"]
    elif mutation == "extra":
        tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    else:
        tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(64, 64)
    copy_model_files(folder, str(tmp_path), weights=False)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path), device="cpu", dtype="float32")
    assert message in str(err.value)


def test_dummy_weights_run(qwen3_dir):
    folder, _ = qwen3_dir
    llm = LLM(folder, device="cpu", dtype="float32", load_format="dummy")
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 12


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers():
    """Real trained weights: our GGUF loader (dequantize + Q/K un-permute) vs transformers'."""
    import transformers

    path = smollm2_gguf()
    folder, name = os.path.dirname(path), os.path.basename(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    ids = [tok.encode(p) for p in prompts]
    expected = hf_greedy(ref, ids, 24)
    llm = LLM(path, device="cpu", dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == ids
    assert token_ids(outs) == expected
    assert "Paris" in outs[0].outputs[0].text


def test_dummy_weights_follow_their_rule(qwen3_dir):
    """load_format="dummy": norm weights exactly 1, every other parameter the seed's uniform(-scale, scale)
    draws in parameter order, regenerated here from the rule (not from fill_dummy_weights)."""
    from metainfer.config import ModelSpec
    from metainfer.kernels import REF_OPS
    from metainfer.loader.dummy import fill_dummy_weights
    from metainfer.models.registry import model_class

    folder, _ = qwen3_dir
    spec = ModelSpec.from_file(os.path.join(folder, "config.json"))
    model = model_class(spec)(spec, REF_OPS, dtype=torch.float32)
    fill_dummy_weights(model, seed=3, scale=0.05)
    gen = torch.Generator().manual_seed(3)
    for name, param in model.named_parameters():
        if "norm" in name:
            assert bool((param == 1.0).all()), name
        else:
            want = torch.empty(param.shape, dtype=param.dtype).uniform_(-0.05, 0.05, generator=gen)
            assert torch.equal(param.detach(), want), name



def _llama_cpp_permute(w, n_head: int):
    """convert_hf_to_gguf.py's permute of a llama Q/K projection (the rotary halves of each head interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_tiny_gguf_metadata_and_tensors_round_trip(tmp_path):
    """A GGUF written here with gguf-py (llama, F32, one layer): gguf_config gives back the metadata written,
    iterate_gguf the HF-named tensors written (Q/K un-permuted to the HF rows). Milliseconds, unlike the
    real SmolLM2 file."""
    import gguf
    import numpy as np

    from metainfer.loader.gguf import gguf_config, iterate_gguf

    rng = np.random.default_rng(0)
    hidden, heads, kv_heads, head_dim, vocab, inter = 8, 2, 1, 4, 11, 16
    hf = {"model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
          "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((heads * head_dim, hidden)),
          "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((kv_heads * head_dim, hidden)),
          "model.layers.0.input_layernorm.weight": rng.standard_normal(hidden),
          "model.norm.weight": rng.standard_normal(hidden)}
    hf = {k: v.astype(np.float32) for k, v in hf.items()}
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(5000.0)
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    writer.add_tensor("blk.0.attn_q.weight", _llama_cpp_permute(hf["model.layers.0.self_attn.q_proj.weight"], heads))
    writer.add_tensor("blk.0.attn_k.weight",
                      _llama_cpp_permute(hf["model.layers.0.self_attn.k_proj.weight"], kv_heads))
    writer.add_tensor("blk.0.attn_norm.weight", hf["model.layers.0.input_layernorm.weight"])
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    cfg = gguf_config(path)
    assert {k: cfg[k] for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                                "rope_theta", "max_position_embeddings", "tie_word_embeddings")} == {
        "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rope_theta": 5000.0, "max_position_embeddings": 64, "tie_word_embeddings": True}
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    got = dict(iterate_gguf(path))
    assert set(got) == set(hf)
    for name, want in hf.items():
        assert torch.equal(got[name], torch.from_numpy(want)), name
