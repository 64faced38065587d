"""POST /v1/completions through the official `openai` client: equal to `LLM.generate`, streamed or not,
with its options (several prompts and n, token-id prompts, echo, logprobs, seeds, vLLM extras, stop strings)."""

from __future__ import annotations

import pytest

from metainfer import SamplingParams
from tests.helpers.detok_reference import text_after_prompt, token_pieces
from tests.helpers.server import MODEL, greedy, metrics, wait_idle
from tests.helpers.tiny_models import make_prompts

NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def test_completions_match_llm(server, client, ref):
    prompts = ["Hello world", "The capital of France is", "1, 2, 3, 4,"]
    expected = ref.generate(prompts, greedy(12), use_tqdm=False)
    m0 = metrics(server)
    for prompt, exp in zip(prompts, expected):
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert full.choices[0].text == streamed == exp.outputs[0].text
        assert full.choices[0].finish_reason == "length"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage.completion_tokens == 12
        assert full.usage.prompt_tokens == usage.prompt_tokens == len(exp.prompt_token_ids)
        assert full.usage.total_tokens == len(exp.prompt_token_ids) + 12
    m = wait_idle(server)
    assert m["metainfer:generation_tokens_total"] - m0["metainfer:generation_tokens_total"] == 6 * 12
    assert m["metainfer:prompt_tokens_total"] > m0["metainfer:prompt_tokens_total"]
    assert m["metainfer:time_to_first_token_seconds_count"] >= 6


def test_completion_options(server, client, ref):
    # a list of prompts with n=2: choices are prompt-major
    prompts = ["Once upon a time", "def main():"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0)
    exp = ref.generate(prompts, greedy(6), use_tqdm=False)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    for c in r.choices:
        assert c.text == exp[c.index // 2].outputs[0].text
    assert r.usage.completion_tokens == 4 * 6
    # token-id prompt, and echo
    ids = make_prompts([9], vocab=512, seed=3)[0]
    exp_ids = ref.generate({"prompt_token_ids": ids}, greedy(5), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == exp_ids.text and r.usage.prompt_tokens == 9
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0, echo=True)
    plain = ref.generate("Hello world", greedy(5), use_tqdm=False)[0].outputs[0].text
    assert r.choices[0].text == "Hello world" + plain
    chunks = list(client.completions.create(model=MODEL, prompt="Hello world", max_tokens=5, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    # logprobs, streamed and not
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=2,
                                            stream=True))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks) == 6
    assert [x for c in chunks for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)
    # seeded sampling is reproducible and equals LLM with the same seed
    a, b = (client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, temperature=1.0, seed=123)
            for _ in range(2))
    exp_seed = ref.generate("Hi", SamplingParams(temperature=1.0, seed=123, max_tokens=8), use_tqdm=False)[0]
    assert a.choices[0].text == b.choices[0].text == exp_seed.outputs[0].text
    # vLLM extras: top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos
    g = ref.generate("Tell me", greedy(8), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, temperature=1.0,
                                  extra_body={"top_k": 1, "min_p": 0.1, "ignore_eos": True})
    assert r.choices[0].text == g.text
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, temperature=0,
                                  extra_body={"stop_token_ids": [g.token_ids[2]]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 3
    assert r.choices[0].stop_reason == g.token_ids[2]
    rep = ref.generate("Tell me", greedy(8, repetition_penalty=1.5), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, temperature=0,
                                  extra_body={"repetition_penalty": 1.5})
    assert r.choices[0].text == rep.text
    wait_idle(server)


def test_stop_strings_stream_equals_full(server, client, ref):
    """A stop string that completes mid-output: streamed text never shows the cut-off part."""
    base = ref.generate("Stop here", greedy(24), use_tqdm=False)[0].outputs[0].text
    stop = next((base[i:i + 3] for i in range(len(base) // 3, len(base) - 3)
                 if base[i:i + 3].strip() and base.find(base[i:i + 3]) == i), None)
    assert stop, base
    exp = ref.generate("Stop here", greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert exp.finish_reason == "stop"
    full = client.completions.create(model=MODEL, prompt="Stop here", max_tokens=24, temperature=0, stop=[stop])
    chunks = list(client.completions.create(model=MODEL, prompt="Stop here", max_tokens=24, temperature=0,
                                            stop=[stop], stream=True))
    assert full.choices[0].text == "".join(c.choices[0].text for c in chunks) == exp.text
    assert full.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"
    assert full.choices[0].stop_reason == stop
    chat = [{"role": "user", "content": "Stop here"}]
    c_full = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=24, temperature=0, stop=stop)
    c_stream = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=24, temperature=0, stop=stop,
                                              stream=True)
    assert c_full.choices[0].message.content == "".join(c.choices[0].delta.content or "" for c in c_stream)
    wait_idle(server)


def test_a_stop_tokens_text_is_left_out_streamed_or_not(server, client, ref):
    """A stop token's id ends the request but its text is not in the output unless include_stop_str_in_output, as
    vLLM's server answers: an EOS forced first with its text shown (skip_special_tokens false), and one of
    stop_token_ids; streamed chunks join to the same text. Reference: the tokenizer's decode."""
    tok = ref.get_tokenizer()
    eos = ref.llm_engine.eos_token_ids[0]
    eos_text = tok.decode([eos], skip_special_tokens=False)
    assert eos_text
    g = ref.generate("Tell me", greedy(8), use_tqdm=False)[0].outputs[0]
    stop_id = next(t for t in g.token_ids[1:] if tok.decode([t]).strip())
    ids = g.token_ids[:g.token_ids.index(stop_id) + 1]
    for keep in (False, True):
        body = {"logit_bias": {str(eos): 100}, "skip_special_tokens": False, "include_stop_str_in_output": keep}
        full = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=5, temperature=0, extra_body=body)
        chunks = list(client.completions.create(model=MODEL, prompt="Tell me", max_tokens=5, temperature=0,
                                                stream=True, extra_body=body))
        assert full.choices[0].finish_reason == "stop" and full.usage.completion_tokens == 1
        assert full.choices[0].text == "".join(c.choices[0].text for c in chunks) == (eos_text if keep else "")
        body = {"stop_token_ids": [stop_id], "include_stop_str_in_output": keep}
        full = client.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, temperature=0, extra_body=body)
        chunks = list(client.completions.create(model=MODEL, prompt="Tell me", max_tokens=8, temperature=0,
                                                stream=True, extra_body=body))
        prompt = tok.encode("Tell me")
        expected = tok.decode(prompt + (ids if keep else ids[:-1]))[len(tok.decode(prompt)):]
        assert full.choices[0].stop_reason == stop_id and full.usage.completion_tokens == len(ids)
        assert full.choices[0].text == "".join(c.choices[0].text for c in chunks) == expected
    wait_idle(server)


