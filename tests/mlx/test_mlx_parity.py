"""MLX backend parity: fp32 greedy tokens equal HF transformers' on tiny random Qwen3, Qwen2 and Llama models
(llama3, linear and yarn rope scaling and an untied head included), and the MLX path equals the torch CPU path: greedy
tokens, every SamplingParams feature through the shared sampler, logprobs to fp32 noise."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'mlx[cpu]')")

from metainfer import LLM, SamplingParams  # noqa: E402
from tests.helpers.engine_checks import assert_drained, generate_ids  # noqa: E402
from tests.helpers.tiny_models import LLAMA3_ROPE, YARN_ROPE, assert_matches_hf, hf_reference, make_prompts  # noqa: E402

CASES = {
    "qwen3": ("qwen3", {}),
    "qwen2": ("qwen2", {}),
    "llama": ("llama", {}),
    "llama3-rope-untied": ("llama", {"rope_parameters": dict(LLAMA3_ROPE), "tie_word_embeddings": False}),
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen2-linear-rope": ("qwen2", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}),
    "llama-yarn-rope": ("llama", {"rope_parameters": dict(YARN_ROPE)}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_hf_fp32(tmp_path, case):
    arch, overrides = CASES[case]
    model, prompts, expected = hf_reference(str(tmp_path), arch, [1, 5, 17, 33, 64], 24, **overrides)
    llm = LLM(str(tmp_path), device="mlx", dtype="float32", num_kv_blocks=64)
    got = generate_ids(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert_matches_hf(model, prompts, got, expected)
    assert_drained(llm)


def test_chunked_prefill_and_one_at_a_time_match_hf(tmp_path):
    """A 16-token step budget chunks the prompts (and mixes them with decode rows); sequences alone or together
    give HF's tokens."""
    model, prompts, expected = hf_reference(str(tmp_path), "qwen3", [40, 9, 27], 16)
    chunked = LLM(str(tmp_path), device="mlx", dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16,
                  max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    assert_matches_hf(model, prompts, generate_ids(chunked, prompts, params), expected)
    alone = [generate_ids(chunked, [p], params)[0] for p in prompts]
    assert_matches_hf(model, prompts, alone, expected)
    assert_drained(chunked)


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("mlx-vs-torch"))
    hf_reference(folder, "qwen2", [], 1)
    kw = dict(dtype="float32", num_kv_blocks=128, max_model_len=256)
    return LLM(folder, device="mlx", **kw), LLM(folder, device="cpu", **kw)


SAMPLING = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
    "top-k-top-p": SamplingParams(temperature=1.0, top_k=20, top_p=0.8, seed=3, max_tokens=20, ignore_eos=True),
    "min-p": SamplingParams(temperature=1.2, min_p=0.1, seed=5, max_tokens=20, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                                frequency_penalty=0.4, max_tokens=20, ignore_eos=True),
    "stop-id": SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[100, 200, 300]),
    "n2": SamplingParams(temperature=0.9, n=2, seed=11, max_tokens=12, ignore_eos=True),
}


@pytest.mark.parametrize("name", list(SAMPLING))
def test_mlx_equals_the_torch_cpu_path(both, name):
    mlx_llm, torch_llm = both
    prompts = [{"prompt_token_ids": p} for p in make_prompts([3, 18, 35], seed=2)]
    params = SAMPLING[name]
    got = mlx_llm.generate(prompts, params, use_tqdm=False)
    ref = torch_llm.generate(prompts, params, use_tqdm=False)
    for g, r in zip(got, ref):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in r.outputs]
        assert [o.finish_reason for o in g.outputs] == [o.finish_reason for o in r.outputs]
    assert_drained(mlx_llm)


def test_logprobs_match_the_torch_cpu_path(both):
    mlx_llm, torch_llm = both
    prompts = [{"prompt_token_ids": p} for p in make_prompts([6, 21], seed=4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    for g, r in zip(mlx_llm.generate(prompts, params, use_tqdm=False),
                    torch_llm.generate(prompts, params, use_tqdm=False)):
        go, ro = g.outputs[0], r.outputs[0]
        assert go.token_ids == ro.token_ids
        assert go.cumulative_logprob == pytest.approx(ro.cumulative_logprob, abs=1e-3)
        for gs, rs in zip(go.logprobs, ro.logprobs):
            assert gs.keys() == rs.keys()
            for k in gs:
                assert gs[k] == pytest.approx(rs[k], abs=1e-4)


def test_compiled_and_eager_decode_agree_and_engines_do_not_share_steps(tmp_path):
    """The compiled decode step (default) and enforce_eager give HF's tokens; two live engines over different
    models in one process keep their own compiled steps (same shapes, different weights)."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    model_a, prompts, expected_a = hf_reference(str(a), "qwen3", [5, 21], 20)
    model_b, _, _ = hf_reference(str(b), "qwen3", [], 1, seed=1)
    from tests.helpers.tiny_models import hf_greedy

    expected_b = hf_greedy(model_b, prompts, 20)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    compiled_a = LLM(str(a), device="mlx", dtype="float32", num_kv_blocks=32)
    compiled_b = LLM(str(b), device="mlx", dtype="float32", num_kv_blocks=32)
    eager_a = LLM(str(a), device="mlx", dtype="float32", num_kv_blocks=32, enforce_eager=True)
    for _ in range(2):
        assert_matches_hf(model_a, prompts, generate_ids(compiled_a, prompts, params), expected_a)
        assert_matches_hf(model_b, prompts, generate_ids(compiled_b, prompts, params), expected_b)
    assert generate_ids(eager_a, prompts, params) == generate_ids(compiled_a, prompts, params)


def test_greedy_with_min_tokens_masks_stop_ids_like_the_torch_sampler(both):
    """The MLX-side greedy path masks a row's stop ids until min_tokens: the stop id chosen here is a token the
    unconstrained run produces early, so the mask changes the output; MLX equals torch and runs past it."""
    mlx_llm, torch_llm = both
    prompts = [{"prompt_token_ids": p} for p in make_prompts([9, 26], seed=8)]
    free = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, SAMPLING["greedy"], use_tqdm=False)]
    stop = free[0][2]
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10, stop_token_ids=[stop])
    got = mlx_llm.generate(prompts, params, use_tqdm=False)
    ref = torch_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert len(got[0].outputs[0].token_ids) >= 10 and got[0].outputs[0].token_ids[2] != stop


def test_a_decode_step_runs_several_rows_together(tmp_path):
    """Batched decoding really batches: a hook on the runner's decode forward records each step's rows; with
    three prompts some step carries all three, and the tokens still equal HF's."""
    model, prompts, expected = hf_reference(str(tmp_path), "qwen3", [3, 9, 20], 12)
    llm = LLM(str(tmp_path), device="mlx", dtype="float32", num_kv_blocks=64)
    runner = llm.llm_engine.runner
    forward, rows = runner._decode_forward, []

    def counting(ids, *args):
        rows.append(ids.shape[0])
        return forward(ids, *args)

    runner._decode_forward = counting
    got = generate_ids(llm, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert_matches_hf(model, prompts, got, expected)
    assert rows and max(rows) == 3, rows
