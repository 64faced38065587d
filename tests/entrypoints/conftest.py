"""One tiny random Qwen3 (real Qwen3 tokenizer and chat template) served in-process by uvicorn on
127.0.0.1 in a background thread, shared by the server tests of this package; a second LLM on the
same folder gives the references."""

from __future__ import annotations

import openai
import pytest

from metainfer import LLM
from tests.helpers.server import KEY, serving
from tests.helpers.tiny_models import build_tiny_model


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny-qwen3-serve"))
    build_tiny_model(folder, "qwen3", vocab_size=151936)
    return folder


@pytest.fixture(scope="package")
def ref(model_dir):
    llm = LLM(model_dir, device="cpu", dtype="float32")
    yield llm
    llm.close()


@pytest.fixture(scope="package")
def server(model_dir):
    with serving(LLM(model_dir, device="cpu", dtype="float32"), api_key=KEY) as srv:
        yield srv


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