def test_a_stream_whose_tokens_end_inside_a_character_keeps_its_text(server, client, ref):
    """Tokens that end inside a UTF-8 character decode to no new text; their chunks go out with empty text (one a
    step, vLLM's rule: test_output_handoff checks the rule itself; here a consumer that falls behind may carry
    several steps in one chunk), and the joined text still equals the full answer's, streamed or not, both
    endpoints. The prompt is chosen, by the tokenizer alone, so that its greedy output holds such a token."""
    tokenizer = ref.get_tokenizer()
    for prompt in (f"Sample {i}:" for i in range(40)):
        out = ref.generate(prompt, greedy(32), use_tqdm=False)[0].outputs[0]
        texts = [tokenizer.decode(out.token_ids[:k]) for k in range(1, 33)]
        if any(t.endswith("\ufffd") for t in texts[:-1]):
            break
    else:
        pytest.fail("no greedy output of 40 prompts ends a token inside a character: pick other prompts")
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    pieces = [c.choices[0].text for c in chunks if c.choices]
    assert chunks[-1].usage.completion_tokens == 32 and 1 <= len(pieces) <= 32
    assert "".join(pieces) == out.text
    chat = [{"role": "user", "content": prompt}]
    full = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=32, temperature=0)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=32, temperature=0, stream=True) if c.choices]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == full.choices[0].message.content
    wait_idle(server)


def test_logit_bias_and_allowed_token_ids_reach_the_sampler(server, client, ref):
    """OpenAI's logit_bias (string token ids) and vLLM's allowed_token_ids: the text equals LLM.generate's with the
    same SamplingParams (tests/engine/test_token_constraints.py checks those against HF)."""
    bias = {"785": 100, "13": -100}
    allowed = [9707, 1879, 11, 220]
    for body, params in (({"logit_bias": bias}, dict(logit_bias={785: 100, 13: -100})),
                         ({"extra_body": {"allowed_token_ids": allowed}}, dict(allowed_token_ids=allowed))):
        r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0, **body)
        exp = ref.generate("Hello world", SamplingParams(temperature=0, max_tokens=6, **params), use_tqdm=False)
        assert r.choices[0].text == exp[0].outputs[0].text
    forced = ref.get_tokenizer().decode([785] * 6)
    assert r.choices[0].text != forced  # the second request ran its own constraint, not the first's
    assert client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0,
                                     logit_bias=bias).choices[0].text == forced


