"""The OpenAI server over an MLX engine: the official client's completion and streamed chat equal the offline
torch CPU engine's greedy output (same scheduler, sampler and detokenizer behind both backends)."""

from __future__ import annotations

import pytest

pytest.importorskip("mlx.core", reason="MLX is not installed (pip install 'mlx[cpu]')")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from metainfer import LLM, SamplingParams  # noqa: E402
from metainfer.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.helpers.server import KEY, MODEL, ServerThread  # noqa: E402
from tests.helpers.tiny_models import build_tiny_model  # noqa: E402


def test_completion_and_streamed_chat_over_mlx_equal_the_torch_engine(tmp_path):
    folder = str(tmp_path)
    build_tiny_model(folder, "qwen3", vocab_size=151936, num_hidden_layers=1)
    ref = LLM(folder, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=32)
    llm = LLM(folder, device="mlx", dtype="float32", max_model_len=256, num_kv_blocks=32)
    with ServerThread(build_app(llm, served_model_names=[MODEL], api_key=KEY)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)
        got = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        want = ref.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=8,
                                                                       ignore_eos=True), use_tqdm=False)[0]
        assert got.choices[0].text == want.outputs[0].text
        messages = [{"role": "user", "content": "Say hi"}]
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                                stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        want_chat = ref.chat(messages, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)[0]
        assert text == want_chat.outputs[0].text
