"""Kill switches: EngineConfig fields (LLM keywords), each with one environment override read once by the
registry (metainfer/config/env.py), reaching the build-time kernel selection.

On the CPU the selected op set is the torch reference whatever the switches say, so the tests record what
the ModelRunner passes to select_ops; the GPU suite measures what each switch does on the H200."""

from __future__ import annotations

import pathlib

import pytest
import torch

import metainfer.worker.model_runner as model_runner
from metainfer import LLM, SamplingParams
from metainfer.config import ConfigError
from metainfer.config.env import ENV_OVERRIDES, env_overrides
from tests.helpers.kernel_devices import ON_GPU
from tests.helpers.tiny_models import build_tiny_model

ENGINE = dict(device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("switches"))
    build_tiny_model(path, "qwen3")
    return path


@pytest.fixture
def recorded(monkeypatch):
    """The keyword arguments of every select_ops call (the CPU build then proceeds without PDL)."""
    seen = []
    real = model_runner.select_ops

    def recording_select_ops(device, **kwargs):
        seen.append(kwargs)
        return real(device, **{**kwargs, "pdl": False})

    monkeypatch.setattr(model_runner, "select_ops", recording_select_ops)
    monkeypatch.setattr(model_runner, "pdl_supported", lambda device: True)  # as on an sm_90 GPU
    for name in ENV_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    return seen


@pytest.mark.parametrize("kwargs, env, expected", [
    ({}, {}, {"pdl": True, "skinny_gemm": True, "fused_sampler": True}),
    ({"enable_pdl": False}, {}, {"pdl": False, "skinny_gemm": True, "fused_sampler": True}),
    ({"enable_skinny_gemm": False, "enable_fused_sampler": False}, {},
     {"pdl": True, "skinny_gemm": False, "fused_sampler": False}),
    ({}, {"METAINFER_DISABLE_PDL": "1", "METAINFER_SKINNY_GEMM": "0", "METAINFER_FUSED_SAMPLER": "0"},
     {"pdl": False, "skinny_gemm": False, "fused_sampler": False}),
    ({"enable_pdl": False}, {"METAINFER_DISABLE_PDL": "0"}, {"pdl": True, "skinny_gemm": True, "fused_sampler": True}),
])
def test_fields_and_overrides_reach_select_ops(folder, recorded, monkeypatch, kwargs, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    LLM(folder, **ENGINE, **kwargs)
    assert len(recorded) == 1 and {k: recorded[0][k] for k in expected} == expected


@pytest.mark.parametrize("kwargs, env, expected", [
    ({}, {}, True), ({"enable_cublaslt": False}, {}, False), ({}, {"METAINFER_CUBLASLT": "0"}, False),
    ({"enable_cublaslt": False}, {"METAINFER_CUBLASLT": "1"}, True)])
def test_the_cublaslt_switch_and_its_override_reach_the_config(folder, monkeypatch, kwargs, env, expected):
    """The engine's config carries it (the GPU test below checks what a CUDA build does with it)."""
    for name in ENV_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    llm = LLM(folder, **ENGINE, **kwargs)
    assert llm.llm_engine.config.enable_cublaslt is expected
    llm.close()


@pytest.mark.parametrize("kwargs, expected", [({}, False), ({"enable_cublaslt": True}, True)])
def test_an_mla_model_keeps_cublas_unless_asked(tmp_path, monkeypatch, kwargs, expected):
    """The default (None) resolves per model: DeepSeek-V2-Lite's decode lost 1.5% under cuBLASLt on an H100 (runs
    132-133) while Qwen3-8B gained (runs 129-130), so an MLA model keeps cuBLAS; an explicit value is kept."""
    for name in ENV_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    build_tiny_model(str(tmp_path), "deepseek_v2")
    llm = LLM(str(tmp_path), **ENGINE, **kwargs)
    assert llm.llm_engine.config.enable_cublaslt is expected
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not (ON_GPU and torch.cuda.is_available()), reason="needs METAINFER_TEST_GPU=1 and CUDA")
def test_a_cuda_engine_sets_cublaslt_while_it_lives_and_puts_the_setting_back(folder, monkeypatch):
    """On: cuBLASLt from the build (the graphs are captured with it) until close() restores the process's own
    setting; off: the process's setting is left alone."""
    for name in ENV_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    backend = torch._C._BlasBackend
    torch.backends.cuda.preferred_blas_library("cublas")
    try:
        for enabled, during in ((False, backend.Cublas), (True, backend.Cublaslt)):
            llm = LLM(folder, device="cuda", dtype="bfloat16", max_model_len=64, enable_cublaslt=enabled)
            assert torch.backends.cuda.preferred_blas_library() == during
            out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, temperature=0))
            assert len(out[0].outputs[0].token_ids) == 4
            llm.close()
            assert torch.backends.cuda.preferred_blas_library() == backend.Cublas
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


