"""EngineConfig.step_trace_path (`--step-trace`): every step's launch is written to a JSON file when the engine
closes, so a server's step timeline can be set beside the offline engine's. Checked against what the requests
themselves imply: every prompt token is computed in some prefill row, every step yields one token for each row
that samples, and the launch times only grow."""

from __future__ import annotations

import json
import os

import pytest

from metainfer import LLM, SamplingParams
from metainfer.config import ConfigError
from tests.helpers.tiny_models import build_tiny_model, make_prompts


@pytest.mark.parametrize("num_batched", [64, 24])  # 24: the 40-token prompt is chunked, beside decode rows
def test_trace_accounts_for_every_token(tmp_path, num_batched):
    folder = str(tmp_path / "model")
    build_tiny_model(folder, "qwen3")
    trace_path = str(tmp_path / "trace.json")
    lengths, new_tokens = [7, 13, 40], 5
    prompts = [{"prompt_token_ids": p} for p in make_prompts(lengths)]
    llm = LLM(folder, device="cpu", dtype="float32", max_model_len=128, max_num_batched_tokens=num_batched,
              step_trace_path=trace_path)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    assert not os.path.exists(trace_path)  # written at close
    llm.close()
    with open(trace_path) as f:
        record = json.load(f)
    assert record["fields"] == ["perf_counter_s", "is_prefill", "num_seqs", "num_tokens", "num_decode_rows",
                                "done_s"]
    steps = record["steps"]
    times = [s[0] for s in steps]
    assert times == sorted(times)
    # read back after its launch, in launch order; a step with no sampling row (a middle chunk) has nothing to wait on
    done = [s[5] for s in steps if s[5] is not None]
    assert done == sorted(done) and all(s[5] is None or s[5] >= s[0] for s in steps)
    assert all(s[5] is not None for s in steps if not s[1])  # every decode step samples
    prompt_tokens = sum(tokens - decode_rows for _, is_prefill, _, tokens, decode_rows, _ in steps if is_prefill)
    assert prompt_tokens == sum(lengths)
    assert all(decode_rows == (rows if not is_prefill else decode_rows) for _, is_prefill, rows, _, decode_rows, _
               in steps)
    # each sequence samples once when its prompt's last chunk runs and once a decode step after that
    decode_tokens = sum(s[4] for s in steps)
    assert decode_tokens == len(lengths) * (new_tokens - 1)
    mixed = [s for s in steps if s[1] and s[4] > 0]
    # 64: the three prompts (60 tokens) in one step; 24: the short ones' rows decode beside the long one's chunks
    assert bool(mixed) == (num_batched == 24)


def test_trace_path_folder_must_exist(tmp_path):
    folder = str(tmp_path / "model")
    build_tiny_model(folder, "qwen3")
    with pytest.raises(ConfigError, match="step_trace_path"):
        LLM(folder, device="cpu", dtype="float32", max_model_len=128, step_trace_path=str(tmp_path / "no" / "t.json"))
