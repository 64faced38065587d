"""Logprobs carry vLLM's `Logprob` fields: `.logprob`, `.rank` (the count of vocabulary tokens at least as likely:
1 for the argmax) and `.decoded_token` (the token's text alone: set in every output LLMEngine.step returns, so
LLM.generate's too, when the engine has a tokenizer; the server's engine process leaves it to the HTTP process),
while staying floats. References: HF transformers' teacher-forced log_softmax (ranks counted in torch from it) and
the tokenizer's own decode; the sampled and the prompt tokens' logprobs, both backends."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from transformers import AutoTokenizer

from metainfer import LLM, SamplingParams
from metainfer.entrypoints.openai.engine_core import EngineCore
from metainfer.outputs import Logprob
from tests.helpers.detok_reference import token_pieces
from tests.helpers.engine_checks import BACKENDS, decoded_token_matches
from tests.helpers.tiny_models import hf_logprob_rows, logprob_reference

VOCAB = 509


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return logprob_reference(str(tmp_path_factory.mktemp("logprob-fields")), VOCAB)


def _assert_entry(entry: dict, token: int, row: torch.Tensor, k: int, tok) -> None:
    """One position's {token: Logprob}: the scored token's value and rank from HF's row, the top k ranked 1..k."""
    assert all(isinstance(v, Logprob) for v in entry.values())
    chosen = entry[token]
    assert chosen.logprob == pytest.approx(row[token].item(), abs=1e-4) and chosen == chosen.logprob
    # vLLM's rank: tokens at least as likely as it (itself included); fp32 noise only moves near-ties
    assert int((row > row[token] + 1e-4).sum()) + 1 <= chosen.rank <= int((row >= row[token] - 1e-4).sum())
    top = row.topk(k).indices.tolist()
    for rank, t in enumerate(top, 1):
        assert entry[t].rank == rank and entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
    for t, value in entry.items():
        assert decoded_token_matches(tok, t, value.decoded_token) if tok else value.decoded_token is None


def _assert_output(out, prompt: list[int], model, tok) -> None:
    """A finished RequestOutput asked for logprobs=3 and prompt_logprobs=2: every sampled and prompt position against
    HF's teacher-forced row (_assert_entry), the first prompt position None."""
    generated = out.outputs[0].token_ids
    rows = hf_logprob_rows(model, prompt + generated)
    for i, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
        _assert_entry(entry, token, rows[len(prompt) - 1 + i], 3, tok)
    assert out.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        _assert_entry(out.prompt_logprobs[i], prompt[i], rows[i - 1], 2, tok)


@pytest.mark.parametrize("device", BACKENDS)
def test_sampled_and_prompt_logprobs_carry_rank_and_text(reference, device):
    folder, model, prompts = reference
    tok = AutoTokenizer.from_pretrained(folder)
    llm = LLM(folder, device=device, dtype="float32", max_model_len=128)
    try:
        params = SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            _assert_output(out, prompt, model, tok)
        # sampling at temperature 0.8 from a tiny random model picks tokens below the top: ranks above 1 are checked
        assert any(e[t].rank > 1 for o in outs for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs))
    finally:
        llm.close()


def test_no_tokenizer_leaves_decoded_token_none(reference):
    folder, model, prompts = reference
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    try:
        out = llm.generate({"prompt_token_ids": prompts[0]},
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2),
                           use_tqdm=False)[0]
        rows = hf_logprob_rows(model, prompts[0] + out.outputs[0].token_ids)
        for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            _assert_entry(entry, token, rows[len(prompts[0]) - 1 + i], 2, None)
            assert entry[token].rank == 1  # greedy: the argmax
    finally:
        llm.close()


def test_logprob_is_a_float_that_pickles_and_serialises():
    lp = Logprob(-1.25, rank=4, decoded_token=" the")
    assert lp == -1.25 and lp.logprob == -1.25 and isinstance(lp.logprob, float) and lp + 1.0 == -0.25
    back = pickle.loads(pickle.dumps({7: lp}))[7]
    assert isinstance(back, Logprob) and (back.logprob, back.rank, back.decoded_token) == (-1.25, 4, " the")
    assert json.loads(json.dumps({"v": lp})) == {"v": -1.25}
    assert "rank=4" in repr(lp) and Logprob(0.0).rank is None and Logprob(0.0).decoded_token is None


