"""MLX weight loading: mlx-lm's own 4- and 8-bit affine-quantized checkpoints (written by mlx-lm's converter)
give mlx-lm's own greedy tokens; a GGUF (the embedded SmolLM2) gives the torch path's tokens; dummy weights
build at the config's dims; missing, unexpected and mis-shaped tensors are named."""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'mlx[cpu]')")
pytest.importorskip("mlx_lm", reason="mlx-lm is not installed")

from safetensors.torch import load_file, save_file  # noqa: E402

from metainfer import LLM, SamplingParams  # noqa: E402
from tests.helpers.engine_checks import generate_ids  # noqa: E402
from tests.helpers.tiny_models import build_tiny_model, copy_model_files, make_prompts, smollm2_gguf  # noqa: E402
from tests.mlx.mlx_lm_ref import add_legacy_rope_keys, mlx_lm_greedy, mlx_lm_quantize  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mlx-load-src"))
    build_tiny_model(folder, "qwen3", tie_word_embeddings=False)
    add_legacy_rope_keys(folder)
    return folder


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_lm_quantized_checkpoint_matches_mlx_lm(tiny, tmp_path, bits):
    dst = str(tmp_path / f"q{bits}")
    mlx_lm_quantize(tiny, dst, bits)
    import mlx.core as mx

    stored = mx.load(os.path.join(dst, "model.safetensors"))
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == mx.uint32  # really quantized
    assert "model.embed_tokens.scales" in stored
    prompts = make_prompts([4, 19, 40], seed=9)
    llm = LLM(dst, device="mlx", num_kv_blocks=64)
    got = generate_ids(llm, prompts, GREEDY)
    assert got == mlx_lm_greedy(dst, prompts, 16)
    # and the quantization is applied, not skipped: the full-precision model answers differently
    assert got != mlx_lm_greedy(tiny, prompts, 16)


@pytest.mark.parametrize("bits", [4, 8])
def test_tied_quantized_embedding_is_the_lm_head(tmp_path, bits):
    """tie_word_embeddings=True: mlx-lm stores one quantized embedding table and uses it as the LM head
    (`as_linear`); ours must read that packed table for both, giving mlx-lm's tokens."""
    src = str(tmp_path / "src")
    build_tiny_model(src, "qwen3", tie_word_embeddings=True)
    dst = str(tmp_path / f"q{bits}")
    mlx_lm_quantize(src, dst, bits)
    import mlx.core as mx

    stored = mx.load(os.path.join(dst, "model.safetensors"))
    assert "lm_head.weight" not in stored and stored["model.embed_tokens.weight"].dtype == mx.uint32
    prompts = make_prompts([4, 19, 40], seed=19)
    got = generate_ids(LLM(dst, device="mlx", num_kv_blocks=64), prompts, GREEDY)
    assert got == mlx_lm_greedy(dst, prompts, 16)
    assert got != mlx_lm_greedy(src, prompts, 16)


def test_per_module_quantization_overrides_match_mlx_lm(tiny, tmp_path):
    """A mixed recipe as mlx-lm writes it: the default 4-bit / group 32, per-module overrides in config.json's
    `quantization` (layer 0's down_proj 8-bit / group 64, the LM head 8-bit, layer 1's o_proj left dense)."""
    import json

    def predicate(path, module, config=None):
        if path == "model.layers.0.mlp.down_proj" or path == "lm_head":
            return {"bits": 8, "group_size": 64}
        if path == "model.layers.1.self_attn.o_proj":
            return False
        return True

    dst = str(tmp_path / "mixed")
    mlx_lm_quantize(tiny, dst, 4, quant_predicate=predicate)
    with open(os.path.join(dst, "config.json")) as f:
        quant = json.load(f)["quantization"]
    assert quant["model.layers.0.mlp.down_proj"] == {"bits": 8, "group_size": 64}
    import mlx.core as mx

    stored = mx.load(os.path.join(dst, "model.safetensors"))
    assert stored["model.layers.1.self_attn.o_proj.weight"].dtype != mx.uint32  # left dense
    assert stored["model.layers.0.mlp.down_proj.weight"].shape[-1] == 128 * 8 // 32  # packed 8-bit
    prompts = make_prompts([4, 19, 40], seed=29)
    got = generate_ids(LLM(dst, device="mlx", num_kv_blocks=64), prompts, GREEDY)
    assert got == mlx_lm_greedy(dst, prompts, 16)


