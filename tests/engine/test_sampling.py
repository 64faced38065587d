"""Sampling through the engine: seeds (reproducible across runs and batch rows), top-k 1 == greedy, n samples,
max_tokens, stop strings and stop ids with min_tokens, logprobs. (The sampler alone: test_sampler.py.)"""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from tests.helpers.detok_reference import byte_ids, text_after_prompt
from tests.helpers.engine_checks import assert_drained, token_ids
from tests.helpers.tiny_models import build_tiny_model, make_prompts


@pytest.fixture(scope="module")
def shared_llm(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3"))
    build_tiny_model(folder, "qwen3", initializer_range=0.1)
    return LLM(folder, device="cpu", dtype="float32")


@pytest.fixture
def llm(shared_llm):
    """After every test: all KV blocks free, no request left behind."""
    yield shared_llm
    assert_drained(shared_llm)


PROMPTS = [{"prompt_token_ids": p} for p in make_prompts([5, 12, 30, 3])]


def test_seed_reproducible_across_runs_and_batches(llm):
    p = SamplingParams(temperature=1.0, seed=123, max_tokens=20, ignore_eos=True)
    alone = token_ids(llm.generate(PROMPTS[0], p, use_tqdm=False))
    again = token_ids(llm.generate(PROMPTS[0], p, use_tqdm=False))
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    # the seeded request sits in another row of a batch with unseeded neighbours
    mixed = llm.generate([PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]], [unseeded, unseeded, p, unseeded],
                         use_tqdm=False)
    assert alone == again == [mixed[2].outputs[0].token_ids]
    other_seed = token_ids(llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=124, max_tokens=20,
                                                                 ignore_eos=True), use_tqdm=False))
    assert other_seed != alone


def test_top_k_one_equals_greedy(llm):
    greedy = token_ids(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                  use_tqdm=False))
    topk1 = token_ids(llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=16,
                                                         ignore_eos=True), use_tqdm=False))
    assert greedy == topk1


def test_n_samples_differ_and_finish(llm):
    out = llm.generate(PROMPTS[1], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_max_tokens_gives_length(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].finish_reason == "length"


def test_stop_string_cuts_text(llm):
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) >= 6
    stop = text[3:5]
    cut = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.index(stop)]
    assert len(cut.token_ids) < len(full.token_ids) or text.index(stop) + len(stop) > len(text) - 4


def test_stop_token_ids_and_min_tokens(llm):
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = full[2]
    first = full.index(stop_id)
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                  stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id and out.token_ids == full[: first + 1]
    late = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, min_tokens=10,
                                                   stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= 10 and stop_id not in late.token_ids[:10]


def test_a_stop_tokens_text_is_left_out_unless_include_stop_str_in_output(llm):
    """vLLM's rule: a request a stop token ends (one of stop_token_ids, or an EOS: the server test forces one) keeps
    the token's id but not its text; include_stop_str_in_output keeps the text. Reference: the tokenizer's own decode
    after the prompt."""
    tok = llm.get_tokenizer()
    prompt = PROMPTS[1]["prompt_token_ids"]
    full = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = next(t for t in full[2:] if tok.decode([t]).strip())  # a token with visible text
    ids = full[:full.index(stop_id) + 1]
    for keep in (False, True):
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_id],
                                include_stop_str_in_output=keep)
        out = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ids and out.stop_reason == stop_id
        assert out.text == text_after_prompt(tok, prompt, ids if keep else ids[:-1])


def test_a_streamed_request_never_shows_the_stop_tokens_text(llm):
    """Streamed (the engine decodes each token as it comes, the stop token's too, before the finish is known): no
    step's text holds the stop token's text, and the last equals the tokenizer's decode without it."""
    tok = llm.get_tokenizer()
    prompt = PROMPTS[2]["prompt_token_ids"]
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = next(t for t in full[2:] if tok.decode([t]).strip())
    ids = full[:full.index(stop_id) + 1]
    engine = llm.llm_engine
    engine.add_request("streamed-stop", PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                                   stop_token_ids=[stop_id]))
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step() if o.request_id == "streamed-stop"]
    expected = text_after_prompt(tok, prompt, ids[:-1])
    assert texts[-1] == expected and all(expected.startswith(t) for t in texts)
    assert text_after_prompt(tok, prompt, ids) != expected  # the stop token had text to leave out


def test_logprobs_are_log_softmax(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) >= 3
        assert max(entry.values()) == pytest.approx(entry[token])  # greedy picks the top token
        assert all(v <= 0 for v in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(out.token_ids, out.logprobs)))