def _texts_of(out) -> list[tuple[int, str | None]]:
    """(id, decoded_token) of every Logprob an output carries: its samples' logprobs and its prompt logprobs."""
    entries = [e for c in out.outputs for e in (c.logprobs or [])] + [e for e in (out.prompt_logprobs or []) if e]
    return [(t, v.decoded_token) for e in entries for t, v in e.items()]


def _drive(engine, stream: bool, params: SamplingParams, prompts: list[list[int]], **kw) -> dict[str, list]:
    """Every RequestOutput step() returns for `prompts` added through LLMEngine.add_request, per request."""
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, stream=stream, **kw)
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


@pytest.mark.parametrize("stream", [True, False])
def test_engine_step_outputs_carry_decoded_tokens(reference, stream):
    """LLMEngine.add_request + step(), streamed or not: every output's logprobs and prompt logprobs have
    decoded_token = the tokenizer's own decode of that id alone (vLLM's output processor fills it the same way; an id
    that alone is an incomplete character gets its text in context, checked exactly by the byte-token test), on every
    streamed output, not only the last; the values are HF's (ranks and logprobs as above)."""
    folder, model, prompts = reference
    tok = AutoTokenizer.from_pretrained(folder)
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128)
    try:
        params = SamplingParams(temperature=0.8, seed=7, max_tokens=5, ignore_eos=True, logprobs=3, prompt_logprobs=2)
        seen = _drive(llm.llm_engine, stream, params, prompts)
        for prompt, outs in zip(prompts, seen.values()):
            assert outs[-1].finished and (len(outs) == 5 if stream else len(outs) == 1)
            for out in outs:
                pairs = _texts_of(out)
                assert pairs and all(decoded_token_matches(tok, t, text) for t, text in pairs)
            _assert_output(outs[-1], prompt, model, tok)
        # the texts checked include spaces and ids that alone are partial UTF-8 pieces, not only plain words
        pairs = [p for o in seen.values() for p in _texts_of(o[-1])]
        assert any(text.startswith(" ") for _, text in pairs)
        assert any(tok.decode([t]).endswith("\ufffd") for t, _ in pairs)
        # a request without logprobs has none to fill
        plain = _drive(llm.llm_engine, stream, SamplingParams(temperature=0.0, max_tokens=2), prompts[:1])["r0"][-1]
        assert plain.outputs[0].logprobs is None and plain.prompt_logprobs is None
    finally:
        llm.close()


def test_engine_without_tokenizer_or_told_not_to_leaves_decoded_token_none(reference):
    """skip_tokenizer_init: nothing to decode with; decode_logprobs=False (how the server's engine process adds
    its requests): the ids stay undecoded, the values and ranks do not change."""
    folder, model, prompts = reference
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    for kw, llm_kw in (({}, {"skip_tokenizer_init": True}), ({"decode_logprobs": False}, {})):
        llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, **llm_kw)
        try:
            for stream in (True, False):
                out = _drive(llm.llm_engine, stream, params, prompts[:1], **kw)["r0"][-1]
                pairs = _texts_of(out)
                assert pairs and all(text is None for _, text in pairs)
                generated = out.outputs[0].token_ids
                rows = hf_logprob_rows(model, prompts[0] + generated)
                for i, (token, entry) in enumerate(zip(generated, out.outputs[0].logprobs)):
                    _assert_entry(entry, token, rows[len(prompts[0]) - 1 + i], 2, None)
        finally:
            llm.close()


def test_server_engine_core_sends_undecoded_logprobs(reference):
    """The server's engine process (EngineCore) adds its requests with decode_logprobs=False: the logprob dicts
    it ships, per token and in the final Delta, carry no text (the HTTP process renders its own token strings), while
    LLM.generate on the same engine still gets them."""
    folder, _, prompts = reference
    tok = AutoTokenizer.from_pretrained(folder)

    class Pipe:
        def __init__(self):
            self.sent = []

        def send(self, msg):
            self.sent.append(msg)

    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128)
    try:
        pipe = Pipe()
        core = EngineCore(llm.llm_engine, None, pipe)
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=1)
        assert core._add([("s0", {"prompt_token_ids": prompts[1]}, params)]) is None
        while llm.llm_engine.has_unfinished_requests():
            core._step()
        deltas = [d for kind, *rest in pipe.sent if kind == "step" for d in rest[0]]
        assert deltas and deltas[-1][1]  # the last is the finished request's
        dicts = [e for d in deltas for seq in d[4] for e in (seq[1] or [])] + [e for d in deltas for e in (d[5] or [])
                                                                              if e]
        assert len([e for d in deltas for seq in d[4] for e in (seq[1] or [])]) == 4
        assert dicts and all(v.decoded_token is None for e in dicts for v in e.values())
        out = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
        assert all(decoded_token_matches(tok, t, text) for t, text in _texts_of(out)) and _texts_of(out)
    finally:
        llm.close()