def test_echo_with_logprobs_scores_the_prompt(server, client, model_dir):
    """echo + logprobs (how lm-eval scores a continuation): the prompt's tokens come first, the first with null, the
    rest with HF's teacher-forced logprobs and their top-k; streamed chunks carry the same lists."""
    import torch
    import transformers

    prompt = "The capital of France is Paris"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp, usage = r.choices[0].logprobs, r.usage
    n_prompt = usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.choices[0].text.startswith(prompt) and lp.text_offset[0] == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = transformers.AutoTokenizer.from_pretrained(model_dir).encode(prompt)
    assert len(ids) == n_prompt
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    for i in range(1, n_prompt):
        assert lp.token_logprobs[i] == pytest.approx(ref[i - 1, ids[i]].item(), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 3 and max(lp.top_logprobs[i].values()) == pytest.approx(
            ref[i - 1].max().item(), abs=1e-4)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                            logprobs=2, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs


def test_lm_eval_loglikelihood_request(server, model_dir):
    """The request lm-evaluation-harness's local-completions sends for loglikelihood tasks (token-id prompts of
    context + continuation, several in one body, echo, logprobs 1, max_tokens 1, temperature 0): the continuation's
    token_logprobs (the slice [ctxlen:-1]) sum to HF's teacher-forced log-likelihood, and is_greedy reads the top."""
    import httpx
    import torch
    import transformers

    from tests.helpers.server import KEY

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pairs = [("The capital of France is", " Paris"), ("1, 2, 3,", " 4, 5")]
    prompts = [tok.encode(ctx) + tok.encode(cont) for ctx, cont in pairs]
    ctxlens = [len(tok.encode(ctx)) for ctx, _ in pairs]
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, ctxlen, choice in zip(prompts, ctxlens, choices):
        lp = choice["logprobs"]
        got = sum(lp["token_logprobs"][ctxlen:-1])
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        want = sum(logits[i - 1, ids[i]].item() for i in range(ctxlen, len(ids)))
        assert got == pytest.approx(want, abs=1e-3)
        greedy = all(max(top, key=top.get) == t for top, t in zip(lp["top_logprobs"][ctxlen:-1],
                                                                   lp["tokens"][ctxlen:-1]))
        assert greedy == all(logits[i - 1].argmax().item() == ids[i] for i in range(ctxlen, len(ids)))


def test_echo_with_max_tokens_0_answers_the_prompt_alone(server, client):
    """echo + max_tokens 0 (older scorers): the prompt's text and its tokens' logprobs, nothing generated shown;
    streamed alike. vLLM's prompt_logprobs body field is refused, not dropped."""
    prompt = "The capital of France is Paris"
    scored = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True,
                                       logprobs=1)
    alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True, logprobs=1)
    n_prompt = scored.usage.prompt_tokens
    assert alone.choices[0].text == prompt
    lp = alone.choices[0].logprobs
    assert lp.token_logprobs == scored.choices[0].logprobs.token_logprobs[:n_prompt] and len(lp.tokens) == n_prompt
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0, echo=True,
                                            logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt
    assert [x for c in chunks if c.choices for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)  # no echo: 0 is no request
    assert err.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"


