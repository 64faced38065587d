"""One engine build parses its GGUF once (loader/gguf.py share_gguf_readers): the config step and the weight step
share the parsed reader, which is dropped when the build ends. Counted, not timed (gguf-py's GGUFReader took ~2 s
on the real SmolLM2 file, twice before the sharing; loader/gguf_file.py's parse takes ~10 ms)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from metainfer.llm import LLM
from metainfer.loader import gguf_file
from metainfer.loader.gguf import gguf_config, iterate_gguf, share_gguf_readers
from tests.helpers.tiny_models import qwen_tokenizer_dir

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, INTER = 64, 4, 2, 16, 512, 128


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter permute of a llama Q/K projection (the rotary halves of each head interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_llama(path: str) -> dict[str, np.ndarray]:
    """A complete one-layer llama GGUF (F32, tied embeddings) written with gguf-py; returns its HF-layout tensors."""
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "model.layers.0.input_layernorm.weight": (HIDDEN,),
              "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
              "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
              "model.layers.0.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
              "model.layers.0.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
              "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
              "model.layers.0.mlp.gate_proj.weight": (INTER, HIDDEN),
              "model.layers.0.mlp.up_proj.weight": (INTER, HIDDEN),
              "model.layers.0.mlp.down_proj.weight": (HIDDEN, INTER)}
    hf = {name: (0.1 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}
    gguf_names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                  "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
                  "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
                  "model.layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
                  "model.layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
                  "model.layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
                  "model.layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
                  "model.layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
                  "model.layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
                  "model.layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight"}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    for name, array in hf.items():
        if name.endswith("q_proj.weight"):
            array = _permute(array, HEADS)
        elif name.endswith("k_proj.weight"):
            array = _permute(array, KV_HEADS)
        writer.add_tensor(gguf_names[name], array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.fixture
def parses(monkeypatch):
    """The paths the loader's GGUF reader (gguf_file._GGUFFile) is constructed on: every parse by the loader."""
    seen = []

    class CountingReader(gguf_file._GGUFFile):
        def __init__(self, path, *args, **kwargs):
            seen.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf_file, "_GGUFFile", CountingReader)
    return seen


def test_llm_build_parses_its_gguf_once(tmp_path, parses):
    """LLM() on a GGUF: one parse for the config and the weights (two before), and the weights loaded are the
    tensors written (Q/K back in HF rows, fused as q|k|v and gate|up)."""
    path = str(tmp_path / "tiny.gguf")
    hf = _write_tiny_llama(path)
    llm = LLM(model=path, device="cpu", tokenizer=qwen_tokenizer_dir(), max_model_len=64, num_kv_blocks=8,
              max_num_seqs=2, enforce_eager=True)
    try:
        assert parses == [path]
        params = dict(llm.llm_engine.runner.model.named_parameters())
        layer = "model.layers.0."
        want = {"model.embed_tokens.weight": hf["model.embed_tokens.weight"],
                "model.norm.weight": hf["model.norm.weight"],
                layer + "input_layernorm.weight": hf[layer + "input_layernorm.weight"],
                layer + "post_attention_layernorm.weight": hf[layer + "post_attention_layernorm.weight"],
                layer + "self_attn.qkv_proj.weight": np.concatenate(
                    [hf[layer + f"self_attn.{p}_proj.weight"] for p in "qkv"]),
                layer + "self_attn.o_proj.weight": hf[layer + "self_attn.o_proj.weight"],
                layer + "mlp.gate_up_proj.weight": np.concatenate(
                    [hf[layer + "mlp.gate_proj.weight"], hf[layer + "mlp.up_proj.weight"]]),
                layer + "mlp.down_proj.weight": hf[layer + "mlp.down_proj.weight"]}
        for name, array in want.items():
            assert torch.equal(params[name].detach(), torch.from_numpy(array)), name
    finally:
        llm.close()


def test_shared_reader_lives_only_inside_the_scope(tmp_path, parses):
    """Inside share_gguf_readers the config and the weights come from one parse; after it nothing is kept, so
    the next read parses the file again (no parsed file outlives a build)."""
    path = str(tmp_path / "tiny.gguf")
    _write_tiny_llama(path)
    with share_gguf_readers():
        gguf_config(path)
        names = [name for name, _ in iterate_gguf(path)]
    assert len(parses) == 1 and len(names) == 11
    dict(iterate_gguf(path))
    assert len(parses) == 2


def test_cli_generate_parses_its_gguf_once(tmp_path, parses, capsys):
    """`metainfer generate` checks the prompt against the model's context (the GGUF's config) before it builds the
    engine: both in one scope, one parse."""
    from metainfer.entrypoints import cli

    path = str(tmp_path / "tiny.gguf")
    _write_tiny_llama(path)
    assert cli.main(["generate", "--model", path, "--device", "cpu", "--tokenizer", qwen_tokenizer_dir(),
                     "--max-tokens", "2", "--num-kv-blocks", "8", "--enforce-eager", "a"]) == 0
    assert parses == [path]
    assert capsys.readouterr().out.startswith("a")
