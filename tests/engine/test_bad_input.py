"""Bad input raises a ValueError naming the problem; the same LLM then serves a valid request."""

from __future__ import annotations

import json

import pytest

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import assert_drained
from tests.helpers.tiny_models import build_tiny_model, copy_model_files


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3bad"))
    build_tiny_model(folder, "qwen3")
    return folder, LLM(folder, device="cpu", dtype="float32", max_model_len=64)


OK = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("prompt, params, message", [
    ({"prompt_token_ids": list(range(100))}, OK, "longer than max_model_len"),
    ("", OK, "prompt must not be empty"),
    ({"prompt_token_ids": []}, OK, "prompt_token_ids must not be empty"),
    ({"prompt_token_ids": [1, 99999]}, OK, "prompt_token_ids contain ids outside"),
])
def test_bad_prompt(setup, prompt, params, message):
    _, llm = setup
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, OK, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_drained(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"top_k": -3}, "top_k"), ({"n": 0}, "n"),
    ({"min_p": 2.0}, "min_p"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("max_tokens", 0)])
def test_bad_params_reach_the_engine_then_it_serves(setup, field, value):
    _, llm = setup
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    setattr(params, field, value)  # changed after construction: the engine checks again
    with pytest.raises(ValueError, match=field):
        llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, OK, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_load_format_must_match_the_source(setup):
    folder, _ = setup
    with pytest.raises(ValueError, match="load_format='gguf' needs a .gguf model"):
        LLM(folder, device="cpu", load_format="gguf")


def test_batch_with_one_bad_prompt_queues_nothing(setup):
    _, llm = setup
    with pytest.raises(ValueError, match="longer than max_model_len"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": list(range(80))}], OK, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_unknown_architecture(setup, tmp_path):
    folder, _ = setup
    copy_model_files(folder, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*MambaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path), device="cpu")


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="neither a model folder"):
        LLM(str(tmp_path / "nope"), device="cpu")


def test_bad_engine_options(setup):
    folder, _ = setup
    with pytest.raises(ValueError, match="block_size"):
        LLM(folder, device="cpu", block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(folder, device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLM(folder, device="cpu", max_num_batched_tokens=0)