def test_logprob_tokens_of_multibyte_characters_join_to_the_text(server, client, ref):
    """Byte-level pieces of a character in the answers' logprobs (Qwen's "데" is a lead-byte token, then a token of
    its two trailing bytes + "이터"): each token's text is what it adds after the ids before it, as LLMEngine's
    decoded_token and vLLM's server give it, not its own decode (U+FFFD). The echoed prompt's tokens join to the
    prompt and text_offset follows them; a sampled token gets the character the prompt's last id opened, in the body
    and streamed alike (its context is the prompt too, unlike the completion's text, decoded from the outputs alone);
    streamed offsets equal the body's; chat's tokens, their bytes and its top_logprobs equal LLM.chat's
    decoded_token."""
    tok = ref.get_tokenizer()
    text = "> 请데이터 and 🦜 ok"
    ids = tok.encode(text)
    solo = [tok.decode([t]) for t in ids]
    assert any(s.startswith("\ufffd") for s in solo) and any(s.endswith("\ufffd") for s in solo)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert "".join(lp.tokens[:n]) == text and "\ufffd" not in "".join(lp.tokens[:n])
    assert lp.text_offset[:n] == [len("".join(lp.tokens[:i])) for i in range(n)]

    lead, rest = tok.encode("请데이터")[-2:]  # the lead byte of 데, then its trailing bytes + 이터
    assert tok.decode([lead]) == "\ufffd" and tok.decode([rest]).startswith("\ufffd")
    prompt = tok.encode("> 请") + [lead]
    body = dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                extra_body={"allowed_token_ids": [rest]})
    full = client.completions.create(**body)
    streamed = [t for c in client.completions.create(**body, stream=True) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.tokens]
    assert full.choices[0].logprobs.tokens == streamed == ["데이터"]

    # several steps among byte pieces (the detokenizer holds a partial character back from the streamed text):
    # streamed tokens and text_offsets equal the body's, each offset past the token texts before it
    allowed = [lead, rest, *tok.encode(" 🦜")]
    body = dict(model=MODEL, prompt=tok.encode("> 请"), max_tokens=8, temperature=0, logprobs=1,
                extra_body={"allowed_token_ids": allowed})
    whole = client.completions.create(**body).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**body, stream=True)
              if c.choices and c.choices[0].logprobs]
    assert [t for c in chunks for t in c.tokens] == whole.tokens
    assert [o for c in chunks for o in c.text_offset] == whole.text_offset
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i]) for i in range(len(whole.tokens))]

    messages = [{"role": "user", "content": "Say 데이터"}]
    exp = ref.chat(messages, SamplingParams(temperature=0, max_tokens=6, logprobs=2, allowed_token_ids=allowed),
                   chat_template_kwargs={"enable_thinking": False}, use_tqdm=False)[0].outputs[0]
    for stream in (False, True):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2, stream=stream,
                                           extra_body={"allowed_token_ids": allowed, **NO_THINK})
        content = ([x for c in r if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
                   if stream else r.choices[0].logprobs.content)
        assert [c.token for c in content] == [e[t].decoded_token for t, e in zip(exp.token_ids, exp.logprobs)]
        assert [c.bytes for c in content] == [list(c.token.encode()) for c in content]
        assert [{a.token for a in c.top_logprobs} for c in content] == [
            {lp.decoded_token for t, lp in e.items() if lp.rank <= 2} for e in exp.logprobs]
    wait_idle(server)


def test_logprob_tokens_and_offsets_follow_the_text_after_an_unfinished_character(server, client, ref):
    """Sampled among byte pieces (데's lead byte and the trailing bytes + 이터 that complete it, the pieces of " 🦜")
    and " ok", so some characters never complete: each logprobs token is its slice of the returned text and its
    text_offset where that slice starts (token_pieces, from the tokenizer's decode: the token after an unfinished
    character carries its U+FFFD, the last token the ones the text ends with); the text is the decode after the
    prompt (which ends with a lead byte of its own), streamed or not, and echoed the tokens join to the prompt's
    text + the text. A stop token that completes a character leaves it unfinished (U+FFFD) in the text, streamed or
    not, and with a stop string (the engine then gives the text)."""
    tok = ref.get_tokenizer()
    lead, rest = tok.encode("请데이터")[-2:]
    allowed = [lead, rest, *tok.encode(" 🦜"), *tok.encode(" ok")]
    prompt = tok.encode("> 请") + [lead]
    base = dict(temperature=1.0, max_tokens=10, logprobs=1, allowed_token_ids=allowed, ignore_eos=True)
    seeds = [SamplingParams(seed=s, **base) for s in range(30)]
    outs = [o.outputs[0] for o in ref.generate([{"prompt_token_ids": prompt}] * 30, seeds, use_tqdm=False)]
    settled = next(s for s, o in enumerate(outs) if "\ufffd" in o.text.rstrip("\ufffd"))
    ends_open = next(s for s, o in enumerate(outs) if o.text.endswith("\ufffd"))
    body = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, logprobs=1)
    for seed in (settled, ends_open):
        ids = list(outs[seed].token_ids)
        text, tokens, offsets = token_pieces(tok, prompt, ids)
        kw = dict(body, seed=seed, extra_body={"allowed_token_ids": allowed, "ignore_eos": True})
        full = client.completions.create(**kw).choices[0]
        assert full.text == text and full.logprobs.tokens == tokens and full.logprobs.text_offset == offsets
        chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
        assert "".join(c.text for c in chunks) == text
        assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == tokens
        assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == offsets
        echoed = client.completions.create(**kw, echo=True).choices[0]
        assert echoed.text == tok.decode(prompt) + text and "".join(echoed.logprobs.tokens) == echoed.text
        assert echoed.logprobs.text_offset == [len("".join(echoed.logprobs.tokens[:i]))
                                               for i in range(len(echoed.logprobs.tokens))]

    # rest as a stop token after lead bytes of the output's (it would complete 데)
    stops = dict(temperature=1.0, max_tokens=10, allowed_token_ids=[lead, rest], stop_token_ids=[rest])
    seeds = [SamplingParams(seed=s, **stops) for s in range(30)]
    outs = [o.outputs[0] for o in ref.generate([{"prompt_token_ids": prompt}] * 30, seeds, use_tqdm=False)]
    seed, ids = next((s, list(o.token_ids)) for s, o in enumerate(outs) if len(o.token_ids) > 1 and o.stop_reason)
    expected = text_after_prompt(tok, prompt, ids[:-1])
    assert expected == "\ufffd" * (len(ids) - 1) and text_after_prompt(tok, prompt, ids).endswith("데이터")
    for stop in ([], ["zz"]):
        kw = dict(body, seed=seed, stop=stop, extra_body={"allowed_token_ids": [lead, rest], "stop_token_ids": [rest]})
        full = client.completions.create(**kw).choices[0]
        streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
        assert full.finish_reason == "stop" and full.stop_reason == rest
        assert full.text == streamed == expected, (stop, full.text, streamed)
    wait_idle(server)


