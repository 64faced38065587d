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
