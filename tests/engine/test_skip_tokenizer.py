"""`skip_tokenizer_init` (vLLM's option): an engine with no tokenizer runs token-id prompts, matches HF's greedy
output, stops on the config's EOS id, gives empty text, and refuses what needs text in one line."""

from __future__ import annotations

import json
import os

import pytest

from metainfer import LLM, SamplingParams
from metainfer.entrypoints import cli
from tests.helpers.tiny_models import copy_model_files, hf_reference

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "special_tokens_map.json")
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """A tiny Qwen3 copied into a folder without tokenizer files, with HF's greedy continuations."""
    source = str(tmp_path_factory.mktemp("skiptok-src"))
    model, prompts, expected = hf_reference(source, "qwen3", [5, 17, 33], NEW_TOKENS)
    folder = tmp_path_factory.mktemp("skiptok")
    copy_model_files(source, str(folder))
    for name in TOKENIZER_FILES:
        (folder / name).unlink(missing_ok=True)
    return str(folder), prompts, expected


def _set_eos(folder: str, eos: int, names: tuple[str, ...]) -> None:
    """eos_token_id = eos in the named files, and no EOS id at all in the others."""
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(folder, name)
        data = {}
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
        data["eos_token_id"] = eos if name in names else None
        with open(path, "w") as f:
            json.dump(data, f)


def test_token_ids_in_token_ids_out_match_hf(no_tokenizer):
    folder, prompts, expected = no_tokenizer
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    try:
        assert llm.get_tokenizer() is None
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert all(o.outputs[0].text == "" and o.prompt is None for o in outs)
        # a streamed request (the engine's own loop) goes through the same empty detokenizer
        engine = llm.llm_engine
        engine.add_request("streamed", prompts[0], greedy, stream=True)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        llm.close()


@pytest.mark.parametrize("where", [("config.json",), ("generation_config.json",)])
def test_stop_token_comes_from_the_config(no_tokenizer, tmp_path, where):
    """With no tokenizer, the EOS id is the config's or the generation config's (where chat models list their
    end-of-turn token): set it to HF's third greedy token in one of them and the request ends there."""
    folder, prompts, expected = no_tokenizer
    copy_model_files(folder, str(tmp_path))
    eos = expected[0][2]
    _set_eos(str(tmp_path), eos, where)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    try:
        out = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS),
                           use_tqdm=False)[0].outputs[0]
        first = expected[0].index(eos)
        assert out.token_ids == expected[0][: first + 1] and out.finish_reason == "stop"
    finally:
        llm.close()


def test_what_needs_text_is_refused_and_the_engine_keeps_serving(no_tokenizer):
    folder, prompts, expected = no_tokenizer
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    try:
        with pytest.raises(ValueError, match="text prompt needs a tokenizer.*prompt_token_ids"):
            llm.generate("hello", use_tqdm=False)
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(stop=["x"]), use_tqdm=False)
        with pytest.raises(ValueError, match="chat needs a tokenizer"):
            llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
        greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompts[1]}, greedy, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected[1]
    finally:
        llm.close()


def test_skip_and_a_tokenizer_folder_contradict(no_tokenizer):
    folder, _, _ = no_tokenizer
    with pytest.raises(ValueError, match="skip_tokenizer_init=True builds no tokenizer.*pass one of them"):
        LLM(folder, device="cpu", skip_tokenizer_init=True, tokenizer=folder)


def test_bench_latency_on_a_config_only_folder(no_tokenizer, tmp_path, capsys):
    """A config-only folder (no weights, no tokenizer) benches with dummy weights and --skip-tokenizer-init; without
    the option it names --tokenizer."""
    folder, _, _ = no_tokenizer
    copy_model_files(folder, str(tmp_path), weights=False)
    args = ["bench", "latency", "--model", str(tmp_path), "--device", "cpu", "--dtype", "float32",
            "--load-format", "dummy", "--input-len", "8", "--output-len", "4", "--iters", "1", "--warmup", "0",
            "--max-model-len", "64"]
    assert cli.main(args) == 2
    assert "--skip-tokenizer-init" in capsys.readouterr().err
    record = str(tmp_path / "latency.json")
    assert cli.main([*args, "--skip-tokenizer-init", "--output-json", record]) == 0
    with open(record) as f:
        assert json.load(f)["tpot_ms"] > 0


def test_the_server_refuses_it_before_building_an_engine(no_tokenizer):
    """The server encodes prompts and decodes text: build_app refuses skip_tokenizer_init (kwargs: before any engine
    process starts; an LLM: before its engine core starts)."""
    pytest.importorskip("fastapi")
    from metainfer.entrypoints.openai.api_server import build_app

    folder, _, _ = no_tokenizer
    with pytest.raises(ValueError, match="skip_tokenizer_init=True: the server needs a tokenizer"):
        build_app({"model": folder, "device": "cpu", "skip_tokenizer_init": True})
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=64, skip_tokenizer_init=True)
    try:
        with pytest.raises(ValueError, match="the server needs a tokenizer"):
            build_app(llm)
    finally:
        llm.close()
