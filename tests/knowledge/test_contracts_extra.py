"""Contracts no other test pinned down, found by the failure-mode library (metainfer/knowledge): each test
here catches a mode of the failure-mode library that the rest of the suite let survive. Every check is against
an independent reference: HF transformers, a hand-written formula, or the engine's own unconstrained run.

- RMSNorm with a large eps (the tiny models' 1e-6 hides where eps goes);
- models whose rms_norm_eps is far from 1e-6: every norm must read it, except DeepSeek's latent norms, which
  transformers builds with the default 1e-6 (first-token logprobs against HF's log-softmax);
- a stop string whose characters arrive in two different tokens;
- generation stopping at the EOS id that config.json names (every other test sets ignore_eos).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from metainfer import LLM, SamplingParams
from metainfer.engine.llm_engine import LLMEngine
from metainfer.kernels import rms_norm_ref
from tests.helpers.engine_checks import assert_drained
from tests.helpers.tiny_models import build_tiny_model, copy_model_files, hf_greedy, make_prompts


def test_rms_norm_ref_honours_a_large_eps():
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    g = torch.Generator().manual_seed(0)
    x, w = 0.3 * torch.randn(5, 32, generator=g), 1 + 0.2 * torch.randn(32, generator=g)
    eps = 0.5  # of the order of mean(x^2): where eps is added matters
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + eps) * w.double()
    torch.testing.assert_close(rms_norm_ref(x, w, eps).double(), expected, rtol=1e-6, atol=1e-7)
    norm = qwen3.Qwen3RMSNorm(32, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(w)
        torch.testing.assert_close(rms_norm_ref(x, w, eps), norm(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v2"])
def test_large_eps_models_match_hf_logprobs(arch, tmp_path):
    """rms_norm_eps 0.5: each norm's eps changes the logits far beyond the 1e-4 tolerance."""
    folder = str(tmp_path)
    model = build_tiny_model(folder, arch, rms_norm_eps=0.5)
    prompts = make_prompts([5, 17], seed=3)
    expected = hf_greedy(model, prompts, 4)
    llm = LLM(folder, device="cpu", dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=4, logprobs=5, ignore_eos=True), use_tqdm=False)
    assert_drained(llm)
    with torch.no_grad():
        for prompt, out, ref in zip(prompts, outs, expected):
            hf = model(torch.tensor([prompt])).logits[0, -1].double().log_softmax(-1)
            first = out.outputs[0].logprobs[0]
            for token, logprob in first.items():
                assert logprob == pytest.approx(hf[token].item(), abs=1e-4), (arch, token)
            assert out.outputs[0].token_ids[0] == ref[0]


def test_stop_string_straddling_tokens_is_found():
    """The match may start in text an earlier token produced (the contract of _cut_at_stop_string)."""

    class Seq:
        output_text = "hello world"
        params = SamplingParams(stop=["wor"])
        stop_reason = None

    seq = Seq()
    assert LLMEngine._cut_at_stop_string(seq, len("hello wo"))  # "wo" came before, "rld" is the new text
    assert seq.output_text == "hello " and seq.stop_reason == "wor"


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3"))
    build_tiny_model(folder, "qwen3", initializer_range=0.1)
    return folder


def _stream_texts(llm, prompt, params) -> list[str]:
    """The output text after every step of one streamed request."""
    engine = llm.llm_engine
    engine.add_request("r", {"prompt_token_ids": prompt}, params, stream=True)
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
    return texts


def test_stop_string_split_across_tokens_through_the_engine(tiny_qwen3):
    llm = LLM(tiny_qwen3, device="cpu", dtype="float32")
    prompt = make_prompts([9], seed=5)[0]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    texts = _stream_texts(llm, prompt, greedy)
    full = texts[-1]
    # a boundary between two tokens' text whose two neighbouring characters first occur there
    cuts = [len(t) for t in texts if 0 < len(t) < len(full)]
    straddle = [b for b in cuts if full.find(full[b - 1:b + 1]) == b - 1]
    if not straddle:
        pytest.skip("no token boundary with a unique two-character straddle in this output")
    b = straddle[0]
    stop = full[b - 1:b + 1]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                                    stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: b - 1]
    assert_drained(llm)


def test_generation_stops_at_config_eos(tiny_qwen3, tmp_path):
    prompt = {"prompt_token_ids": make_prompts([7], seed=6)[0]}
    full = LLM(tiny_qwen3, device="cpu", dtype="float32").generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    eos = full[3]
    first = full.index(eos)
    copy_model_files(tiny_qwen3, str(tmp_path))
    config_path = os.path.join(tmp_path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["eos_token_id"] = eos
    with open(config_path, "w") as f:
        json.dump(config, f)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == full[: first + 1]
    ignored = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == full and ignored.finish_reason == "length"
    assert_drained(llm)