@pytest.mark.parametrize("failing_step", ["the runner's weights", "the engine's KV block manager"])
def test_a_build_that_fails_after_the_runner_set_the_blas_library_puts_it_back(folder, monkeypatch, failing_step):
    """The CUDA runner sets cuBLASLt before select_ops; a CPU build of torch refuses cuBLASLt, so here the runner's
    select_ops sets "ck" in its place (another process-wide value the getter reports). A later build step then
    raises, in the runner (its weights) or after it (the engine's block manager): the error reaches the caller
    and the process's setting is what it was before the engine."""
    import metainfer.engine.llm_engine as llm_engine

    for name in ENV_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    backend = torch._C._BlasBackend
    real = model_runner.select_ops

    def select_ops_after_setting_blas(device, **kwargs):
        torch.backends.cuda.preferred_blas_library("ck")
        return real(device, **kwargs)

    def fail(*args, **kwargs):
        raise RuntimeError(f"{failing_step} failed")

    monkeypatch.setattr(model_runner, "select_ops", select_ops_after_setting_blas)
    if failing_step == "the runner's weights":
        monkeypatch.setattr(model_runner, "load_model_weights", fail)
    else:
        monkeypatch.setattr(llm_engine, "BlockManager", fail)
    torch.backends.cuda.preferred_blas_library("cublas")
    try:
        with pytest.raises(RuntimeError, match=f"{failing_step} failed"):
            LLM(folder, **ENGINE)
        assert torch.backends.cuda.preferred_blas_library() == backend.Cublas
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


class _Holder:
    """A TP driver or launched group whose close() is recorded, and raises where `fails`."""

    def __init__(self, name: str, closed: list, fails: bool):
        self.name, self.closed, self.fails = name, closed, fails

    def close(self) -> None:
        self.closed.append(self.name)
        if self.fails:
            raise RuntimeError(f"{self.name} close failed")


def test_each_resource_is_given_back_whatever_another_raised(monkeypatch):
    """LLMEngine._release gives back the BLAS preference, the TP driver and the launched group each whatever an
    earlier one raised, and raises the first error once all were tried; a build that fails raises its own error,
    not a failed clean-up's, with everything given back."""
    from metainfer.engine.llm_engine import LLMEngine

    backend, closed = torch._C._BlasBackend, []

    def failing_build(self, config):
        torch.backends.cuda.preferred_blas_library("ck")
        self.tp_driver, self.launcher = _Holder("driver", closed, True), _Holder("launcher", closed, False)
        raise RuntimeError("the build failed")

    torch.backends.cuda.preferred_blas_library("cublas")
    try:
        monkeypatch.setattr(LLMEngine, "_build", failing_build)
        with pytest.raises(RuntimeError, match="the build failed"):
            LLMEngine(None)
        assert closed == ["driver", "launcher"] and torch.backends.cuda.preferred_blas_library() == backend.Cublas

        engine = LLMEngine.__new__(LLMEngine)
        for blas, driver_fails, first in (("cublas", True, "driver close failed"), ("no such", False, "Unknown")):
            closed.clear()
            torch.backends.cuda.preferred_blas_library("ck")
            engine._blas_before = blas
            engine.tp_driver, engine.launcher = _Holder("driver", closed, driver_fails), _Holder("launcher", closed,
                                                                                               False)
            with pytest.raises(RuntimeError, match=first):
                engine._release()
            assert closed == ["driver", "launcher"]
            assert torch.backends.cuda.preferred_blas_library() == (backend.Cublas if blas == "cublas" else backend.Ck)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def test_overrides_parse_only_their_values():
    assert env_overrides({}) == {}
    # the custom all-reduce's variable keeps its older lenient spelling
    for value, enabled in (("0", True), ("off", True), (" False ", True), ("1", False), ("yes", False), ("ON", False)):
        assert env_overrides({"METAINFER_DISABLE_CUSTOM_ALL_REDUCE": value}) == {"enable_custom_all_reduce": enabled}
    assert env_overrides({"METAINFER_DISABLE_CUSTOM_ALL_REDUCE": "1", "METAINFER_SKINNY_GEMM": ""}) == {
        "enable_custom_all_reduce": False}
    with pytest.raises(ConfigError, match="METAINFER_FUSED_SAMPLER"):
        env_overrides({"METAINFER_FUSED_SAMPLER": "off"})


@pytest.mark.parametrize("name, value", [("METAINFER_SKINNY_GEMM", "2"), ("METAINFER_DISABLE_PDL", "true"),
                                         ("METAINFER_FUSED_SAMPLER", "no"), ("METAINFER_CUBLASLT", "on"),
                                         ("METAINFER_DISABLE_CUSTOM_ALL_REDUCE", "maybe")])
@pytest.mark.parametrize("engine", [{}, {"tensor_parallel_size": 2}], ids=["tp1", "tp2"])
def test_unknown_values_are_rejected_before_anything_is_built(folder, monkeypatch, name, value, engine):
    """A typo is a ConfigError naming the variable, before any build or TP worker: an A/B run would otherwise
    measure the default twice."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=name):
        LLM(folder, **ENGINE, **engine)


def test_every_override_is_documented_and_maps_onto_a_field():
    from metainfer.config import EngineConfig

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    for name, (field_name, values) in ENV_OVERRIDES.items():
        assert name in readme and field_name in readme, name
        assert hasattr(EngineConfig("m"), field_name) and set(values.values()) == {True, False}, name


def test_a_context_past_the_models_positions_is_refused_unless_allowed(folder, monkeypatch):
    """The tiny model has 512 positions: max_model_len 1,024 is a ConfigError naming the field; the keyword or
    the variable (vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN) allows it; 512 itself is fine."""
    monkeypatch.delenv("METAINFER_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    engine = {**ENGINE, "max_model_len": 1024, "num_kv_blocks": 64}
    with pytest.raises(ConfigError, match="max_model_len 1024 is longer than the model's 512 positions"):
        LLM(folder, **engine)
    LLM(folder, **{**ENGINE, "max_model_len": 512}).close()
    LLM(folder, **engine, allow_long_max_model_len=True).close()
    monkeypatch.setenv("METAINFER_ALLOW_LONG_MAX_MODEL_LEN", "1")
    llm = LLM(folder, **engine)
    assert llm.llm_engine.config.max_model_len == 1024
    llm.close()
