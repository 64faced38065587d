"""logprobs / prompt_logprobs = -1 (vLLM's): the whole vocabulary, allowed where the engine's max_logprobs is -1 (no
cap) or at least the vocabulary, refused naming the field otherwise. References: HF transformers' teacher-forced
log_softmax (ranks counted in torch from it); the CLI's parser; the server's request checks."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from metainfer import LLM, SamplingParams
from metainfer.entrypoints import cli
from metainfer.entrypoints.openai.errors import OpenAIError
from metainfer.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from metainfer.outputs import Logprob
from metainfer.worker import sampler
from tests.helpers.engine_checks import BACKENDS, decoded_token_matches
from tests.helpers.tiny_models import hf_logprob_rows, logprob_reference

VOCAB = 509


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return logprob_reference(str(tmp_path_factory.mktemp("whole-vocab-logprobs")), VOCAB)


def _assert_whole_vocabulary(entry: dict, row: torch.Tensor) -> None:
    """One position of a -1 request: every id of the vocabulary with HF's value, ranked 1..V, each rank within HF's
    bounds (the ids at least as likely as it, fp32 noise aside: it moves near-ties only)."""
    assert sorted(entry) == list(range(VOCAB)) and all(isinstance(v, Logprob) for v in entry.values())
    ids = torch.tensor(list(entry))
    values = torch.tensor([entry[t].logprob for t in entry])
    ranks = torch.tensor([entry[t].rank for t in entry])
    assert torch.allclose(values, row[ids], atol=1e-4)
    assert sorted(ranks.tolist()) == list(range(1, VOCAB + 1))
    hf = row[ids].unsqueeze(1)
    assert ((row > hf + 1e-4).sum(1) + 1 <= ranks).all() and (ranks <= (row >= hf - 1e-4).sum(1)).all()


def _assert_top(entry: dict, token: int, row: torch.Tensor, k: int, tok) -> None:
    """A position of a request asking for k: the token and HF's top k (ranks 1..k), nothing more."""
    top = row.topk(k).indices.tolist()
    assert set(entry) == set(top) | {token}
    assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
    for rank, t in enumerate(top, 1):
        assert entry[t].rank == rank and entry[t].logprob == pytest.approx(row[t].item(), abs=1e-4)
    assert all(decoded_token_matches(tok, t, v.decoded_token) for t, v in entry.items())


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("device", BACKENDS)
def test_minus_one_is_the_whole_vocabulary(reference, device, wide, monkeypatch):
    """logprobs = prompt_logprobs = -1 under max_logprobs=-1: each sampled and prompt position holds every token of
    the vocabulary with its HF value and rank, beside requests in the same steps that ask for 2 and for 0, which get
    theirs alone. `wide`: the path of a vocabulary beyond WIDE_TOP_K (top lists copied to the host in pieces of
    WIDE_TOP_ROWS rows, read back row by row), taken here by lowering the bounds."""
    if wide:
        monkeypatch.setattr(sampler, "WIDE_TOP_K", 100)
        monkeypatch.setattr(sampler, "WIDE_TOP_ROWS", 3)
    folder, model, prompts = reference
    tok = AutoTokenizer.from_pretrained(folder)
    llm = LLM(folder, device=device, dtype="float32", max_model_len=128, max_logprobs=-1)
    try:
        assert llm.llm_engine.request_limits().max_logprobs == -1
        whole = SamplingParams(temperature=0.8, seed=5, max_tokens=4, ignore_eos=True, logprobs=-1, prompt_logprobs=-1)
        two = SamplingParams(temperature=0.8, seed=6, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2)
        zero = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
        asked = [prompts[1], prompts[0], prompts[0][:3]]
        outs = llm.generate([{"prompt_token_ids": p} for p in asked], [whole, two, zero], use_tqdm=False)
        rows = [hf_logprob_rows(model, p + o.outputs[0].token_ids) for p, o in zip(asked, outs)]

        prompt, out = asked[0], outs[0]
        assert len(out.outputs[0].logprobs) == 4
        for i, entry in enumerate(out.outputs[0].logprobs):
            _assert_whole_vocabulary(entry, rows[0][len(prompt) - 1 + i])
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for i in range(1, len(prompt)):
            _assert_whole_vocabulary(out.prompt_logprobs[i], rows[0][i - 1])
        assert any(e[t].rank > 1 for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs))

        prompt, out = asked[1], outs[1]
        for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            _assert_top(entry, token, rows[1][len(prompt) - 1 + i], 2, tok)
        for i in range(1, len(prompt)):
            _assert_top(out.prompt_logprobs[i], prompt[i], rows[1][i - 1], 2, tok)

        prompt, out = asked[2], outs[2]
        assert out.prompt_logprobs is None
        for i, (token, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            _assert_top(entry, token, rows[2][len(prompt) - 1 + i], 0, tok)
            assert entry[token].rank == 1  # greedy

        if device == "cpu" and not wide:  # under max_logprobs=-1 the vocabulary still bounds a count
            with pytest.raises(ValueError, match=f"prompt_logprobs must be <= {VOCAB}") as err:
                llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1, prompt_logprobs=VOCAB + 1),
                             use_tqdm=False)
            assert err.value.param == "prompt_logprobs"
            out = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1, logprobs=VOCAB),
                               use_tqdm=False)[0]
            _assert_whole_vocabulary(out.outputs[0].logprobs[0], hf_logprob_rows(model, prompts[0])[-1])
    finally:
        llm.close()


