"""POST /v1/chat/completions through the official `openai` client: equal to `LLM.chat`, streamed or not,
the template kwargs, content parts, logprobs."""

from __future__ import annotations

import pytest

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