def test_min_tokens_with_stop_ids_outside_the_vocabulary(llm):
    """min_tokens masks the stop ids and EOS; ids the model cannot produce (a tokenizer's id beyond a small model
    vocabulary) need no mask and must not fail the step. (An id neither the model nor the tokenizer knows is
    refused when the request is added: tests/engine/test_bad_input.py.)"""
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, stop_token_ids=[100_000])
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 3


def test_incremental_detokenizer_returns_the_text_it_appends(llm):
    """IncrementalDetokenizer.update appends the newly decodable text to seq.output_text and returns exactly that
    delta (the stop-string check and streaming read the text it grew); token by token, the deltas and the final
    flush add up to the one-shot decode of the output."""
    from metainfer.engine.sequence import Sequence

    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    detokenizer = llm.llm_engine.detokenizer
    seq = Sequence("detok", 0, list(out.prompt_token_ids), SamplingParams())
    deltas = []
    for token in ids:
        before = seq.output_text
        seq.token_ids.append(token)
        deltas.append(detokenizer.update(seq))
        assert seq.output_text == before + deltas[-1]
    deltas.append(detokenizer.flush(seq))
    assert "".join(deltas) == seq.output_text == llm.get_tokenizer().decode(ids, skip_special_tokens=True)


def test_generate_raises_instead_of_spinning_when_a_finished_request_is_never_reported(llm, monkeypatch):
    """LLM.generate waits for every request's final output; an engine that holds no request any more but never
    reported one finished (an output lost) is an error, not an endless loop of empty steps."""
    real_step = llm.llm_engine.step
    monkeypatch.setattr(llm.llm_engine, "step", lambda: [o for o in real_step() if not o.finished])
    with pytest.raises(RuntimeError, match="never reported"):
        llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)


def test_a_sample_is_finished_exactly_when_it_has_a_finish_reason(llm):
    """vLLM's CompletionOutput.finished: True once the sample has a finish_reason, False while it runs (an
    engine step's streamed outputs before the end, and the final ones)."""
    from metainfer.outputs import CompletionOutput

    assert not CompletionOutput(0, "", [1], finish_reason=None).finished
    assert CompletionOutput(0, "", [1], finish_reason="stop").finished
    engine = llm.llm_engine
    engine.add_request("finished-check", PROMPTS[0]["prompt_token_ids"],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += [c for out in engine.step() for c in out.outputs]
    assert [c.finished for c in seen] == [c.finish_reason is not None for c in seen]
    assert seen[-1].finished and seen[-1].finish_reason == "length"


def test_a_stop_token_that_completes_a_character_leaves_it_unfinished_streamed_or_not(llm):
    """"é" as byte tokens C3 A9 and A9 a stop token: the text leaves the stop token's byte out, so its C3s are
    unfinished characters (U+FFFD, the tokenizer's decode of the ids without the stop token), whether decoded once,
    streamed (each step decoded as it comes: the stop token, known as one before its text is decoded, never shows the
    é it would complete) or decoded as it grows for a stop string; include_stop_str_in_output keeps the é."""
    tok = llm.get_tokenizer()
    lead, trail = byte_ids(tok, "é".encode())
    prompt = PROMPTS[0]["prompt_token_ids"]
    base = dict(temperature=1.0, max_tokens=8, ignore_eos=True, allowed_token_ids=[lead, trail], stop_token_ids=[trail])
    seeds = [SamplingParams(seed=s, **base) for s in range(40)]
    outs = llm.generate([PROMPTS[0]] * len(seeds), seeds, use_tqdm=False)
    seed, ids = next((p.seed, list(o.outputs[0].token_ids)) for p, o in zip(seeds, outs)
                     if len(o.outputs[0].token_ids) > 1 and o.outputs[0].token_ids[-1] == trail)
    expected = text_after_prompt(tok, prompt, ids[:-1])
    assert expected == "\ufffd" * (len(ids) - 1)
    for keep, stop in ((False, []), (False, ["zz"]), (True, [])):
        params = SamplingParams(seed=seed, stop=stop, include_stop_str_in_output=keep, **base)
        once = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
        engine = llm.llm_engine
        engine.add_request("streamed", PROMPTS[0], params, stream=True)
        texts = []
        while engine.has_unfinished_requests():
            texts += [o.outputs[0].text for o in engine.step() if o.request_id == "streamed"]
        want = text_after_prompt(tok, prompt, ids) if keep else expected
        assert once.token_ids == ids and once.text == texts[-1] == want, (keep, stop, once.text, texts)
        assert all(want.startswith(t) for t in texts)
