"""Running an LLM in the tests: the generated ids of token-id prompts, and the state a finished run leaves."""

from __future__ import annotations

import importlib.util

import pytest

from metainfer.engine.sequence import PENDING

# the two backends a test runs on (MLX where it is installed: pip install 'mlx[cpu]')
BACKENDS = ["cpu", pytest.param("mlx", marks=pytest.mark.skipif(
    importlib.util.find_spec("mlx") is None, reason="MLX is not installed (pip install 'mlx[cpu]')"))]


def token_ids(outs) -> list[list[int]]:
    """The first sample's generated ids of each request output."""
    return [o.outputs[0].token_ids for o in outs]


def generate_ids(llm, prompts: list[list[int]], params) -> list[list[int]]:
    """`llm.generate` over token-id prompts, one output id list per prompt."""
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def generate_drained(folder: str, prompts: list[list[int]], params, **engine_kw):
    """A float32 CPU `LLM` over `folder` generates `prompts`, then must be drained; returns (llm, ids)."""
    from metainfer import LLM

    llm = LLM(folder, device="cpu", dtype="float32", **engine_kw)
    got = generate_ids(llm, prompts, params)
    assert_drained(llm)
    return llm, got


def assert_drained(llm) -> None:
    """After a run: every KV block back on the free list, no request left, no PENDING token hashed."""
    engine = llm.llm_engine
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert not engine.has_unfinished_requests(), "a request was left behind"
    assert all(PENDING not in b.token_ids for b in bm.blocks), "a PENDING token was hashed"


def decoded_token_matches(tok, token: int, text) -> bool:
    """A Logprob's decoded_token against the tokenizer: the id's decode alone, except for an id that alone decodes to
    an incomplete character (U+FFFD in it), whose text depends on the ids before it, and for one after ids that leave
    a character unfinished, which carries that character's U+FFFDs before its own decode (checked exactly by
    test_logprob_fields' byte-token tests and test_token_texts)."""
    solo = tok.decode([token])
    if "\ufffd" in solo:
        return isinstance(text, str)
    return isinstance(text, str) and text.endswith(solo) and set(text[:len(text) - len(solo)]) <= {"\ufffd"}
