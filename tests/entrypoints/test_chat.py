"""POST /v1/chat/completions through the official `openai` client: equal to `LLM.chat`, streamed or not,
the template kwargs, content parts, logprobs."""

from __future__ import annotations

import pytest

from metainfer import SamplingParams
from tests.helpers.detok_reference import token_pieces
from tests.helpers.server import MODEL, greedy, wait_idle

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def test_chat_matches_llm(server, client, ref):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    exp = ref.chat(messages, greedy(10), chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                          temperature=0, extra_body=NO_THINK)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body=NO_THINK)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed == exp.outputs[0].text
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == chunks[-1].usage.prompt_tokens == len(exp.prompt_token_ids)
    assert chunks[-1].usage.completion_tokens == 10
    # the template kwargs reach the template: with thinking on the prompt differs
    thinking = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert thinking.usage.prompt_tokens != full.usage.prompt_tokens
    # content given as a list of text parts
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=4, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=4, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    wait_idle(server)


def test_chat_logprobs(server, client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content


def _content_tokens(response, stream: bool) -> list[str]:
    if stream:
        return [x.token for c in response if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    return [x.token for x in response.choices[0].logprobs.content]


def test_chat_logprob_tokens_are_the_slices_of_the_content_as_completions_gives_them(server, client, ref):
    """Chat's logprobs tokens are completions' texts (the same rules): sampled among 데's byte pieces and " ok", a
    reply that stops for its length inside a character ends with a token that keeps the U+FFFD the content ends
    with, so the tokens join to the content (token_pieces: from the tokenizer's decode after the prompt), streamed
    or not; a reply whose last token is whole ends with it."""
    tok = ref.get_tokenizer()
    lead, rest = tok.encode("请데이터")[-2:]
    allowed = [lead, rest, *tok.encode(" ok")]
    messages = [{"role": "user", "content": "Say 데이터"}]
    base = dict(temperature=1.0, max_tokens=5, ignore_eos=True, allowed_token_ids=allowed)
    outs = ref.chat([messages] * 30, [SamplingParams(seed=s, **base) for s in range(30)],
                    chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)
    prompt = outs[0].prompt_token_ids
    open_ = next(s for s, o in enumerate(outs) if o.outputs[0].text.endswith("\ufffd"))
    closed = next(s for s, o in enumerate(outs) if not o.outputs[0].text.endswith("\ufffd"))
    for seed in (open_, closed):
        text, want, _ = token_pieces(tok, prompt, list(outs[seed].outputs[0].token_ids))
        for stream in (False, True):
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=1.0,
                                               seed=seed, logprobs=True, stream=stream,
                                               extra_body={"allowed_token_ids": allowed, "ignore_eos": True,
                                                           **NO_THINK})
            assert _content_tokens(r, stream) == want and "".join(want) == text, (seed, stream)
    wait_idle(server)


def test_chat_logprob_tokens_leave_the_prompts_unfinished_character_to_the_prompt(server, client, ref):
    """A reply that continues an assistant message ending in U+FFFD (continue_final_message: the prompt's last token
    " \ufffd" is held back as a partial character, no decode tells it from one): the reply's tokens are its slices
    of the content, the text after the prompt (token_pieces), so the first token does not take the prompt's U+FFFD,
    streamed or not."""
    tok = ref.get_tokenizer()
    messages = [{"role": "user", "content": "Say ok"}, {"role": "assistant", "content": "Sure \ufffd"}]
    template = {"enable_thinking": False, "continue_final_message": True}
    allowed = [*tok.encode(" ok"), *tok.encode("!")]
    exp = ref.chat(messages, SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=allowed),
                   chat_template_kwargs=template, add_generation_prompt=False, use_tqdm=False)[0]
    prompt, ids = exp.prompt_token_ids, list(exp.outputs[0].token_ids)
    assert "\ufffd" in tok.decode(prompt[-1:])
    text, want, _ = token_pieces(tok, prompt, ids)
    assert not want[0].startswith("\ufffd") and "".join(want) == text == exp.outputs[0].text
    extra = {"allowed_token_ids": allowed, "add_generation_prompt": False, "continue_final_message": True, **NO_THINK}
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                           stream=stream, extra_body=extra)
        assert _content_tokens(r, stream) == want, stream
    wait_idle(server)
