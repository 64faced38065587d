"""One tiny random Qwen3 (real Qwen3 tokenizer and chat template) served in-process by uvicorn on
127.0.0.1 in a background thread, shared by the server tests of this package; a second LLM on the
same folder gives the references."""

from __future__ import annotations

import openai
import pytest

from metainfer import LLM
from metainfer.entrypoints.openai.api_server import build_app
from tests.helpers.server import KEY, MODEL, ServerThread
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
    llm = LLM(model_dir, device="cpu", dtype="float32")
    app = build_app(llm, served_model_names=[MODEL], api_key=KEY)
    srv = ServerThread(app).start()
    srv.app = app
    srv.state = app.state.server
    yield srv
    srv.stop()
    llm.close()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, timeout=60, max_retries=0)