def _byte_ids(tok, text: str) -> list[int]:
    """`text` as byte-level BPE's single-byte tokens (one id per UTF-8 byte, all below 256 in Qwen's vocabulary, so
    a tiny model's embedding holds them): GPT-2's printable stand-in for each byte, written out here."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    stand_in = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    ids = [tok.convert_tokens_to_ids(stand_in[b]) for b in text.encode()]
    assert tok.decode(ids) == text and max(ids) < VOCAB
    return ids


@pytest.mark.parametrize("async_scheduling", [False, True])  # True: the token read back has a pending one after it
def test_byte_tokens_of_multibyte_characters_join_to_the_text(reference, async_scheduling):
    """A character of several UTF-8 bytes, one token a byte: each byte decodes alone to U+FFFD, so decoded_token is
    what the token adds to the text after the ids before it (vLLM's correction): the bytes before the last add ""
    (or the space they complete), the last adds the character, and the prompt's pieces join to the tokenizer's own
    decode of the prompt past its first token. Sampled tokens get theirs from the ids before them too: a sampled
    sequence re-scored as a prompt gives each token the same text as when it was sampled, and they join to the text
    (a lead byte left unfinished: the token after it carries its U+FFFD)."""
    folder, _, _ = reference
    tok = AutoTokenizer.from_pretrained(folder)
    chars = "é🦜“鸚"
    prompt = _byte_ids(tok, "Say " + chars + " ok")
    assert all(tok.decode([t]).endswith("\ufffd") for t in _byte_ids(tok, chars))
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, async_scheduling=async_scheduling)
    try:
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=1),
                           use_tqdm=False)[0]
        pieces = [out.prompt_logprobs[i][prompt[i]].decoded_token for i in range(1, len(prompt))]
        text = tok.decode(prompt)
        assert "".join(pieces) == text[len(tok.decode(prompt[:1])):]
        assert pieces[:3] == ["a", "y", " "] and pieces[-3:] == [" ", "o", "k"]  # one-byte characters: themselves
        by_char, at = [], 3
        for ch in chars:
            n = len(ch.encode())
            by_char.append(pieces[at:at + n])
            at += n
        assert by_char == [[""] * (len(ch.encode()) - 1) + [ch] for ch in chars]

        # the alternatives a position lists: each one's text is what it gets as the scored token after the same ids
        listed = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=3),
                              use_tqdm=False)[0].prompt_logprobs
        alternatives = [(p, t) for p in range(4, len(prompt) - 3) for t in listed[p] if t != prompt[p]]
        assert any(tok.decode([t]).endswith("\ufffd") for _, t in alternatives)
        scored = llm.generate([{"prompt_token_ids": prompt[:p] + [t]} for p, t in alternatives],
                              SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        assert [listed[p][t].decoded_token for p, t in alternatives] == [
            out.prompt_logprobs[p][t].decoded_token for (p, t), out in zip(alternatives, scored)]

        # sampled tokens: the generated ids, re-scored as a prompt, get the same texts as when they were sampled
        # sampled among the two bytes of "é" only, so some pairs complete the character and others do not
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, logprobs=0,
                                allowed_token_ids=_byte_ids(tok, "é"))
        sampled = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        again = llm.generate({"prompt_token_ids": prompt + list(sampled.token_ids)},
                             SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        as_sampled = [e[t].decoded_token for t, e in zip(sampled.token_ids, sampled.logprobs)]
        as_prompt = [again.prompt_logprobs[len(prompt) + i][t].decoded_token for i, t in enumerate(sampled.token_ids)]
        # they are their slices of the text after the prompt (token_pieces, from the tokenizer's decode): é after a
        # lead byte left unfinished carries its U+FFFD, and the last token of this length-finished text keeps the
        # U+FFFDs it ends with; re-scored as a prompt (whose text goes on) the last one holds them back
        text, want, _ = token_pieces(tok, prompt, list(sampled.token_ids))
        assert as_sampled == want and "".join(as_sampled) == text
        assert as_sampled[:-1] == as_prompt[:-1]
        assert as_sampled[-1] == as_prompt[-1] + text[len(text.rstrip("\ufffd")):]
        assert "" in as_sampled and any(p.endswith("é") for p in as_sampled), "the sample must complete é"
        assert "\ufffdé" in as_sampled, "the sample must leave a character unfinished before one it completes"
    finally:
        llm.close()


def _partial_runs(tok, ids: list[int]) -> list[int]:
    """The lengths of the runs of ids whose decode alone is partial (U+FFFD in it)."""
    return [len(run) for run in "".join("p" if "\ufffd" in tok.decode([t]) else "w" for t in ids).split("w") if run]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampled_token_texts_are_slices_of_the_text_after_long_runs_and_before_a_stop_token(reference,
                                                                                           async_scheduling):
    """Sampled among 😀's four bytes and "!": runs of byte tokens longer than any fixed window, characters that
    complete and ones that never do. Each sampled decoded_token is its slice of the text (token_pieces, from the
    tokenizer's decode after the prompt: the token after an unfinished character carries its U+FFFDs, none twice, and
    the last token of a length-finished text keeps those it ends with). With "!" as a stop token whose text is left
    out, the token before it ends the text (it keeps those U+FFFDs) and the stop token's text is its own decode, as
    vLLM gives it; kept (include_stop_str_in_output), it ends the text itself. Streamed, the last output says the
    same."""
    folder, _, _ = reference
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = _byte_ids(tok, "Say ok")
    bang = _byte_ids(tok, "!")[0]
    allowed = [*_byte_ids(tok, "😀"), bang]
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, async_scheduling=async_scheduling)
    try:
        base = dict(temperature=1.0, max_tokens=40, ignore_eos=True, logprobs=1, allowed_token_ids=allowed)
        outs = llm.generate([{"prompt_token_ids": prompt}] * 20, [SamplingParams(seed=s, **base) for s in range(20)],
                            use_tqdm=False)
        long_runs = 0
        for out in outs:
            c = out.outputs[0]
            text, want, _ = token_pieces(tok, prompt, list(c.token_ids))
            assert [e[t].decoded_token for t, e in zip(c.token_ids, c.logprobs)] == want and c.text == text
            long_runs += max(_partial_runs(tok, c.token_ids[:-1]), default=0) > 8
        assert long_runs >= 3, "the samples must hold runs of partial ids longer than 8"

        stops = dict(base, max_tokens=12, allowed_token_ids=[_byte_ids(tok, "é")[0], bang], stop_token_ids=[bang])
        seeds = [SamplingParams(seed=s, **stops) for s in range(40)]
        outs = llm.generate([{"prompt_token_ids": prompt}] * 40, seeds, use_tqdm=False)
        seed, ids = next((p.seed, list(o.outputs[0].token_ids)) for p, o in zip(seeds, outs)
                         if len(o.outputs[0].token_ids) > 2 and o.outputs[0].stop_reason == bang)
        for keep in (False, True):
            params = SamplingParams(seed=seed, include_stop_str_in_output=keep, **stops)
            c = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
            text, want, _ = token_pieces(tok, prompt, ids if keep else ids[:-1])
            if not keep:
                want += ["!"]
            assert list(c.token_ids) == ids and c.text == text and text.endswith("\ufffd" if not keep else "!")
            assert [e[t].decoded_token for t, e in zip(c.token_ids, c.logprobs)] == want
            engine = llm.llm_engine
            engine.add_request("streamed", {"prompt_token_ids": prompt}, params, stream=True)
            last = None
            while engine.has_unfinished_requests():
                last = next((o for o in engine.step() if o.request_id == "streamed"), last)
            streamed = last.outputs[0]
            assert [e[t].decoded_token for t, e in zip(streamed.token_ids, streamed.logprobs)] == want
    finally:
        llm.close()
