"""tools/server_jitter: a paced real engine behind the real HTTP process; every token reaches the client (the text
each request streamed equals HF's greedy answer, decoded, and the server counts every token asked for), and the
engine's and the server's histograms are read back.

Chunks are not tokens: a token that ends inside a character streams in a chunk with empty text, and an HTTP consumer
that falls behind the engine sends several steps' tokens in one chunk (by design: test_output_handoff), so a loaded
machine gives fewer client chunks than tokens (once 40 against 44) without losing any. Only the text tells."""

import argparse

import pytest
import torch
import transformers

from metainfer.bench.serve import _add_arguments, make_payloads
from tests.helpers.detok_reference import text_after_prompt
from tests.helpers.tiny_models import hf_greedy
from tools.serve_overhead import build_model
from tools.server_jitter import measure

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 16, 12


def _hf_texts(model_dir: str) -> list[str]:
    """The text of each request `bench serve` sends (its token-id prompts, rebuilt from its own defaults: seed 0):
    HF's greedy OUTPUT_LEN tokens, as the server's text is, the tokenizer's decode of prompt + output past the
    prompt's (text_after_prompt: a prompt that ends inside a character, or a decoder that joins across the prompt's
    end, gives a text other than the output's decode alone)."""
    parser = argparse.ArgumentParser()
    _add_arguments(parser)
    bench_args = parser.parse_args(["--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN),
                                    "--output-len", str(OUTPUT_LEN)])
    prompts = [payload["prompt"] for payload in make_payloads(bench_args, "tiny")]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return [text_after_prompt(tokenizer, prompt, list(ids))
            for prompt, ids in zip(prompts, hf_greedy(model, prompts, OUTPUT_LEN))]


@pytest.mark.slow  # an engine process, a server and a client process
def test_every_token_reaches_the_client(tmp_path):
    build_model(str(tmp_path))
    args = argparse.Namespace(tick_ms=5.0, streams=2, num_prompts=NUM_PROMPTS, input_len=INPUT_LEN,
                              output_len=OUTPUT_LEN, max_mixed_prefill_tokens=256, loop="asyncio", http="h11")
    detailed = {}
    result = measure(args, str(tmp_path), detailed)
    assert (result["loop"], result["http"]) == ("asyncio", "h11") and result["http_process_cpu_us_per_token"] > 0
    assert detailed["errors"] == [""] * NUM_PROMPTS and detailed["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert detailed["generated_texts"] == _hf_texts(str(tmp_path))  # no token's text lost, none twice
    # at most one chunk a token (one a step for each request, fewer where the HTTP process merged steps)
    assert 0 < result["client_itl"]["count"] <= NUM_PROMPTS * (OUTPUT_LEN - 1)
    assert result["server_itl"]["count"] >= NUM_PROMPTS * (OUTPUT_LEN - 1)  # + the warm-up request's
    assert result["engine_step_interval"]["count"] > 0 and result["engine_step_interval"]["p50_ms"] >= 4.0