def test_quantized_without_a_quantization_section_is_named(tiny, tmp_path):
    dst = str(tmp_path / "q4")
    mlx_lm_quantize(tiny, dst, 4)
    import json

    cfg_path = os.path.join(dst, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("quantization", None)
    cfg.pop("quantization_config", None)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="no 'quantization' section"):
        LLM(dst, device="mlx", num_kv_blocks=8)


@pytest.mark.slow
def test_gguf_smollm2_matches_the_torch_path():
    gguf = smollm2_gguf()
    prompt = "The capital of France is"
    params = SamplingParams(temperature=0.0, max_tokens=12)
    mlx_out = LLM(gguf, device="mlx", max_model_len=256, num_kv_blocks=32).generate(prompt, params, use_tqdm=False)
    cpu_out = LLM(gguf, device="cpu", max_model_len=256, num_kv_blocks=32).generate(prompt, params, use_tqdm=False)
    assert "Paris" in mlx_out[0].outputs[0].text
    assert mlx_out[0].outputs[0].token_ids == cpu_out[0].outputs[0].token_ids


def test_dummy_weights_build_at_the_config_dims(tiny):
    llm = LLM(tiny, device="mlx", load_format="dummy", num_kv_blocks=16)
    out = generate_ids(llm, [[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4
    runner = llm.llm_engine.runner
    spec = llm.llm_engine.spec
    assert runner.decode_weight_bytes() > spec.vocab_size * spec.hidden_size * 4  # the untied head and layers


@pytest.mark.parametrize("edit, message", [
    ("drop", "missing tensor\\(s\\) in checkpoint: model.layers.1.mlp.up_proj.weight"),
    ("extra", "unexpected tensor\\(s\\) in checkpoint: model.layers.0.mlp.extra.weight"),
    ("shape", "model.layers.0.self_attn.o_proj.weight has shape \\(64, 32\\), expected \\(64, 64\\)"),
])
def test_bad_checkpoints_are_named(tiny, tmp_path, edit, message):
    copy_model_files(tiny, str(tmp_path), weights=False)
    tensors = load_file(os.path.join(tiny, "model.safetensors"))
    if edit == "drop":
        del tensors["model.layers.1.mlp.up_proj.weight"]
    elif edit == "extra":
        tensors["model.layers.0.mlp.extra.weight"] = tensors["model.norm.weight"].clone()
    else:
        tensors["model.layers.0.self_attn.o_proj.weight"] = tensors["model.layers.0.self_attn.o_proj.weight"][:, :32]
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(str(tmp_path), "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), device="mlx", num_kv_blocks=8)


def test_bf16_compute_runs_close_to_fp32(tiny, tmp_path):
    """dtype bfloat16 (MLX's own CPU GEMM): the first greedy token of each prompt equals fp32's."""
    shutil.copytree(tiny, str(tmp_path / "m"))
    prompts = make_prompts([8, 30], seed=12)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    bf16 = generate_ids(LLM(str(tmp_path / "m"), device="mlx", dtype="bfloat16", num_kv_blocks=16), prompts, one)
    fp32 = generate_ids(LLM(str(tmp_path / "m"), device="mlx", dtype="float32", num_kv_blocks=16), prompts, one)
    assert bf16 == fp32


def test_fp16_compute_runs_close_to_fp32(tiny, tmp_path):
    """dtype float16: the computation really is in float16 (the runner's dtype) and the first greedy token of
    each prompt equals fp32's."""
    shutil.copytree(tiny, str(tmp_path / "m"))
    prompts = make_prompts([8, 30], seed=12)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm = LLM(str(tmp_path / "m"), device="mlx", dtype="float16", num_kv_blocks=16)
    assert str(llm.llm_engine.runner.dtype) == "mlx.core.float16"
    fp16 = generate_ids(llm, prompts, one)
    fp32 = generate_ids(LLM(str(tmp_path / "m"), device="mlx", dtype="float32", num_kv_blocks=16), prompts, one)
    assert fp16 == fp32