def test_a_stop_tokens_logprob_text_is_its_decode_and_the_token_before_it_ends_the_text(server, client, ref):
    """Sampled among 데's lead byte and " ok" with " ok" a stop token (its text left out): the output's lead bytes
    are unfinished characters, U+FFFDs in the text. The token before the stop token ends the text and keeps the
    U+FFFD it ends with, the stop token's text is its own decode (as vLLM's), so the other tokens are their slices
    of the text (token_pieces) and the text_offsets index it. Streamed, a stop token whose chunk comes after the one
    that answered the token before it carries the U+FFFDs its finish settled: the tokens still join to the text +
    the stop token's decode. With include_stop_str_in_output the stop token's text is in the text, and its token
    ends it."""
    tok = ref.get_tokenizer()
    lead = tok.encode("请데이터")[-2]
    (ok,) = tok.encode(" ok")
    prompt = tok.encode("> 请")
    stops = dict(temperature=1.0, max_tokens=10, allowed_token_ids=[lead, ok], stop_token_ids=[ok])
    seeds = [SamplingParams(seed=s, **stops) for s in range(30)]
    outs = [o.outputs[0] for o in ref.generate([{"prompt_token_ids": prompt}] * 30, seeds, use_tqdm=False)]
    seed, ids = next((s, list(o.token_ids)) for s, o in enumerate(outs) if len(o.token_ids) > 2 and o.stop_reason)
    body = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=1.0, logprobs=1, seed=seed)
    for keep in (False, True):
        text, tokens, offsets = token_pieces(tok, prompt, ids if keep else ids[:-1])
        if not keep:
            tokens, offsets = tokens + [" ok"], offsets + [len(text)]
        assert text.endswith("\ufffd" if not keep else " ok")
        kw = dict(body, extra_body={"allowed_token_ids": [lead, ok], "stop_token_ids": [ok],
                                    "include_stop_str_in_output": keep})
        full = client.completions.create(**kw).choices[0]
        assert full.text == text and full.stop_reason == ok
        assert full.logprobs.tokens == tokens and full.logprobs.text_offset == offsets, keep
        chunks = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
        streamed = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        assert "".join(c.text for c in chunks) == text
        assert "".join(streamed) == text + ("" if keep else " ok") and streamed[-1].endswith(tokens[-1])
        assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == [
            len("".join(streamed[:i])) for i in range(len(streamed))]
    wait_idle(server)
