"""GGUF source: config from metadata, tensors dequantized to HF layout (the file parsed by gguf_file, the
dequantization by the `gguf` package).

llama.cpp's converter permutes Q/K rows of Llama-architecture checkpoints for its rotary;
`_unpermute` restores HF's rotate-half layout. Qwen2/Qwen3 GGUFs are stored unpermuted.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import os
from collections.abc import Iterator

import numpy as np
import torch

_ARCH = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
         "qwen3": ("Qwen3ForCausalLM", "qwen3")}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# (abspath, size, mtime_ns) -> parsed reader, inside share_gguf_readers() only (None outside)
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("metainfer_gguf_readers", default=None)


def _file_key(path: str) -> tuple[str, int, int]:
    stat = os.stat(path)
    return os.path.abspath(path), stat.st_size, stat.st_mtime_ns


@contextlib.contextmanager
def share_gguf_readers():
    """One parse of a GGUF per engine build: the build needs the file twice (gguf_config, then iterate_gguf for
    the weights). The parse is ~10 ms with gguf_file (gguf-py's GGUFReader took ~2 s on the embedded 135M model);
    sharing still keeps one memory map of the file per build. Inside the block both get the same reader; it is
    dropped on exit, so no parsed file (nor its memory map) outlives the build. Nested (the CLI's context check
    around the engine's own block), the inner block shares the outer's readers."""
    outer = _SHARED.get()
    token = _SHARED.set({} if outer is None else outer)
    try:
        yield
    finally:
        _SHARED.reset(token)


def _reader(path: str):
    """The parsed file (gguf_file._GGUFFile: scalars and the tensor table; arrays such as the vocabulary are only
    stepped over), shared inside share_gguf_readers()."""
    from metainfer.loader import gguf_file

    shared = _SHARED.get()
    if shared is None:
        return gguf_file._GGUFFile(path)
    key = _file_key(path)  # a file rewritten mid-build is parsed again
    if key not in shared:
        shared[key] = gguf_file._GGUFFile(path)
    return shared[key]


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(path: str) -> dict:
    """An HF-style config.json dict built from the GGUF metadata; cached per file (path, size, mtime), so a process
    that reads it twice (the CLI's checks before loading, then the engine) parses it once."""
    return copy.deepcopy(_gguf_config(*_file_key(path)))


@functools.lru_cache(maxsize=8)
def _gguf_config(path: str, size: int, mtime_ns: int) -> dict:
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in _ARCH:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCH)}")
    names = {t.name for t in reader.tensors}
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    heads = _field(reader, f"{arch}.attention.head_count")
    hidden = _field(reader, f"{arch}.embedding_length")
    cfg = {
        "architectures": [_ARCH[arch][0]], "model_type": _ARCH[arch][1],
        "vocab_size": int(embd.shape[1]), "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": _field(reader, f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg["attention_bias"] = True
    return cfg


def _hf_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, kind, suffix = parts[1], parts[2], parts[3]
        if kind not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    if parts[0] not in _GLOBAL_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's permute (which interleaves the two rotary halves of each head)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iterate_gguf(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    for t in reader.tensors:
        array = gguf.quants.dequantize(t.data, t.tensor_type)
        array = np.ascontiguousarray(array.reshape(tuple(int(d) for d in reversed(t.shape))))
        if arch == "llama" and ".attn_q." in t.name:
            array = _unpermute(array, heads)
        elif arch == "llama" and ".attn_k." in t.name:
            array = _unpermute(array, kv_heads)
        yield _hf_name(t.name), torch.from_numpy(array.astype(np.float32))