def test_minus_one_is_refused_under_a_cap(reference):
    """Under the default max_logprobs (20, below the vocabulary) -1 is refused naming its field, as vLLM's processor
    refuses it, and the engine keeps serving; a cap at the vocabulary allows it. A count or a max_logprobs below -1 is
    refused."""
    folder, _, prompts = reference
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128)
    try:
        for name in ("logprobs", "prompt_logprobs"):
            with pytest.raises(ValueError, match=rf"^{name}=-1 requests the whole vocabulary \({VOCAB} logprobs a "
                                                 r"token\), which is greater than max allowed: 20") as err:
                llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1, **{name: -1}),
                             use_tqdm=False)
            assert err.value.param == name
            with pytest.raises(ValueError, match=f"^{name} must be an integer >= 0 or -1") as err:
                SamplingParams(**{name: -2})
            assert err.value.param == name
        out = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2, logprobs=20),
                           use_tqdm=False)[0]
        assert [len(e) >= 20 for e in out.outputs[0].logprobs] == [True, True]
    finally:
        llm.close()
    capped = LLM(folder, device="cpu", dtype="float32", max_model_len=128, max_logprobs=VOCAB)
    try:
        out = capped.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=1, prompt_logprobs=-1),
                              use_tqdm=False)[0]
        assert all(len(e) == VOCAB for e in out.prompt_logprobs[1:])
    finally:
        capped.close()
    with pytest.raises(ValueError, match="max_logprobs must be >= 0, or -1"):
        LLM(folder, device="cpu", max_logprobs=-2)


def test_cli_max_logprobs_minus_one(reference, capsys):
    folder, _, _ = reference
    for command in ("serve", "generate"):
        args = cli.build_parser().parse_args([command, "--model", folder, "--max-logprobs", "-1"])
        assert cli.engine_kwargs(args)["max_logprobs"] == -1
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    assert "-1: no cap" in " ".join(capsys.readouterr().out.split())


def _param(model, body: dict, max_logprobs: int) -> str | None:
    with pytest.raises(OpenAIError) as e:
        parse_request(json.dumps(body).encode(), model).check_supported(max_logprobs)
    assert e.value.status == 400
    return e.value.param


def test_server_maps_minus_one_as_vllm():
    """Chat's top_logprobs takes -1 (the engine then bounds it by max_logprobs, as vLLM's does); completions'
    logprobs does not (vLLM's: "must be a positive value"); max_logprobs=-1 lifts the server's bound."""
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    for cap in (20, -1):
        req = parse_request(json.dumps({**chat, "top_logprobs": -1}).encode(), ChatCompletionRequest)
        req.check_supported(cap)
        assert req.sampling_params(16, req.top_logprobs).logprobs == -1
        assert _param(ChatCompletionRequest, {**chat, "top_logprobs": -2}, cap) == "top_logprobs"
        assert _param(CompletionRequest, {"prompt": "x", "logprobs": -1}, cap) == "logprobs"
    assert _param(ChatCompletionRequest, {**chat, "logprobs": False, "top_logprobs": -1}, -1) == "top_logprobs"
    assert _param(ChatCompletionRequest, {**chat, "top_logprobs": 21}, 20) == "top_logprobs"
    parse_request(json.dumps({**chat, "top_logprobs": 500}).encode(), ChatCompletionRequest).check_supported(-1)
    parse_request(json.dumps({"prompt": "x", "logprobs": 500}).encode(), CompletionRequest).check_supported(-1)
