"""logit_bias and allowed_token_ids (vLLM's / OpenAI's token constraints) on both backends: greedy output equals
HF transformers' with the same constraint as its own logits processors (SequenceBiasLogitsProcessor for the biases,
PrefixConstrainedLogitsProcessor for the allowed ids), sampled tokens stay inside the allowed ids, and bad values
are refused naming the field."""

from __future__ import annotations

import pytest

from metainfer import LLM, SamplingParams
from tests.helpers.engine_checks import BACKENDS, generate_ids
from tests.helpers.tiny_models import hf_greedy, hf_reference

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("token-constraints"))
    model, prompts, expected = hf_reference(folder, "qwen3", [3, 11, 29], NEW_TOKENS)
    return folder, model, prompts, expected


@pytest.fixture(scope="module", params=BACKENDS)
def llm(request, reference):
    engine = LLM(reference[0], device=request.param, dtype="float32", max_model_len=128)
    yield engine
    engine.close()


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, **kw)


def test_logit_bias_matches_hf_sequence_bias(llm, reference):
    """Push down every token HF chose unconstrained and lift a few others: the output changes, and equals HF's."""
    _, model, prompts, expected = reference
    chosen = sorted({t for out in expected for t in out})
    bias = {t: -4.0 for t in chosen} | {5: 3.0, 77: 2.5, 301: 1.5}
    want = hf_greedy(model, prompts, NEW_TOKENS, sequence_bias={(t,): b for t, b in bias.items()})
    assert want != expected  # the biases moved HF's own choice
    assert generate_ids(llm, prompts, _greedy(logit_bias=bias)) == want


def test_allowed_token_ids_match_hf_prefix_constraint(llm, reference):
    _, model, prompts, expected = reference
    allowed = list(range(100, 160))
    want = hf_greedy(model, prompts, NEW_TOKENS, prefix_allowed_tokens_fn=lambda batch_id, ids: allowed)
    assert want != expected and all(t in allowed for out in want for t in out)
    assert generate_ids(llm, prompts, _greedy(allowed_token_ids=allowed)) == want
    # both in one batch beside an unconstrained request: each row gets only its own constraint
    mixed = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [_greedy(allowed_token_ids=allowed), _greedy(), _greedy(logit_bias={7: 100.0})],
                         use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == want[0]
    assert mixed[1].outputs[0].token_ids == expected[1]
    assert mixed[2].outputs[0].token_ids == [7] * NEW_TOKENS


def test_sampled_tokens_stay_inside_the_allowed_ids(llm, reference):
    _, _, prompts, _ = reference
    allowed = [3, 9, 27, 81, 243]
    params = SamplingParams(temperature=1.5, top_p=0.95, seed=7, max_tokens=40, ignore_eos=True,
                            allowed_token_ids=allowed, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert set(tokens) <= set(allowed) and len(set(tokens)) > 1


def test_bad_values_name_the_field(llm, reference):
    _, _, prompts, expected = reference
    vocab = llm.llm_engine.spec.vocab_size
    cases = [(dict(logit_bias={1: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
             (dict(logit_bias={vocab: 1.0}), "logit_bias"), (dict(logit_bias={1: float("nan")}), "logit_bias"),
             (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[vocab]), "allowed_token_ids"),
             (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids")]
    # every allowed id a stop id while min_tokens masks them: nothing could be sampled
    cases.append((dict(allowed_token_ids=[77], stop_token_ids=[77], min_tokens=2), "allowed_token_ids"))
    for kw, field in cases:
        with pytest.raises(ValueError, match=field):
            llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2, **kw), use_tqdm=False)
    assert generate_ids(llm, prompts[:1], _greedy()) == expected[:1]  # still serving
