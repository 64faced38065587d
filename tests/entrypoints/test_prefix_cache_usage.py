"""Prefix-cache hits as the server reports them (issue 23, item 1): `usage.prompt_tokens_details.cached_tokens`
in completions and chat responses (the streamed final usage chunk too), and the Prometheus counters
`metainfer:prefix_cache_queries_total` / `metainfer:prefix_cache_hits_total`, all equal to what the engine
counted."""

from __future__ import annotations

from tests.helpers.server import MODEL, wait_idle
from tests.helpers.tiny_models import make_prompts

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def _cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_completions_report_cached_prompt_tokens(server, client):
    engine = server.state.engine
    prompt = make_prompts([45], vocab=512, seed=23)[0]  # 2 full 16-token blocks
    m0 = wait_idle(server)
    bm = engine.block_manager
    queries0, hits0 = bm.prefix_query_tokens, bm.prefix_hit_tokens
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert _cached(first.usage) == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
    assert _cached(again.usage) == 32 and again.usage.prompt_tokens == 45
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and _cached(chunks[-1].usage) == 32
    m = wait_idle(server)
    queries, hits = bm.prefix_query_tokens - queries0, bm.prefix_hit_tokens - hits0
    assert (queries, hits) == (3 * 45, 2 * 32)
    assert m["metainfer:prefix_cache_queries_total"] - m0["metainfer:prefix_cache_queries_total"] == queries
    assert m["metainfer:prefix_cache_hits_total"] - m0["metainfer:prefix_cache_hits_total"] == hits


def test_chat_reports_cached_prompt_tokens(server, client):
    messages = [{"role": "system", "content": "You answer in one short sentence, and only in English words."},
                {"role": "user", "content": "Name three colours of the rainbow and one animal that lives in a lake."}]
    kw = dict(model=MODEL, messages=messages, temperature=0, extra_body=NO_THINK)
    first = client.chat.completions.create(max_completion_tokens=1, **kw)
    full_blocks = first.usage.prompt_tokens // 16 * 16
    assert full_blocks >= 32
    again = client.chat.completions.create(max_completion_tokens=2, **kw)
    assert _cached(again.usage) == min(full_blocks, again.usage.prompt_tokens - 1)
    chunks = list(client.chat.completions.create(max_completion_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    assert _cached(chunks[-1].usage) == _cached(again.usage)
    wait_idle(server)
